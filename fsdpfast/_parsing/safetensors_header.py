"""Safetensors files as inputs: the JSON header after its 8-byte length, and each tensor's bytes in place.

Only the header is read; a tensor is located as a byte range of the file, checked against its
dtype, shape and the file's size so a truncated or corrupt file is refused before any data moves.
"""

from __future__ import annotations

import json
import os
import reprlib
from dataclasses import dataclass
from math import prod

from ..dtypes import DTYPES, itemsize
from ..errors import BadInput

_DTYPE_BY_CODE = {code: name for name, (_, code) in DTYPES.items()}
MAX_HEADER = 100 << 20  # safetensors' own limit: a damaged length must not make us read gigabytes as "JSON"


@dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    data_start: int  # the first byte after the header
    file_size: int
    entries: dict  # tensor name -> {"dtype", "shape", "data_offsets"}
    metadata: dict  # the "__metadata__" strings (may be empty)


@dataclass(frozen=True)
class StoredTensor:
    name: str
    path: str  # the file holding it
    dtype: str  # torch name
    shape: tuple[int, ...]
    byte_offset: int  # from the start of the file
    nbytes: int

    @property
    def file(self) -> str:
        """The file's name inside its folder (what a manifest records)."""
        return os.path.basename(self.path)


def looks_like_safetensors(path: str) -> bool:
    """True when the file starts with a header length and a JSON object (not, e.g., a torch.save zip)."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{"


def read_header(path: str) -> SafetensorsHeader:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            file_size = os.fstat(f.fileno()).st_size
            size = int.from_bytes(head, "little") if len(head) == 8 else -1
            if size > MAX_HEADER:
                raise BadInput(
                    f"{path}: safetensors header length {size} is over the {MAX_HEADER >> 20} MB limit; "
                    "the file is corrupt"
                )
            if size < 0 or size > file_size - 8:
                raise BadInput(f"{path}: safetensors header runs past the end of the file; the file is truncated")
            raw = f.read(size)
    except OSError as exc:
        raise BadInput(f"{path}: unreadable ({exc.strerror})") from None
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise BadInput(f"{path}: safetensors header is not valid JSON ({exc}); the file is corrupt") from None
    except RecursionError:
        raise BadInput(f"{path}: safetensors header nests too deeply; the file is corrupt") from None
    if not isinstance(header, dict):
        raise BadInput(f"{path}: safetensors header is not a JSON object; the file is corrupt")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise BadInput(f"{path}: the safetensors __metadata__ is not a JSON object; the file is corrupt")
    return SafetensorsHeader(path, 8 + size, file_size, header, metadata)


def stored_tensor(header: SafetensorsHeader, name: str) -> StoredTensor:
    """Where tensor `name` lies in the file, after checking its header entry against its size and the file's."""
    path, entry = header.path, header.entries[name]
    if not isinstance(entry, dict):
        raise BadInput(f"{path}: the header entry of {name} is not a JSON object; the file is corrupt")
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(code, str) or code not in _DTYPE_BY_CODE:  # (a list or object is not hashable)
        raise BadInput(f"{path}: {name} has dtype {reprlib.repr(code)}, which is not supported")
    if not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
        raise BadInput(f"{path}: the header entry of {name} has no valid shape and data_offsets; the file is corrupt")
    dtype, (begin, end) = _DTYPE_BY_CODE[code], offsets
    expected = prod(shape) * itemsize(dtype)
    if end - begin != expected:
        raise BadInput(
            f"{path}: {name} is {code}{list(shape)} ({expected} bytes) but its data_offsets "
            f"[{begin}, {end}] span {end - begin}; the header is corrupt"
        )
    if header.data_start + end > header.file_size:
        raise BadInput(f"{path}: the bytes of {name} run past the end of the file; the file is truncated")
    return StoredTensor(name, path, dtype, tuple(shape), header.data_start + begin, expected)


def _ints(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
