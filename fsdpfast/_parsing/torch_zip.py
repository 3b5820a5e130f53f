"""Read a `torch.save` zip archive without loading its tensors.

torch.save writes an uncompressed zip: `<archive>/data.pkl` (the pickled object, tensors
as persistent ids naming storage records), `<archive>/data/<key>` (each storage's raw
bytes, 64-byte aligned) and `<archive>/byteorder`. We read the pickle and the byte
position of every storage record from the zip directory and local headers; the bulk bytes
are left for the engine to map.
"""
from __future__ import annotations

import io
import os
import struct
import zipfile
import zlib
from functools import cached_property

from ..dtypes import DTYPES, itemsize
from ..errors import BadInput
from ..plan.model import SourceBuffer

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # the 30 fixed bytes of a zip local file header
_LOCAL_MAGIC = b"PK\x03\x04"
# What zipfile raises on damaged archives besides BadZipFile: bad UTF-8 names (ValueError),
# unsupported or encrypted members, bad deflate data, fields that do not unpack.
_ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, ValueError, NotImplementedError, RuntimeError, EOFError, OSError,
               OverflowError, struct.error)


class FileWindow(io.RawIOBase):
    """Bytes [base, base + length) of a file, as a seekable read-only file of their own.

    DCP's .distcp files hold one torch.save archive per chunk, laid end to end.
    """

    def __init__(self, path: str, base: int, length: int):
        self._file = open(path, "rb")
        self._base, self._length, self._position = base, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        origin = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, origin + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), self._length - self._position))
        self._file.seek(self._base + self._position)
        data = self._file.read(count)
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)

    def close(self) -> None:
        self._file.close()
        super().close()


class TorchZip:
    """A torch.save archive: a whole file, or the window [base, base + length) of one."""

    def __init__(self, path: str, base: int = 0, length: int | None = None):
        self.path = path
        self.base = base
        self.file_size = os.path.getsize(path)
        self.size = self.file_size - base if length is None else length
        where = path if length is None else f"{path} (bytes {base}..{base + self.size})"
        self.where = where
        self._file = None
        if base + self.size > self.file_size:
            raise BadInput(f"{where}: runs past the end of the file; the file is truncated")
        self._window = None if length is None else FileWindow(path, base, self.size)
        try:
            self._zip = zipfile.ZipFile(self._window or path)
        except _ZIP_ERRORS as exc:
            self.close()
            problem = _zip_problem(path, exc) if length is None else f"{exc}; the file is truncated or corrupt"
            raise BadInput(f"{where}: not a readable torch.save archive ({problem})") from None
        try:
            self._check_archive()
        except BaseException:
            self.close()
            raise

    def _check_archive(self) -> None:
        pickles = [i for i in self._zip.infolist() if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
        if len(pickles) != 1:
            raise BadInput(f"{self.where}: a zip file but not a torch.save archive (no single data.pkl inside)")
        self.prefix = pickles[0].filename[: -len("data.pkl")]
        self._pickle_info = pickles[0]
        byteorder = self._read_small("byteorder")
        if byteorder is not None and byteorder.strip() != b"little":
            raise BadInput(f"{self.where}: stored big-endian ({byteorder!r}); only little-endian checkpoints are supported")

    def close(self) -> None:
        if getattr(self, "_zip", None) is not None:
            self._zip.close()
        if self._window is not None:
            self._window.close()
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @cached_property
    def pickle_bytes(self) -> bytes:
        try:
            if self._pickle_info.compress_type != zipfile.ZIP_STORED:  # torch.save never compresses; no zip bombs
                raise zipfile.BadZipFile("data.pkl is compressed")
            return self._zip.read(self._pickle_info)
        except _ZIP_ERRORS as exc:
            raise BadInput(f"{self.where}: data.pkl is damaged ({exc}); the file is truncated or corrupt") from None

    def storage_span(self, key: str) -> tuple[int, int]:
        """(byte offset in the file, byte length) of storage record `key`."""
        name = f"{self.prefix}data/{key}"
        try:
            info = self._zip.getinfo(name)
        except KeyError:
            raise BadInput(f"{self.where}: storage record {name!r} named by the pickle is missing; the file is corrupt") from None
        if info.compress_type != zipfile.ZIP_STORED:
            raise BadInput(f"{self.where}: storage record {name!r} is compressed; torch.save never does that")
        raw = self._read_at(self.base + info.header_offset, _LOCAL_HEADER.size)
        if len(raw) != _LOCAL_HEADER.size or raw[:4] != _LOCAL_MAGIC:
            raise BadInput(f"{self.where}: zip header of {name!r} is damaged; the file is corrupt")
        fields = _LOCAL_HEADER.unpack(raw)
        name_len, extra_len = fields[9], fields[10]
        offset = self.base + info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if offset + info.file_size > self.base + self.size:
            raise BadInput(f"{self.where}: storage record {name!r} runs past the end of the file; the file is truncated")
        return offset, info.file_size

    def storage_buffer(self, storage) -> SourceBuffer:
        """The bytes of `storage` (a safe_load.StorageRef), in place in this file, for the engine to map."""
        if storage.dtype not in DTYPES:
            raise BadInput(f"{self.where}: dtype {storage.dtype} is not supported")
        offset, length = self.storage_span(storage.key)
        nbytes = storage.numel * itemsize(storage.dtype)
        if length < nbytes:
            raise BadInput(f"{self.where}: storage {storage.key} holds {length} bytes, the pickle says {nbytes}; the file is corrupt")
        return SourceBuffer(self.path, offset, nbytes, storage.dtype)

    def _read_at(self, offset: int, size: int) -> bytes:
        if self._file is None:  # one handle for every storage's header, opened on first need
            self._file = open(self.path, "rb")
        self._file.seek(offset)
        return self._file.read(size)

    def _read_small(self, record: str) -> bytes | None:
        try:
            info = self._zip.getinfo(self.prefix + record)
            if info.file_size > 64:  # a few bytes in any torch.save archive
                raise zipfile.BadZipFile(f"{info.file_size} bytes long")
            return self._zip.read(info)
        except KeyError:
            return None
        except _ZIP_ERRORS as exc:
            raise BadInput(f"{self.where}: record {record!r} is damaged ({exc}); the file is truncated or corrupt") from None


def _zip_problem(path: str, exc: Exception) -> str:
    with open(path, "rb") as f:
        head = f.read(2)
    if not head:
        return "the file is empty"
    if head[:1] == b"\x80":
        return "a legacy torch.save pickle; re-save it with a torch of 1.6 or newer"
    return f"{exc}; the file is truncated or corrupt"
