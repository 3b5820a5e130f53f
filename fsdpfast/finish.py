"""The output folder: built under a hidden sibling name, published by one rename when complete.

Only one merge into an OUT_DIR runs at a time (output_guard), and it first removes what a
killed one left there.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

from .configs import load_config
from .errors import BadInput
from .manifest import MANIFEST_NAME  # a merged folder given as --config: its manifest describes other weights
from .output_guard import OLD_MARKER, STAGING_MARKER, OutputLock, remove_leftovers, write_marker

# Weight files and indexes never copied from a config folder (it may be a whole base model).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".distcp", ".index.json")


class StagingFolder:
    """A hidden folder beside OUT_DIR; `publish` renames it into place, anything else removes it."""

    def __init__(self, out_dir: str, overwrite: bool):
        self.out_dir = os.path.abspath(out_dir)
        parent = os.path.dirname(self.out_dir)
        self._check_out_dir(out_dir, overwrite)
        if not os.path.isdir(parent):
            raise BadInput(f"{parent}: the output folder's parent does not exist")
        self.published = False
        self.lock = OutputLock(self.out_dir)  # a second merge into OUT_DIR stops here
        try:
            self.cleaned = remove_leftovers(self.out_dir)
            self._check_out_dir(out_dir, overwrite)  # a killed --overwrite may have put OUT_DIR back
            try:
                self.path = tempfile.mkdtemp(prefix=f".{os.path.basename(self.out_dir)}.fsdpfast-", dir=parent)
            except OSError as exc:
                raise BadInput(f"cannot write in {parent} ({exc.strerror})") from None
            write_marker(self.path, STAGING_MARKER, self.out_dir)
        except BaseException:
            self.lock.release()
            raise

    def _check_out_dir(self, out_dir: str, overwrite: bool) -> None:
        if os.path.exists(self.out_dir) and not overwrite:
            raise BadInput(f"{out_dir} already exists; choose another output folder or pass --overwrite")
        if os.path.exists(self.out_dir) and not os.path.isdir(self.out_dir):
            raise BadInput(f"{out_dir} exists and is not a folder; it will not be replaced")

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def publish(self) -> None:
        _fsync_dir(self.path)
        old = None
        if os.path.exists(self.out_dir):  # --overwrite: swap in the new folder, then drop the old one
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(self.out_dir)}.old-", dir=os.path.dirname(self.out_dir))
            write_marker(old, OLD_MARKER, self.out_dir)  # so a run killed before the next rename is undone
            os.rename(self.out_dir, os.path.join(old, "previous"))
        # The marker is not part of the output; a kill in the microseconds from here to the rename
        # leaves an unmarked staging folder that no later run removes.
        os.unlink(self.file(STAGING_MARKER))
        try:
            os.rename(self.path, self.out_dir)
        except OSError:
            if old:
                os.rename(os.path.join(old, "previous"), self.out_dir)
                shutil.rmtree(old, ignore_errors=True)
            raise
        _fsync_dir(os.path.dirname(self.out_dir))
        self.published = True
        if old:
            shutil.rmtree(old, ignore_errors=True)

    def discard(self) -> None:
        """Remove the staging folder unless published, and let the next merge into OUT_DIR in."""
        if not self.published:
            shutil.rmtree(self.path, ignore_errors=True)
        self.lock.release()


def check_outside_sources(out_dir: str, checkpoint: str, config: str | None) -> None:
    """Refuse an OUT_DIR inside the checkpoint or --config folder (or equal to / above --config).

    Nothing there would be overwritten file by file, but fsdpfast never writes into what it
    reads: a later merge of the checkpoint would find the output among the shards, and
    --overwrite of a folder inside them would delete part of a source.
    """
    out = os.path.realpath(out_dir)
    for role, folder in (("checkpoint", checkpoint), ("--config", config)):
        if folder is None:
            continue
        source = os.path.realpath(folder)
        if out.startswith(source.rstrip(os.sep) + os.sep) or (role == "--config" and
                                                               (source + os.sep).startswith(out.rstrip(os.sep) + os.sep)):
            raise BadInput(f"{out_dir}: the output folder is inside the {role} folder {folder}; "
                           "fsdpfast never writes into its inputs, choose a folder outside it")


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
