"""A local stand-in for a checkpoint folder in an object store, holding its metadata bytes only.

The readers plan from local files (names, sizes, zip directories, pickles, safetensors headers,
`.metadata`, JSON). The stand-in is a temporary folder of sparse files, each the size of its
object, into which only those bytes are fetched by ranged GETs: the small files whole, a
safetensors file's header, a torch.save archive's zip directory, local headers and every record
but its tensor storages. The tensor bytes are never fetched here: the rest of each file is a hole
(no disk used) and the merge reads it from the store (remote.range_sources), each object pinned to
the ETag listed here. The folder is removed when the merge ends.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import BadInput, FsdpfastError
from ..manifest import SourceChanged
from .stores import get_pinned, store_for

WHOLE_BYTES = 4 << 20  # objects up to this size are fetched whole (configs, .metadata, common.pt, small shards)
WHOLE_SUFFIXES = (".json", ".metadata", ".txt", ".yaml", ".yml", ".model", ".py", ".pkl", ".md")
TAIL_BYTES = 1 << 16  # a zip's end records and, most often, its whole directory in one GET
LOCAL_HEADER_BYTES = 30 + 512  # a local header with its name and extra field
FETCHES = 32  # GETs in flight while the stand-in is filled


@dataclass
class Mirrored:
    root: str  # the local stand-in folder
    url: str  # the checkpoint's prefix in the store
    etags: dict[str, str]  # object URL -> its ETag when listed: a later GET must find the same

    def identity(self, stand_in: list[dict]) -> list[dict]:
        """The sources' identity a manifest records (manifest.source_identity of the stand-in's files), with
        each object's ETag instead of the stand-in's modification time: what tells a later changed object."""
        return [{**entry, "mtime_ns": 0, "etag": self.etags.get(f"{self.url}/{entry['path']}")} for entry in stand_in]

    def said(self, value):
        """A path inside the stand-in, or a text naming such paths (a reader's note, an error), said with
        the store's URL instead; anything else unchanged."""
        if not isinstance(value, str):
            return value
        root = os.path.abspath(self.root)
        if value == root or value.startswith(root + os.sep):
            return self.url + value[len(root) :].replace(os.sep, "/")
        return value.replace(root + os.sep, self.url + "/").replace(root, self.url)


@contextmanager
def mirrored_metadata(url: str, windows_of=None):
    """The checkpoint prefix `url` as a Mirrored stand-in, removed on the way out. `windows_of(root)`:
    the byte windows (offset, length) by local path of data files holding one torch.save archive each
    (DCP's .distcp), read once the small files are in; their archives' metadata is fetched too."""
    url = url.rstrip("/")
    store, prefix = store_for(url)  # refused in one line without the client
    import obstore

    listed = [m for batch in obstore.list(store, prefix=f"{prefix}/" if prefix else None) for m in batch]
    if not listed:
        raise BadInput(f"{url}: no objects under this prefix; check the URL (and the credentials' access to it)")
    root = tempfile.mkdtemp(prefix="fsdpfast-remote-")
    try:
        etags = {}
        with ThreadPoolExecutor(FETCHES, thread_name_prefix="fsdpfast-metadata") as pool:
            for meta in listed:
                relative = meta["path"][len(prefix) + 1 if prefix else 0 :]
                local = os.path.join(root, *relative.split("/"))
                os.makedirs(os.path.dirname(local), exist_ok=True)
                with open(local, "wb") as handle:
                    handle.truncate(meta["size"])  # a hole: no disk used
                etags[f"{url}/{relative}"] = meta["e_tag"]
            list(pool.map(lambda m: _fill(store, m, root, prefix, url), listed))
            windows = windows_of(root) if windows_of is not None else {}
            by_path = {os.path.join(root, *m["path"][len(prefix) + 1 if prefix else 0 :].split("/")): m for m in listed}
            jobs = [
                (by_path[path], offset, length)
                for path, found in windows.items()
                if path in by_path and by_path[path]["size"] > WHOLE_BYTES
                for offset, length in found
            ]
            list(pool.map(lambda job: _fill_window(store, root, prefix, url, *job), jobs))
        mirror = Mirrored(root, url, etags)
        try:
            yield mirror
        except FsdpfastError as exc:  # a refusal names the store's objects, never the stand-in
            if exc.args and isinstance(exc.args[0], str):
                exc.args = (mirror.said(exc.args[0]), *exc.args[1:])
            raise
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _fill(store, meta: dict, root: str, prefix: str, url: str) -> None:
    relative = meta["path"][len(prefix) + 1 if prefix else 0 :]
    local = os.path.join(root, *relative.split("/"))
    size, key, etag = meta["size"], meta["path"], meta["e_tag"]
    fetch = _Fetcher(store, key, etag, local, f"{url}/{relative}")
    if size == 0:
        return
    if size <= WHOLE_BYTES or relative.endswith(WHOLE_SUFFIXES):
        fetch.put(0, size)
        return
    head = fetch.put(0, min(size, 8))
    if relative.endswith(".safetensors") and len(head) == 8:
        fetch.put(0, min(size, 8 + struct.unpack("<Q", head)[0]))
        return
    if head[:4] == b"PK\x03\x04":
        _fill_zip(fetch, size)


def _fill_window(store, root: str, prefix: str, url: str, meta: dict, offset: int, length: int) -> None:
    relative = meta["path"][len(prefix) + 1 if prefix else 0 :]
    local = os.path.join(root, *relative.split("/"))
    fetch = _Fetcher(store, meta["path"], meta["e_tag"], local, f"{url}/{relative}", base=offset)
    if length <= TAIL_BYTES:  # a small archive (a non-tensor entry, a tiny tensor): whole in one GET
        fetch.put(0, length)
    elif fetch.put(0, 4) == b"PK\x03\x04":
        _fill_zip(fetch, length)


def _fill_zip(fetch: _Fetcher, size: int) -> None:
    """The end records, the directory, each record's local header, and every record's data but the
    storages' (`.../data/N`)."""
    tail_start = max(0, size - TAIL_BYTES)
    tail = fetch.put(tail_start, size - tail_start)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0:
        return  # not a zip the readers can read either: they say so
    count, cd_size, cd_offset = struct.unpack_from("<H", tail, at + 10)[0], *struct.unpack_from("<LL", tail, at + 12)
    locator = tail.rfind(b"PK\x06\x07", 0, at)
    if locator >= 0:  # zip64: the directory's place in the zip64 end record
        record = struct.unpack_from("<Q", tail, locator + 8)[0]
        if record >= tail_start:
            count, cd_size, cd_offset = struct.unpack_from("<QQQ", tail, record - tail_start + 32)
        else:
            end64 = fetch.put(record, 56)
            count, cd_size, cd_offset = struct.unpack_from("<QQQ", end64, 32)
    directory = (
        tail[cd_offset - tail_start : cd_offset - tail_start + cd_size]
        if cd_offset >= tail_start
        else fetch.put(cd_offset, cd_size)
    )
    ranges, pos = [], 0
    for _ in range(count):
        if directory[pos : pos + 4] != b"PK\x01\x02":
            return
        csize, _usize, name_len, extra_len, comment_len = struct.unpack_from("<LLHHH", directory, pos + 20)
        header = struct.unpack_from("<L", directory, pos + 42)[0]
        name = bytes(directory[pos + 46 : pos + 46 + name_len]).decode("utf-8", "replace")
        extra = bytes(directory[pos + 46 + name_len : pos + 46 + name_len + extra_len])
        csize, header = _zip64(extra, csize, _usize, header)
        pos += 46 + name_len + extra_len + comment_len
        is_storage = "/data/" in name and not name.endswith(".pkl")
        end = header + LOCAL_HEADER_BYTES + (0 if is_storage else name_len + csize + 64)
        ranges.append((header, min(size, end)))
    for start, end in _joined(ranges):
        fetch.put(start, end - start)


def _zip64(extra: bytes, csize: int, usize: int, header: int) -> tuple[int, int]:
    """(compressed size, local header offset) with the zip64 extra field's values where they overflowed."""
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, at)
        if tag == 1:
            values, field = [], at + 4
            for value in (usize, csize, header):
                if value == 0xFFFFFFFF and field + 8 <= at + 4 + length:
                    values.append(struct.unpack_from("<Q", extra, field)[0])
                    field += 8
                else:
                    values.append(value)
            return values[1], values[2]
        at += 4 + length
    return csize, header


def _joined(ranges: list[tuple[int, int]], gap: int = 1 << 16) -> list[tuple[int, int]]:
    """Ranges sorted and joined where less than `gap` apart: fewer GETs for a few wasted bytes."""
    found: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if found and start <= found[-1][1] + gap:
            found[-1] = (found[-1][0], max(found[-1][1], end))
        else:
            found.append((start, end))
    return found


class _Fetcher:
    """Ranged GETs of one object (pinned to its listed ETag) written into its stand-in file."""

    def __init__(self, store, key: str, etag: str, local: str, url: str, base: int = 0):
        self.store, self.key, self.etag, self.local, self.url = store, key, etag, local, url
        self.base = base  # where the bytes this fetcher addresses start in the object (a window of it)

    def put(self, start: int, nbytes: int) -> bytes:
        if nbytes <= 0:
            return b""
        start += self.base
        from obstore.exceptions import NotFoundError, PreconditionError

        try:
            data = bytes(get_pinned(self.store, self.key, start, start + nbytes, self.etag).bytes())
        except (PreconditionError, NotFoundError, FileNotFoundError):  # obstore raises either for a 404
            raise SourceChanged(
                f"{self.url}: the object was replaced or deleted since it was listed; nothing was merged; "
                "merge again once the checkpoint is complete"
            ) from None
        with open(self.local, "r+b") as handle:
            handle.seek(start)
            handle.write(data)
        return data
