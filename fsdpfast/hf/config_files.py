"""The config files a merged Hugging Face folder gets: copied from a config folder (weights and
training state never), or the config.json a reader built, each with the dtype written."""

from __future__ import annotations

import os

from ..io.target import Target
from ..manifest import MANIFEST_NAME  # a --config folder's manifest describes other weights: not copied
from .config import load_config

# Weight files and indexes never copied from a config folder (it may be a whole base model), nor
# pickles and training state (it may be an accelerate or Trainer checkpoint folder: rng states, trainer_state.json).
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
    ".distcp",
    ".index.json",
    ".pkl",
)
_TRAINING_STATE = ("trainer_state.json",)


def copy_config_files(config_dir: str, target: Target, torch_dtype: str | None) -> list[str]:
    """Copy config, generation config, tokenizer and custom-code files; weights are never copied.

    With a target dtype, config.json's dtype entry is updated to what was written.
    """
    copied = []
    for entry in sorted(os.listdir(config_dir)):
        source = os.path.join(config_dir, entry)
        if (
            not os.path.isfile(source)
            or entry.endswith(_WEIGHT_SUFFIXES)
            or entry.startswith(".")
            or entry in (MANIFEST_NAME, *_TRAINING_STATE)
        ):
            continue
        if entry == "config.json" and torch_dtype:
            target.write_json(entry, _config_with_dtype(source, torch_dtype))
        else:
            with open(source, "rb") as f:
                target.write_bytes(entry, f.read())
        copied.append(entry)
    return copied


def write_built_config(config: dict, target: Target, torch_dtype: str | None) -> list[str]:
    """Write the config.json a reader built (MergePlan.built_config), its dtype the one written."""
    target.write_json("config.json", with_dtype(config, torch_dtype) if torch_dtype else config)
    return ["config.json"]


def with_dtype(config: dict, torch_dtype: str) -> dict:
    """The config with its dtype entry (`dtype`, or transformers 4's `torch_dtype`) set to what was written."""
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    return {**config, **dict.fromkeys(keys, torch_dtype)}


def _config_with_dtype(source: str, torch_dtype: str) -> dict:
    return with_dtype(load_config(source), torch_dtype)
