"""The output folder: built under a hidden sibling name, published by one rename when complete.

Only one merge into an OUT_DIR runs at a time (output_guard), and it first removes what a
killed one left there. --overwrite replaces only an empty folder or an earlier fsdpfast output.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile

from .configs import load_config
from .errors import BadInput
from .manifest import MANIFEST_NAME  # a merged folder given as --config: its manifest describes other weights
from .output_guard import OLD_MARKER, STAGING_MARKER, OutputLock, remove_leftovers, write_marker

# Weight files and indexes never copied from a config folder (it may be a whole base model), nor
# pickles and training state (it may be an accelerate or Trainer checkpoint folder: rng states, trainer_state.json).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".distcp", ".index.json",
                    ".pkl")
_TRAINING_STATE = ("trainer_state.json",)


class StagingFolder:
    """A hidden folder beside OUT_DIR; `publish` renames it into place, `discard` cleans up after either."""

    def __init__(self, out_dir: str, overwrite: bool):
        self.out_dir = os.path.abspath(out_dir)
        parent = os.path.dirname(self.out_dir)
        self._check_out_dir(out_dir, overwrite)
        if not os.path.isdir(parent):
            raise BadInput(f"{parent}: the output folder's parent does not exist")
        self.published = False
        self._old: str | None = None  # where --overwrite moves the previous OUT_DIR (as `previous`)
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
        if not os.path.lexists(self.out_dir):
            return
        if not overwrite:
            raise BadInput(f"{out_dir} already exists; choose another output folder or pass --overwrite")
        if not os.path.isdir(self.out_dir):
            raise BadInput(f"{out_dir} exists and is not a folder; it will not be replaced")
        if not replaceable(self.out_dir):
            raise BadInput(f"{out_dir} holds files fsdpfast did not write (no {MANIFEST_NAME}); "
                           "--overwrite replaces only an empty folder or an earlier merge: remove it yourself or choose another folder")

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def publish(self) -> None:
        """Rename the staging folder to OUT_DIR (--overwrite: after moving the previous one aside).

        Ctrl-C and SIGTERM arrive as KeyboardInterrupt between any two bytecodes, even right
        after a rename returned, so on any exception whether OUT_DIR was published is read from
        the folders themselves; `discard` then removes or puts back the previous OUT_DIR.
        """
        _fsync_dir(self.path)
        parent, name = os.path.split(self.out_dir)
        try:
            if os.path.lexists(self.out_dir):
                # Named before it exists, so an interrupt right after mkdir still finds it.
                self._old = os.path.join(parent, f".{name}.old-{secrets.token_hex(8)}")
                os.mkdir(self._old, 0o700)
                write_marker(self._old, OLD_MARKER, self.out_dir)  # a SIGKILLed run is undone by the next one
                os.rename(self.out_dir, os.path.join(self._old, "previous"))
            # The marker is not part of the output; a SIGKILL in the microseconds from here to the
            # rename leaves an unmarked staging folder that no later run removes.
            os.unlink(self.file(STAGING_MARKER))
            os.rename(self.path, self.out_dir)
            self.published = True
        except BaseException:
            self.published = not os.path.lexists(self.path)  # the rename into place had happened
            raise
        _fsync_dir(parent)

    def discard(self) -> None:
        """Remove the staging folder unless published, settle an --overwrite swap (the previous
        OUT_DIR removed once the new one is in place, put back otherwise), release the lock."""
        try:
            if self._old:
                self._settle_previous()
            if not self.published:
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            self.lock.release()

    def _settle_previous(self) -> None:
        previous = os.path.join(self._old, "previous")
        if not self.published and os.path.lexists(previous):
            if os.path.lexists(self.out_dir):  # cannot happen under the lock; never delete the previous output
                return
            os.rename(previous, self.out_dir)
        shutil.rmtree(previous, ignore_errors=True)  # before the marker, so a SIGKILL here is still cleaned up
        shutil.rmtree(self._old, ignore_errors=True)


def replaceable(out_dir: str) -> bool:
    """May --overwrite replace this existing folder: empty, or an earlier fsdpfast output (its manifest)."""
    try:
        entries = os.listdir(out_dir)
    except OSError as exc:
        raise BadInput(f"{out_dir}: cannot read the existing output folder ({exc.strerror})") from None
    return not entries or os.path.isfile(os.path.join(out_dir, MANIFEST_NAME))


def check_output_place(out_dir: str, checkpoint: str, config: str | None) -> None:
    """Refuse an OUT_DIR equal to, above or inside the checkpoint or --config folder.

    Replacing or containing a source would destroy it; inside one, nothing would be overwritten
    file by file, but a later merge of the checkpoint would find the output among the shards, and
    --overwrite of a folder inside them would delete part of a source: fsdpfast never writes into
    what it reads. Symbolic links and dot segments are resolved first.
    """
    out = os.path.realpath(out_dir)
    for role, folder in (("checkpoint", checkpoint), ("--config", config)):
        if folder is None:
            continue
        source = os.path.realpath(folder)
        if _within(source, out):
            raise BadInput(f"{out_dir}: the output folder would replace or contain the {role} folder {folder}; "
                           "fsdpfast never writes into its inputs, choose a folder outside it")
        if _within(out, source):
            raise BadInput(f"{out_dir}: the output folder is inside the {role} folder {folder}; "
                           "fsdpfast never writes into its inputs, choose a folder outside it")


def _within(path: str, folder: str) -> bool:
    """`path` is `folder` or below it (both resolved)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


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
        if (not os.path.isfile(source) or entry.endswith(_WEIGHT_SUFFIXES) or entry.startswith(".")
                or entry in (MANIFEST_NAME, *_TRAINING_STATE)):
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
