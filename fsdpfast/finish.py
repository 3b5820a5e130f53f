"""The output folder: built under a hidden sibling name, published by one rename when complete."""
from __future__ import annotations

import json
import os
import shutil
import tempfile

from .configs import load_config
from .errors import BadInput
from .manifest import MANIFEST_NAME  # a merged folder given as --config: its manifest describes other weights

# Weight files and indexes never copied from a config folder (it may be a whole base model).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".distcp", ".index.json")


class StagingFolder:
    """A hidden folder beside OUT_DIR; `publish` renames it into place, anything else removes it."""

    def __init__(self, out_dir: str, overwrite: bool):
        self.out_dir = os.path.abspath(out_dir)
        parent = os.path.dirname(self.out_dir)
        if os.path.exists(self.out_dir) and not overwrite:
            raise BadInput(f"{out_dir} already exists; choose another output folder or pass --overwrite")
        if os.path.exists(self.out_dir) and not os.path.isdir(self.out_dir):
            raise BadInput(f"{out_dir} exists and is not a folder; it will not be replaced")
        if not os.path.isdir(parent):
            raise BadInput(f"{parent}: the output folder's parent does not exist")
        try:
            self.path = tempfile.mkdtemp(prefix=f".{os.path.basename(self.out_dir)}.fsdpfast-", dir=parent)
        except OSError as exc:
            raise BadInput(f"cannot write in {parent} ({exc.strerror})") from None
        self.published = False

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def publish(self) -> None:
        _fsync_dir(self.path)
        old = None
        if os.path.exists(self.out_dir):  # --overwrite: swap in the new folder, then drop the old one
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(self.out_dir)}.old-", dir=os.path.dirname(self.out_dir))
            os.rename(self.out_dir, os.path.join(old, "previous"))
        os.rename(self.path, self.out_dir)
        _fsync_dir(os.path.dirname(self.out_dir))
        self.published = True
        if old:
            shutil.rmtree(old, ignore_errors=True)

    def discard(self) -> None:
        if not self.published:
            shutil.rmtree(self.path, ignore_errors=True)


def write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def copy_config_files(config_dir: str, staging: StagingFolder, torch_dtype: str | None) -> list[str]:
    """Copy config, generation config, tokenizer and custom-code files; weights are never copied.

    With a target dtype, config.json's dtype entry is updated to what was written.
    """
    copied = []
    for entry in sorted(os.listdir(config_dir)):
        source = os.path.join(config_dir, entry)
        if not os.path.isfile(source) or entry.endswith(_WEIGHT_SUFFIXES) or entry.startswith(".") or entry == MANIFEST_NAME:
            continue
        if entry == "config.json" and torch_dtype:
            _write_config_with_dtype(source, staging.file(entry), torch_dtype)
        else:
            shutil.copyfile(source, staging.file(entry))
        copied.append(entry)
    return copied


def _write_config_with_dtype(source: str, target: str, torch_dtype: str) -> None:
    config = load_config(source)
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    for key in keys:
        config[key] = torch_dtype
    write_json(target, config)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
