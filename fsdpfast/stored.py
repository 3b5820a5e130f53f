"""Read what a safetensors folder holds from its headers: each tensor's file, byte range, dtype, shape."""
from __future__ import annotations

import glob
import json
import os
import struct
from dataclasses import dataclass

from .dtypes import DTYPES
from .engine.sources import SourceFiles
from .errors import BadInput
from .plan import SourceBuffer

_BY_CODE = {code: name for name, (_, code) in DTYPES.items()}
_MAX_HEADER = 100 << 20  # safetensors' own limit


class DamagedFile(BadInput):
    """A safetensors file whose header is unreadable or points past the end of the file."""


@dataclass(frozen=True)
class StoredTensor:
    name: str
    file: str  # file name inside the folder
    offset: int  # from the start of the file
    nbytes: int
    dtype: str  # torch name
    shape: tuple[int, ...]


def read_folder(folder: str) -> dict[str, StoredTensor]:
    """Every tensor of every *.safetensors file in `folder`, by name."""
    if not os.path.isdir(folder):
        raise BadInput(f"{folder}: no such folder")
    paths = sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors")))
    if not paths:
        raise BadInput(f"{folder}: no .safetensors files; give a merged model folder")
    found: dict[str, StoredTensor] = {}
    for path in paths:
        for tensor in _read_header(path):
            if tensor.name in found:
                raise BadInput(f"{folder}: {tensor.name} is in both {found[tensor.name].file} and {tensor.file}")
            found[tensor.name] = tensor
    return found


def _read_header(path: str) -> list[StoredTensor]:
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < length <= min(_MAX_HEADER, size - 8):
            raise DamagedFile(f"{path}: not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise DamagedFile(f"{path}: not a safetensors file (header is not JSON)") from None
    tensors = []
    for tensor_name, entry in header.items():
        if tensor_name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            dtype = _BY_CODE[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise DamagedFile(f"{path}: bad header entry for {tensor_name}") from None
        if not 0 <= begin <= end or 8 + length + end > size:
            raise DamagedFile(f"{path}: {tensor_name} lies outside the file (truncated?)")
        tensors.append(StoredTensor(tensor_name, name, 8 + length + begin, end - begin, dtype, shape))
    return tensors


class MappedFiles(SourceFiles):
    """A folder's tensors as byte views, each file mapped once (the engine's SourceFiles)."""

    def __init__(self, folder: str, stored: dict[str, StoredTensor]):
        self._index = {name: i for i, name in enumerate(stored)}
        super().__init__([SourceBuffer(os.path.join(folder, t.file), t.offset, t.nbytes, t.dtype) for t in stored.values()])

    def tensor(self, name: str) -> memoryview:
        return self.view(self._index[name])

    def done(self, name: str) -> None:
        """Drop the tensor's pages from this process, so reading a large folder keeps memory flat."""
        self.release(self._index[name])
