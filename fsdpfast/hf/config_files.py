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


# Sub-folders a tokenizer's or processor's save_pretrained writes beside its files: the chat
# templates other than the default one (chat_template.jinja), and a processor's further tokenizers,
# each in a folder named after its attribute (qformer_tokenizer/, holding a tokenizer_config.json).
_CHAT_TEMPLATES = "additional_chat_templates"


def copy_config_files(
    config_dir: str, target: Target, torch_dtype: str | None, quantization: dict | None = None
) -> list[str]:
    """Copy config, generation config, tokenizer, processor, chat-template and custom-code files
    byte for byte; weights are never copied.

    With a target dtype, config.json's dtype entry is updated to what was written; `quantization`
    (--dtype fp8) becomes its quantization_config.
    """
    copied = []
    for entry in _copied(config_dir):
        source = os.path.join(config_dir, entry)
        if entry == "config.json" and (torch_dtype or quantization):
            config = load_config(source)
            target.write_json(
                entry, with_quantization(with_dtype(config, torch_dtype) if torch_dtype else config, quantization)
            )
        else:
            with open(source, "rb") as f:
                target.write_bytes(entry, f.read())
        copied.append(entry)
    return copied


def _copied(config_dir: str) -> list[str]:
    """The files copied, relative to `config_dir`: its own, then those of the sidecar sub-folders."""
    entries = sorted(os.listdir(config_dir))
    names = [e for e in entries if _copied_file(config_dir, e)]
    for folder in entries:
        path = os.path.join(config_dir, folder)
        # a real sub-folder only: a link could lead anywhere (its files may be links, as the Hub cache makes them)
        if (
            not folder.startswith(".")
            and not os.path.islink(path)
            and os.path.isdir(path)
            and _sidecar_folder(path, folder)
        ):
            names += [f"{folder}/{e}" for e in sorted(os.listdir(path)) if _copied_file(path, e)]
    return names


def _copied_file(folder: str, entry: str) -> bool:
    return (
        os.path.isfile(os.path.join(folder, entry))
        and not entry.endswith(_WEIGHT_SUFFIXES)
        and not entry.startswith(".")
        and entry not in (MANIFEST_NAME, *_TRAINING_STATE)
    )


def _sidecar_folder(path: str, name: str) -> bool:
    return name == _CHAT_TEMPLATES or (
        name.endswith("tokenizer") and os.path.isfile(os.path.join(path, "tokenizer_config.json"))
    )


def write_built_config(
    config: dict, target: Target, torch_dtype: str | None, quantization: dict | None = None
) -> list[str]:
    """Write the config.json a reader built (MergePlan.built_config), its dtype the one written."""
    target.write_json(
        "config.json", with_quantization(with_dtype(config, torch_dtype) if torch_dtype else config, quantization)
    )
    return ["config.json"]


def with_dtype(config: dict, torch_dtype: str) -> dict:
    """The config with its dtype entry (`dtype`, or transformers 4's `torch_dtype`) set to what was written."""
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    return {**config, **dict.fromkeys(keys, torch_dtype)}


def with_quantization(config: dict, quantization: dict | None) -> dict:
    """The config with `quantization` as its quantization_config (--dtype fp8), else as it is."""
    return config if quantization is None else {**config, "quantization_config": quantization}
