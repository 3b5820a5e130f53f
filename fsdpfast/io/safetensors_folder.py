"""Read what a safetensors folder holds from its headers: each tensor's file, byte range, dtype, shape.

The headers are read and checked by _parsing/safetensors_header.py, the one reader every
safetensors input goes through; here a damaged file becomes DamagedFile, which verify reports
as a failed check of the output rather than a usage error.
"""

from __future__ import annotations

import glob
import os

from .._parsing.safetensors_header import StoredTensor, read_header, stored_tensor
from ..errors import BadInput
from ..plan.model import SourceBuffer
from .sources import SourceFiles

__all__ = ["DamagedFile", "MappedFiles", "StoredTensor", "read_folder"]


class DamagedFile(BadInput):
    """A safetensors file whose header is unreadable, inconsistent or points past the end of the file."""


def read_folder(folder: str) -> dict[str, StoredTensor]:
    """Every tensor of every *.safetensors file in `folder`, by name."""
    if not os.path.isdir(folder):
        raise BadInput(f"{folder}: no such folder")
    paths = sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors")))
    if not paths:
        raise BadInput(f"{folder}: no .safetensors files; give a merged model folder")
    found: dict[str, StoredTensor] = {}
    for path in paths:
        try:
            header = read_header(path)
            tensors = [stored_tensor(header, name) for name in header.entries]
        except BadInput as exc:
            raise DamagedFile(str(exc)) from None
        for tensor in tensors:
            if tensor.name in found:
                raise DamagedFile(f"{folder}: {tensor.name} is in both {found[tensor.name].file} and {tensor.file}")
            found[tensor.name] = tensor
    return found


class MappedFiles(SourceFiles):
    """A folder's tensors as byte views, each file mapped once (the engine's SourceFiles)."""

    def __init__(self, stored: dict[str, StoredTensor]):
        self._index = {name: i for i, name in enumerate(stored)}
        super().__init__([SourceBuffer(t.path, t.byte_offset, t.nbytes, t.dtype) for t in stored.values()])

    def tensor(self, name: str) -> memoryview:
        return self.view(self._index[name])

    def done(self, name: str) -> None:
        """Drop the tensor's pages from this process, so reading a large folder keeps memory flat."""
        self.release(self._index[name])
