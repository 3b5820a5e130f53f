"""Read a `torch.save` zip archive without loading its tensors.

torch.save writes an uncompressed zip: `<archive>/data.pkl` (the pickled object, tensors
as persistent ids naming storage records), `<archive>/data/<key>` (each storage's raw
bytes, 64-byte aligned) and `<archive>/byteorder`. We read the pickle and the byte
position of every storage record from the zip directory and local headers; the bulk bytes
are left for the engine to map.
"""
from __future__ import annotations

import os
import struct
import zipfile
from functools import cached_property

from ..errors import BadInput

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # the 30 fixed bytes of a zip local file header
_LOCAL_MAGIC = b"PK\x03\x04"


class TorchZip:
    def __init__(self, path: str):
        self.path = path
        self.file_size = os.path.getsize(path)
        try:
            self._zip = zipfile.ZipFile(path)
        except zipfile.BadZipFile as exc:
            raise BadInput(f"{path}: not a readable torch.save archive ({_zip_problem(path, exc)})") from None
        pickles = [i for i in self._zip.infolist() if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
        if len(pickles) != 1:
            raise BadInput(f"{path}: a zip file but not a torch.save archive (no single data.pkl inside)")
        self.prefix = pickles[0].filename[: -len("data.pkl")]
        self._pickle_info = pickles[0]
        byteorder = self._read_small("byteorder")
        if byteorder is not None and byteorder.strip() != b"little":
            raise BadInput(f"{path}: stored big-endian ({byteorder!r}); only little-endian checkpoints are supported")

    def close(self) -> None:
        self._zip.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @cached_property
    def pickle_bytes(self) -> bytes:
        try:
            return self._zip.read(self._pickle_info)
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise BadInput(f"{self.path}: data.pkl is damaged ({exc}); the file is truncated or corrupt") from None

    def storage_span(self, key: str) -> tuple[int, int]:
        """(byte offset in the file, byte length) of storage record `key`."""
        name = f"{self.prefix}data/{key}"
        try:
            info = self._zip.getinfo(name)
        except KeyError:
            raise BadInput(f"{self.path}: storage record {name!r} named by the pickle is missing; the file is corrupt") from None
        if info.compress_type != zipfile.ZIP_STORED:
            raise BadInput(f"{self.path}: storage record {name!r} is compressed; torch.save never does that")
        with open(self.path, "rb") as f:
            f.seek(info.header_offset)
            raw = f.read(_LOCAL_HEADER.size)
        if len(raw) != _LOCAL_HEADER.size or raw[:4] != _LOCAL_MAGIC:
            raise BadInput(f"{self.path}: zip header of {name!r} is damaged; the file is corrupt")
        fields = _LOCAL_HEADER.unpack(raw)
        name_len, extra_len = fields[9], fields[10]
        offset = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if offset + info.file_size > self.file_size:
            raise BadInput(f"{self.path}: storage record {name!r} runs past the end of the file; the file is truncated")
        return offset, info.file_size

    def _read_small(self, record: str) -> bytes | None:
        try:
            return self._zip.read(self.prefix + record)
        except KeyError:
            return None
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise BadInput(f"{self.path}: record {record!r} is damaged ({exc}); the file is truncated or corrupt") from None


def _zip_problem(path: str, exc: Exception) -> str:
    with open(path, "rb") as f:
        head = f.read(2)
    if not head:
        return "the file is empty"
    if head[:1] == b"\x80":
        return "a legacy torch.save pickle; re-save it with a torch of 1.6 or newer"
    return f"{exc}; the file is truncated or corrupt"
