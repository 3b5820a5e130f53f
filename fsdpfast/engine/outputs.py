"""How engines reach an output file: through a shared mapping, or by writing chunks at offsets."""
from __future__ import annotations

import mmap
import os

from ..layout import PlacedTensor
from .sources import SourceFiles


class MappedOutput:
    """The output file mapped writable; `execute(jobs, sources)` fills (tensor, byte view) jobs."""

    def __init__(self, fd: int, size: int, execute):
        self._mapping = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        self._view = memoryview(self._mapping)
        self._execute = execute

    def write(self, placed: list[PlacedTensor], sources: SourceFiles) -> None:
        self._execute([(p.tensor, self._view[p.offset: p.offset + p.nbytes]) for p in placed], sources)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._view.release()
        self._mapping.flush()
        self._mapping.close()


def write_through_buffer(fd: int, placed: PlacedTensor, execute, sources: SourceFiles) -> None:
    """Fill one tensor in a buffer of its own size, then write it at its offset (rare dtype pairs)."""
    buffer = bytearray(placed.nbytes)
    execute([(placed.tensor, memoryview(buffer))], sources)
    os.pwrite(fd, buffer, placed.offset)
