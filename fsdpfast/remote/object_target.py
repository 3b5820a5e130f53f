"""A Target (io.target) whose files are objects under an s3:// (gs://, az://) prefix.

Each weights file is one multipart upload, streamed while the merge goes on. Nothing is staged on local
disk, and what the upload holds in memory is capped for the whole target, not per file:
- UPLOAD_BYTES (64 MB) in the client: one file streams at a time (the others wait for it: the merge writes
  its files one after another), its writer sending UPLOADS (3) parts of PART_BYTES (16 MB) at once while
  it fills the next one. Measured (benchmarks/object_store_merge.py, docs/performance.md): a 337 MB
  checkpoint merged local -> s3:// at 442 MB peak RSS (1159 MB before this cap), s3:// -> s3:// at 456 MB
  against 260 MB for download, local merge and upload.
- The engines' window (torch, cuda) holds the tensors of the batch being filled (execute.runner: at most
  64 MB, or one larger tensor where the sources are local files, which the runner does not cut), each in
  its own buffer, streamed and dropped as soon as its view is released (filled) and every byte before it
  is streamed; never a whole file.
- Bytes written in order are handed to the client without a copy; a range written ahead of the next byte
  owed (not done by the merge's writers, which write in file order) is copied and held until the gap
  before it is filled.

A store has no rename, so the folder is made loadable last: the weights and the small files first,
config.json after them and the manifest (which lists every object written) last. Until `publish`
returns, `discard` aborts the pending uploads and deletes every object written. An existing prefix is
refused without --overwrite; --overwrite is refused where the prefix holds an object the earlier
manifest does not list (fsdpfast did not write it), and otherwise deletes the earlier output first:
a failed --overwrite leaves the prefix empty, never a mix of two merges.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from contextlib import contextmanager

from ..errors import BadInput, FsdpfastError
from ..manifest import MANIFEST_NAME, WRITTEN
from .stores import store_for

PART_BYTES = 16 << 20  # one part of a multipart upload (S3's minimum 5 MB; at most 10,000 parts: 160 GB a file)
UPLOADS = 3  # parts sent at once by the file streaming; with the one it fills, UPLOAD_BYTES held in the client
UPLOAD_BYTES = PART_BYTES * (UPLOADS + 1)  # the whole target's upload bytes in memory at once
CONFIG = "config.json"
log = logging.getLogger("fsdpfast")


class UploadFailed(FsdpfastError):
    """A part or the completion of an output object's multipart upload failed (after the client's retries)."""


class ObjectTarget:
    published = False

    def __init__(self, url: str, overwrite: bool):
        self.url = url.rstrip("/")
        self.store, self.prefix = store_for(self.url)
        self.warnings: list[str] = []
        self._written: dict[str, int] = {}  # object name (relative) -> size, every object this merge put
        self._small: dict[str, bytes] = {}  # config, index, manifest: put at publish, in that order
        self._open: list[ObjectFile] = []
        self._lock = threading.Lock()
        self.streaming = threading.Lock()  # held by the one file whose upload is under way (UPLOAD_BYTES)
        self._clear_earlier(overwrite)

    @property
    def token(self) -> str:
        return self.url

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def open(self, name: str, size: int) -> ObjectFile:
        file = ObjectFile(self, name, size)
        with self._lock:
            self._open.append(file)
        return file

    def write_bytes(self, name: str, data: bytes) -> None:
        self._small[name] = bytes(data)

    def write_json(self, name: str, value: dict) -> None:
        self.write_bytes(name, json.dumps(value, indent=2, sort_keys=True).encode() + b"\n")

    @contextmanager
    def local_folder(self, name: str = ""):
        """A temporary local folder (a tokenizer's save_pretrained): its files are kept for publish."""
        folder = tempfile.mkdtemp(prefix="fsdpfast-object-")
        try:
            yield folder
            for root, _, files in os.walk(folder):
                for file in files:
                    path = os.path.join(root, file)
                    relative = os.path.relpath(path, folder).replace(os.sep, "/")
                    with open(path, "rb") as handle:
                        self.write_bytes(f"{name}/{relative}" if name else relative, handle.read())
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def write_manifest(self, manifest: dict) -> None:
        written = {**self._written, **{n: len(d) for n, d in self._small.items()}}
        entries = {name: {"size": size, "mtime_ns": 0} for name, size in sorted(written.items())}
        self.write_json(MANIFEST_NAME, {**manifest, WRITTEN: entries})

    def publish(self) -> None:
        """The small files, config.json after them and the manifest last: a reader that finds the
        manifest finds every object it lists."""
        import obstore

        last = [n for n in (CONFIG, MANIFEST_NAME) if n in self._small]
        for name in [n for n in self._small if n not in last] + last:
            self._written[name] = len(self._small[name])
            obstore.put(self.store, self.key(name), self._small[name])
        self.published = True

    def discard(self) -> None:
        """Unless published: the pending uploads aborted, every object written deleted. A store that does not
        answer (after the client's retries) leaves some: said in one warning line, and never loadable, since
        config.json and the manifest are put only by `publish`."""
        if self.published:
            return
        pending = [file.name for file in list(self._open) if not file.abort()]
        written = list(self._written)
        try:
            self.delete(written)
        except Exception:  # the store is gone: what is left is said below
            pass
        else:
            written = []
        if pending or written:
            log.warning(
                "%s: the store did not answer the clean-up: %d objects (%s) and %d pending multipart uploads (%s) "
                "may be left under this prefix; nothing there is loadable (no config.json, no manifest); remove "
                "them once the store answers (e.g. aws s3 rm --recursive, aws s3api abort-multipart-upload, or a "
                "lifecycle rule aborting incomplete multipart uploads)",
                self.url,
                len(written),
                ", ".join(written[:3]) or "none",
                len(pending),
                ", ".join(pending[:3]) or "none",
            )

    def delete(self, names: list[str]) -> None:
        import obstore

        if names:
            obstore.delete(self.store, [self.key(n) for n in names])

    def put_done(self, name: str, size: int) -> None:
        with self._lock:
            self._written[name] = size

    def _clear_earlier(self, overwrite: bool) -> None:
        import obstore

        found = {}
        for batch in obstore.list(self.store, prefix=f"{self.prefix}/" if self.prefix else None):
            for meta in batch:
                found[meta["path"][len(self.prefix) + 1 if self.prefix else 0 :]] = meta["size"]
        if not found:
            return
        if not overwrite:
            raise BadInput(
                f"{self.url}: the output prefix already holds {len(found)} objects; pass --overwrite to replace it"
            )
        if MANIFEST_NAME not in found:
            raise BadInput(
                f"{self.url}: the output prefix holds objects and no {MANIFEST_NAME}: fsdpfast did not write it, "
                "so --overwrite leaves it alone; choose another prefix or empty it yourself"
            )
        earlier = json.loads(bytes(obstore.get(self.store, self.key(MANIFEST_NAME)).bytes())).get(WRITTEN, {})
        foreign = sorted(n for n in found if n != MANIFEST_NAME and n not in earlier)
        if foreign:
            raise BadInput(
                f"{self.url}: --overwrite refused: the prefix holds {foreign[0]}"
                f"{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}, which fsdpfast did not write; "
                "move it away or choose another prefix"
            )
        # the manifest first: from here on the earlier output is not taken for a complete one
        obstore.delete(self.store, [self.key(MANIFEST_NAME)] + [self.key(n) for n in found if n != MANIFEST_NAME])


class ObjectFile:
    """One output object, written by byte ranges and streamed in order into a multipart upload."""

    def __init__(self, target: ObjectTarget, name: str, size: int):
        self.target, self.name, self.size = target, name, size
        self._writer = None  # opened with the first bytes streamed, once the target's upload budget is free
        self._next = 0  # the first byte not yet streamed
        self._ahead: dict[int, memoryview] = {}  # offset -> bytes written beyond a gap (the file's own)
        self._lock = threading.Lock()
        self._done = False
        self._aborted: bool | None = None  # None: not tried; else whether the store took the abort
        self._failed: str | None = None  # the one line of the first failure, said again to any later write
        self._released = False  # whether this file's upload gave back the target's budget

    def write_at(self, data, offset: int) -> None:
        """Bytes at `offset`, copied: the caller may reuse its buffer once this returns, as with a file's pwrite
        (obstore 0.12's writer keeps a reference to what it is given until that part is sent)."""
        self.write_owned(bytes(memoryview(data).cast("B")), offset)

    def write_owned(self, data: bytes | bytearray, offset: int) -> None:
        """Bytes at `offset` in a buffer its caller never touches again: streamed without a copy."""
        data = memoryview(data).cast("B")
        if not data.nbytes:
            return
        with self._lock:
            self._check_failed()
            if offset != self._next:
                self._ahead[offset] = data
                return
            self._stream(data)
            while self._next in self._ahead:
                self._stream(memoryview(self._ahead.pop(self._next)))

    def _stream(self, data: memoryview) -> None:
        """Bytes at the next offset owed, into the upload a part at a time (the client holds each slice, not a
        copy, until its part is sent: write_at copied the caller's bytes, write_owned's are the file's)."""
        if self._writer is None:
            import obstore

            self.target.streaming.acquire()  # one file streams at a time: the target's UPLOAD_BYTES
            try:
                self._writer = obstore.open_writer(
                    self.target.store, self.target.key(self.name), buffer_size=PART_BYTES, max_concurrency=UPLOADS
                )
            except BaseException:
                self.target.streaming.release()
                raise
        for at in range(0, data.nbytes, PART_BYTES):
            self._upload(self._writer.write, data[at : at + PART_BYTES])
        self._next += data.nbytes

    def window(self, start: int, end: int):
        return _Window(self, start, end)

    def local_descriptor(self) -> int | None:
        return None

    def sync(self) -> None:
        """The upload is completed once every byte has been streamed (a file's last part)."""
        with self._lock:
            self._check_failed()
            if self._done or self._next < self.size or self._ahead:
                return
            if self._writer is None:  # an empty file: nothing was streamed
                self._stream(memoryview(b""))
            try:
                self._upload(self._writer.close)  # the last part and the completion (on failure the client aborts)
            finally:
                self._end_streaming()
            self._done = True
        self.target.put_done(self.name, self.size)

    def abort(self) -> bool:
        """Abort the multipart upload; whether nothing of it is left pending (False: the store did not take it)."""
        with self._lock:
            return self._abort()

    def _abort(self) -> bool:
        if self._done:
            return True
        if self._aborted is None:
            try:  # the client's own abort, with its retries: once only (a failed abort cannot be tried again)
                if self._writer is not None:
                    self._writer.__exit__(RuntimeError, RuntimeError("discarded"), None)
                self._aborted = True
            except Exception:
                self._aborted = False
            finally:
                self._end_streaming()
        return self._aborted

    def _end_streaming(self) -> None:
        """The upload completed or aborted: its budget goes to the next file."""
        if self._writer is not None and not self._released:
            self._released = True
            self.target.streaming.release()

    def _upload(self, step, *args) -> None:
        """A call into the upload; on failure the merge fails in one line naming the object, and the writer is
        not called again but to abort (ObjectTarget.discard). A failure in `close` was aborted by the client
        itself, with its retries (remote.stores.RETRIES); what it could not abort is said by `discard`."""
        try:
            step(*args)
        except Exception as exc:
            reason = (str(exc).splitlines() or [type(exc).__name__])[0].split(" - ")[-1].strip()
            self._failed = (
                f"{self.target.url}/{self.name}: the upload failed after the client's retries ({reason[:160]}); "
                "nothing was published"
            )
            raise UploadFailed(self._failed) from None

    def _check_failed(self) -> None:
        if self._failed is not None:
            raise UploadFailed(self._failed)

    def close(self) -> None:
        self.sync()
        if not self._done:
            self.abort()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Window:
    """Bytes [start, end) of an object, filled in memory by the engine a piece at a time (`at`): each piece has
    its own buffer, streamed into the file and dropped once its view is released (the engine filled it:
    io.target.Window) and every byte before it is streamed. Bytes no piece covered are zeros."""

    def __init__(self, file: ObjectFile, start: int, end: int):
        self.file, self.next, self.end = file, start, end
        self.pieces: dict[int, tuple[bytearray, memoryview]] = {}  # offset -> (its bytes, the view handed out)

    def at(self, offset: int, nbytes: int) -> memoryview:
        self._stream_filled()  # an earlier batch's pieces, released by now
        buffer = bytearray(nbytes)
        view = memoryview(buffer)
        self.pieces[offset] = (buffer, view)
        return view

    def close(self) -> None:
        for offset in sorted(self.pieces):
            self._zeros_until(offset)
            buffer, _ = self.pieces.pop(offset)
            self.file.write_owned(buffer, offset)
            self.next = offset + len(buffer)
        self._zeros_until(self.end)

    def _stream_filled(self) -> None:
        for offset in sorted(self.pieces):
            buffer, view = self.pieces[offset]
            if offset != self.next or not _released(view):
                return
            del self.pieces[offset]
            self.file.write_owned(buffer, offset)
            self.next = offset + len(buffer)

    def _zeros_until(self, offset: int) -> None:
        while self.next < offset:
            gap = min(offset - self.next, PART_BYTES)
            self.file.write_owned(bytes(gap), self.next)
            self.next += gap


def _released(view: memoryview) -> bool:
    try:
        return view.nbytes < 0  # any attribute of a released view raises
    except ValueError:  # "operation forbidden on released memoryview object"
        return True
