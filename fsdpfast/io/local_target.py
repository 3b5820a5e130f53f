"""The local Target (io.target): the output folder, built under a hidden sibling name and
published by one rename when complete.

Only one merge into an OUT_DIR runs at a time (io.output_guard), and it first removes what a
killed one left there. An empty OUT_DIR is replaced; --overwrite replaces a folder holding only
what an earlier merge wrote, as its manifest lists it (io.earlier_output), and removes nothing
else. Other processes of a merge under torchrun write into the same staging folder through
`LocalTarget.join` (a shared filesystem).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from ..errors import BadInput, option
from ..manifest import MANIFEST_NAME, WRITTEN
from .earlier_output import overwrite_refusal, written_files
from .local_file import LocalFile
from .output_guard import (
    OLD_MARKER,
    PUBLISHED_MARKER,
    STAGING_MARKER,
    OutputLock,
    remove_leftovers,
    restore_previous,
    settle_old,
    write_marker,
)

log = logging.getLogger("fsdpfast")  # what is kept of an earlier OUT_DIR, for Python callers too


class LocalTarget:
    """A hidden folder beside OUT_DIR; `publish` renames it into place, `discard` cleans up after either.

    OUT_DIR's missing parents are created (and removed again if nothing is published). The output
    gets the mode a `mkdir` gives under the user's umask; an existing empty OUT_DIR, which the
    user made, is replaced in one rename and its mode kept.
    """

    whole_files = False  # processes share a file by byte ranges (io.target)

    def __init__(self, out_dir: str, overwrite: bool):
        self.out_dir = os.path.abspath(out_dir)
        self.overwrite = overwrite
        parent = os.path.dirname(self.out_dir)
        self._check_out_dir(out_dir, overwrite)
        self.published = False
        self.warnings: list[str] = []  # what was kept from an earlier OUT_DIR because fsdpfast did not write it
        self._old: str | None = None  # where --overwrite moves the previous OUT_DIR (as `previous`)
        self._made_parents = make_parents(parent)
        self.path: str | None = None  # the staging folder, once made
        try:
            self.lock = OutputLock(self.out_dir)  # a second merge into OUT_DIR stops here
        except BaseException:
            remove_empty(self._made_parents)
            raise
        try:
            for kept in remove_leftovers(self.out_dir):
                log.warning("%s", kept)
                self.warnings.append(kept)
            self._check_out_dir(out_dir, overwrite)  # a killed --overwrite may have put OUT_DIR back
            self.path = _make_staging(parent, os.path.basename(self.out_dir))
            write_marker(self.path, STAGING_MARKER, self.out_dir)
        except BaseException:  # SIGTERM or Ctrl-C included: nothing of this merge is left
            if self.path is not None:
                shutil.rmtree(self.path, ignore_errors=True)
            self.lock.release()
            remove_empty(self._made_parents)
            raise

    def _check_out_dir(self, out_dir: str, overwrite: bool) -> None:
        if not os.path.lexists(self.out_dir) or _empty_folder(self.out_dir):
            return
        if not os.path.isdir(self.out_dir):
            raise BadInput(f"{out_dir} exists and is not a folder; it will not be replaced")
        if not overwrite:
            held = "is a link to a folder" if os.path.islink(self.out_dir) else "is not empty"
            raise BadInput(
                f"{out_dir} already exists and {held}; choose another output folder, or pass "
                f"{option('overwrite', True)} to replace an earlier merge"
            )
        refusal = overwrite_refusal(self.out_dir, out_dir)
        if refusal:
            raise BadInput(refusal)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def token(self) -> str:
        return os.path.basename(self.path)

    @classmethod
    def join(cls, out_dir: str, token: str) -> JoinedTarget:
        """The staging folder `token` another process made beside `out_dir`, to write files into."""
        return JoinedTarget(out_dir, token)

    def open(self, name: str, size: int) -> LocalFile:
        return LocalFile(open_sized(self.file(name), size))

    @contextmanager
    def local_folder(self, name: str = "") -> Iterator[str]:
        """The staging folder itself (or a folder in it): what is written there is published with it."""
        folder = self.file(name) if name else self.path
        os.makedirs(folder, exist_ok=True)
        yield folder

    def write_bytes(self, name: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(self.file(name)), exist_ok=True)
        write_durably(self.file(name), data)

    def write_json(self, name: str, value: dict) -> None:
        self.write_bytes(name, json_bytes(value))

    def write_manifest(self, manifest: dict) -> None:
        """The manifest, written last: it lists every file written before it, with its size and
        st_mtime_ns, which is what a later --overwrite may remove."""
        self.write_json(MANIFEST_NAME, {**manifest, WRITTEN: written_files(self.path, leave_out=(STAGING_MARKER,))})

    def publish(self) -> None:
        """Rename the staging folder to OUT_DIR: in one step over an empty OUT_DIR (rename(2) replaces
        an empty folder), else (--overwrite of an earlier merge) after moving the previous one aside.

        Ctrl-C and SIGTERM arrive as KeyboardInterrupt between any two bytecodes, even right
        after a rename returned, so on any exception whether OUT_DIR was published is read from
        the folders themselves; `discard` then removes or puts back the previous OUT_DIR. Once
        published, the previous OUT_DIR loses what the earlier merge wrote (`warnings` says what
        else it held and where that was kept).
        """
        _fsync_dir(self.path)
        parent, name = os.path.split(self.out_dir)
        try:
            if _empty_folder(self.out_dir):
                os.chmod(self.path, stat.S_IMODE(os.stat(self.out_dir).st_mode))  # the user made it so
            elif os.path.lexists(self.out_dir):
                self._check_out_dir(self.out_dir, self.overwrite)  # what it holds may have changed meanwhile
                # Named before it exists, so an interrupt right after mkdir still finds it.
                self._old = os.path.join(parent, f".{name}.old-{secrets.token_hex(8)}")
                os.mkdir(self._old, 0o700)
                write_marker(self._old, OLD_MARKER, self.out_dir)  # a SIGKILLed run is undone by the next one
                os.rename(self.out_dir, os.path.join(self._old, "previous"))
            # The marker is not part of the output; a SIGKILL in the microseconds from here to the
            # rename leaves an unmarked staging folder that no later run removes.
            os.unlink(self.file(STAGING_MARKER))
            try:
                os.rename(self.path, self.out_dir)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                if not self._old:
                    raise BadInput(
                        f"{self.out_dir}: files appeared in the empty output folder during the merge; "
                        "nothing was published"
                    ) from None
                kept = restore_previous(self._old, self.out_dir)  # the earlier merge back, or kept and named
                where = f"the earlier merge is kept in {os.path.join(self._old, 'previous')}" if kept else ""
                self._old = None
                raise BadInput(
                    f"{self.out_dir}: files appeared in the output folder while the earlier merge was being "
                    f"replaced; nothing was published{'; ' + where if where else ''}"
                ) from None
            self.published = True
            if self._old:  # what lets a later run clear the previous OUT_DIR if this one is killed now
                write_marker(self._old, PUBLISHED_MARKER, self.out_dir)
        except BaseException:
            self.published = not os.path.lexists(self.path)  # the rename into place had happened
            raise
        _fsync_dir(parent)
        if self._old:
            self._settle_previous()  # here, so that what it kept is in the report

    def discard(self) -> None:
        """Remove the staging folder unless published, settle an --overwrite swap (the previous
        OUT_DIR removed once the new one is in place, put back otherwise), release the lock and
        remove the parents this merge created if nothing was published."""
        try:
            if self._old:
                self._settle_previous()
            if not self.published:
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            self.lock.release()
            if not self.published:
                remove_empty(self._made_parents)

    def _settle_previous(self) -> None:
        if self.published:
            if not os.path.isfile(os.path.join(self._old, PUBLISHED_MARKER)):  # interrupted before it was written
                write_marker(self._old, PUBLISHED_MARKER, self.out_dir)
            kept = settle_old(self._old, self.out_dir)  # only what the earlier merge wrote; the marker last
        else:
            kept = restore_previous(self._old, self.out_dir)  # never deletes the previous output
        self._old = None
        if kept:
            log.warning("%s", kept)
            self.warnings.append(kept)


class JoinedTarget:
    """Another process's staging folder (a merge under torchrun): files are opened in it, nothing else.
    Its maker locks, publishes and discards it."""

    published = False
    whole_files = False
    warnings: tuple[str, ...] = ()

    def __init__(self, out_dir: str, token: str):
        self.out_dir = os.path.abspath(out_dir)
        self.token = token
        self.path = os.path.join(os.path.dirname(self.out_dir), token)
        if not os.path.isfile(os.path.join(self.path, STAGING_MARKER)):
            raise BadInput(
                f"{self.path}: the staging folder rank 0 made beside its output folder is not there on "
                "this rank; every rank's --out must be the same folder of a filesystem they share"
            )

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def open(self, name: str, size: int) -> LocalFile:
        return LocalFile(open_sized(self.file(name), size))

    def write_bytes(self, name: str, data: bytes) -> None:
        raise RuntimeError("only the process that made the target writes whole files into it")

    write_json = write_bytes

    def local_folder(self, name: str = "") -> AbstractContextManager[str]:
        raise RuntimeError("only the process that made the target writes whole files into it")

    def write_manifest(self, manifest: dict) -> None:
        raise RuntimeError("only the process that made the target writes the manifest")

    def publish(self) -> None:
        raise RuntimeError("only the process that made the target publishes it")

    def discard(self) -> None:
        pass


def open_sized(path: str, size: int) -> int:
    """Open (creating) an output file for writing at offsets, `size` bytes long. Several processes
    may do this at once: setting the same length twice changes nothing, and no write ends past it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)  # less the umask, as open() gives
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_staging(parent: str, name: str) -> str:
    """A new hidden folder beside OUT_DIR, made by mkdir so it has the mode OUT_DIR would get."""
    for _ in range(100):
        path = os.path.join(parent, f".{name}.fsdpfast-{secrets.token_hex(8)}")
        try:
            os.mkdir(path, 0o777)  # less the umask, as any mkdir
            return path
        except FileExistsError:
            continue
        except OSError as exc:
            raise BadInput(f"cannot write in {parent} ({exc.strerror})") from None
    raise BadInput(f"cannot make a staging folder in {parent}")


def make_parents(folder: str) -> list[str]:
    """Create `folder` and its missing parents (as mkdir -p); the folders created, deepest first."""
    missing = []
    while not os.path.isdir(folder):
        if os.path.lexists(folder):
            raise BadInput(f"{folder} is not a folder; the output folder cannot be made inside it")
        missing.append(folder)
        folder = os.path.dirname(folder)
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o777)
        except FileExistsError:
            if not os.path.isdir(path):
                raise BadInput(f"{path} is not a folder; the output folder cannot be made inside it") from None
        except OSError as exc:
            remove_empty(missing)
            raise BadInput(
                f"cannot create {path} ({exc.strerror}); choose an output folder where you can write"
            ) from None
    return missing


def remove_empty(folders: list[str]) -> None:
    """Remove the folders a merge created for its output, deepest first, where still empty."""
    for path in folders:
        try:
            os.rmdir(path)
        except OSError:
            return


def _empty_folder(path: str) -> bool:
    """A real folder (not a link to one) holding nothing."""
    try:
        return not os.path.islink(path) and os.path.isdir(path) and not os.listdir(path)
    except OSError:
        return False


def json_bytes(value: dict) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()


def write_durably(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
