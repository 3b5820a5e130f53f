"""What the model-shape check knows of the model config.json describes, and where that config comes from.

Plain data, cheap to import: the check (plan.model_check) compares a plan with an ExpectedModel;
it is built by importing transformers (plan.model_build, in a child process) or read back from
the cache (plan.model_cache), keyed by the config's exact bytes (ConfigSource).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..hf.config import load_config

BUILT_CONFIG = "config.json (built from the checkpoint's own records)"


@dataclass(frozen=True)
class ExpectedModel:
    """What `from_pretrained` of config.json's class expects to find in the folder."""

    architecture: str
    config_path: str
    shapes: dict[str, tuple[int, ...]]  # its state dict: parameters and persistent buffers
    tied: dict[str, str]  # a name transformers re-ties on load -> the name it shares the parameter with
    prefix: str  # base_model_prefix: a base model's names lack it, and transformers maps them
    ignore_missing: tuple[str, ...]  # patterns transformers itself does not miss
    ignore_unexpected: tuple[str, ...]
    base_only: bool = False  # config.json names no class: the base model, the head's tensors unchecked
    cached: str = ""  # the cache file it was read from ("": built by this run)
    # the class's _keep_in_fp32_modules_strict and _keep_in_fp32_modules (families.keep_fp32 reads them
    # from the source; the check compares): None where the build did not record them
    kept_fp32: tuple[tuple[str, ...], tuple[str, ...]] | None = None

    def as_json(self) -> dict:
        """What the cache keeps: all but where the config was (the same bytes may lie anywhere) and `cached`."""
        return {
            "architecture": self.architecture,
            "shapes": {name: list(shape) for name, shape in self.shapes.items()},
            "tied": dict(self.tied),
            "prefix": self.prefix,
            "ignore_missing": list(self.ignore_missing),
            "ignore_unexpected": list(self.ignore_unexpected),
            "base_only": self.base_only,
            "kept_fp32": None if self.kept_fp32 is None else [list(self.kept_fp32[0]), list(self.kept_fp32[1])],
        }

    @classmethod
    def from_json(cls, value: dict, config_path: str, cached: str = "") -> ExpectedModel:
        """The model `as_json` gave; ValueError (or KeyError, TypeError) for anything else."""
        shapes = {str(name): tuple(int(d) for d in shape) for name, shape in value["shapes"].items()}
        tied = {str(name): str(kept) for name, kept in value["tied"].items()}
        if not isinstance(value["architecture"], str) or not isinstance(value["prefix"], str):
            raise ValueError("architecture and prefix are strings")
        return cls(
            value["architecture"],
            config_path,
            shapes,
            tied,
            value["prefix"],
            tuple(str(p) for p in value["ignore_missing"]),
            tuple(str(p) for p in value["ignore_unexpected"]),
            base_only=bool(value["base_only"]),
            cached=cached,
            kept_fp32=_kept(value.get("kept_fp32")),
        )


def _kept(value) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    if value is None:
        return None
    strict, loose = value
    return tuple(str(p) for p in strict), tuple(str(p) for p in loose)


@dataclass(frozen=True)
class ConfigSource:
    """A config.json to build the model of: how messages name it, its content and its exact bytes (the
    file's, or a built config's canonical JSON), which the cache key is made of and the model is built from."""

    path: str
    config: dict
    data: bytes


def config_source(config_dir: str | None, built: dict | None = None) -> ConfigSource | str:
    """The config the check builds (`built`: the config.json a reader built, used when there is no
    config_dir), or why there is none to build. BadInput for a config.json that is not a JSON object."""
    if not config_dir and built is not None:
        data = json.dumps(built, sort_keys=True, separators=(",", ":")).encode()
        return ConfigSource(BUILT_CONFIG, built, data)
    if not config_dir or not os.path.isfile(os.path.join(config_dir, "config.json")):
        return "no config.json"
    path = os.path.join(config_dir, "config.json")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        data = b""
    return ConfigSource(path, load_config(path), data)  # load_config: the one error for a config that is not JSON
