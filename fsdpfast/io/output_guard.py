"""One merge at a time per output folder, and the leftovers of a killed one cleaned up.

Beside OUT_DIR (in its parent) a merge holds an exclusive `flock` on `.OUT.fsdpfast-lock`.
The kernel drops the lock when its holder dies, even by SIGKILL, so a lock file left behind
by a killed run is taken over by the next one; a live holder makes a second merge stop with
one line. Under the lock, folders a killed run left beside OUT_DIR are removed: staging
folders (`.OUT.fsdpfast-*`) and, from an interrupted --overwrite swap, `.OUT.old-*`: cleared of
what the earlier merge wrote (`settle_old`) only when its `published` marker says the new OUT_DIR
was renamed into place; otherwise its previous OUT_DIR is put back where OUT_DIR is absent or an
empty folder, and kept where it is (named in a warning, the folder unmarked) where OUT_DIR is
anything else: a folder existing at OUT_DIR is never taken for the new output. Only folders whose marker file names this very
OUT_DIR are touched, so nothing a user made and no other output's leftovers can be removed.
"""

from __future__ import annotations

import fcntl
import os
import shutil

from ..errors import BadInput
from .earlier_output import kept_note, remove_written

STAGING_MARKER = ".fsdpfast-staging"  # inside a staging folder; holds the OUT_DIR it is for
OLD_MARKER = ".fsdpfast-old"  # inside the folder an --overwrite moves the previous OUT_DIR into
PUBLISHED_MARKER = ".fsdpfast-published"  # beside it, once the new OUT_DIR was renamed into place


def lock_path(out_dir: str) -> str:
    parent, name = os.path.split(out_dir)
    return os.path.join(parent, f".{name}.fsdpfast-lock")


class OutputLock:
    """An exclusive lock on OUT_DIR's lock file; `release` unlinks the file and unlocks."""

    def __init__(self, out_dir: str):
        self.path = lock_path(out_dir)
        parent = os.path.dirname(self.path)
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise BadInput(
                    f"cannot write in {parent} ({exc.strerror}); choose an output folder where you can write"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise BadInput(
                    f"{out_dir}: another fsdpfast merge into this folder is running (it holds {self.path}); "
                    "wait for it to finish or choose another output folder"
                ) from None
            # The holder we waited on may have unlinked the file before we locked it: only a lock
            # on the file that is still at `path` counts.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)  # while still locked, so no one can lock the old file and think it is current
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None


def write_marker(folder: str, marker: str, out_dir: str) -> None:
    with open(os.path.join(folder, marker), "w") as f:
        f.write(out_dir)


def remove_leftovers(out_dir: str) -> list[str]:
    """Clean what killed merges into `out_dir` left beside it (call with the lock held); a warning for
    each folder kept because it holds what fsdpfast did not write."""
    parent, name = os.path.split(out_dir)
    warnings = []
    for entry in sorted(os.listdir(parent)):
        folder = os.path.join(parent, entry)
        if entry.startswith(f".{name}.fsdpfast-") and _marked(folder, STAGING_MARKER, out_dir):
            shutil.rmtree(folder)
        elif entry.startswith(f".{name}.old-") and _marked(folder, OLD_MARKER, out_dir):
            if os.path.isfile(os.path.join(folder, PUBLISHED_MARKER)):
                kept = settle_old(folder, out_dir)
            else:  # killed mid-swap: the earlier OUT_DIR comes back, or stays where it is
                kept = restore_previous(folder, out_dir)
            if kept:
                warnings.append(kept)
    return warnings


def restore_previous(folder: str, out_dir: str) -> str | None:
    """Put the previous OUT_DIR an unpublished --overwrite moved into `folder` back at `out_dir`, when
    that is absent or an empty folder (which it replaces), and remove `folder`. When anything else is at
    `out_dir` the previous one stays in `folder`, unmarked so that no later run touches it: the
    warning that says where it was kept, or None."""
    previous = os.path.join(folder, "previous")
    if os.path.isdir(previous) and not os.path.islink(previous):
        try:
            if os.path.isdir(out_dir) and not os.path.islink(out_dir) and not os.listdir(out_dir):
                os.rmdir(out_dir)  # an empty folder made meanwhile: the earlier merge takes its place
            if not os.path.lexists(out_dir):
                os.rename(previous, out_dir)
        except OSError:
            pass
        if os.path.lexists(previous):
            os.unlink(os.path.join(folder, OLD_MARKER))
            return (
                f"the earlier merge into {out_dir} was not replaced (the new output was never published) and "
                f"something else is now at {out_dir}: the earlier merge is kept in {previous}"
            )
    return settle_old(folder, out_dir)  # nothing left of it: its markers go


def settle_old(folder: str, out_dir: str) -> str | None:
    """Clear the folder an --overwrite moved the previous OUT_DIR into, once the new one is in place
    (or when nothing of the previous one is left in it):
    only what the earlier merge wrote is removed. Anything else found in it is kept there, the
    folder unmarked so that no later run touches it: the warning that says so, or None."""
    previous = os.path.join(folder, "previous")
    left = ["previous (a link)"] if os.path.islink(previous) else []
    if not left and os.path.lexists(previous):
        left = remove_written(previous)
    if left:
        os.unlink(os.path.join(folder, OLD_MARKER))
        return kept_note(previous, left, out_dir)
    shutil.rmtree(folder, ignore_errors=True)  # its marker alone
    return None


def _marked(folder: str, marker: str, out_dir: str) -> bool:
    if os.path.islink(folder) or not os.path.isdir(folder):
        return False
    try:
        with open(os.path.join(folder, marker)) as f:
            return f.read() == out_dir
    except (OSError, UnicodeDecodeError):
        return False
