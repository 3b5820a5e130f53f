"""The one interface every engine's output has: a Sink takes batches of placed tensors.

`sink.write(pieces, sources)` produces each piece's bytes (a whole tensor, or a byte range of
one: execute.parts) and returns their CRC-32Cs. The runner (execute.runner) feeds every sink the
same way, batch after batch:
- a file sink, `engine.output(fd, end, start)`: writes the pieces into bytes [start, end) of an
  output file, through a shared mapping (torch, cuda) or by writing chunks at offsets (native);
- the compare sink (execute.compare): recomputes the pieces and compares them with a written
  output (verify --against).
Pieces no fast path handles (float64 casts, tensors computed from others: execute.computed) are filled
in memory one at a time by `fill`.
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import Protocol

from .. import _ops
from ..io.sources import Source
from ..plan.layout import PlacedTensor
from ..plan.model import TensorPlan


class Sink(Protocol):
    def write(self, pieces: list[PlacedTensor], sources: Source) -> list[int | None]:
        """Produce the pieces; their CRC-32Cs (None without the native module), in order."""

    def __enter__(self): ...

    def __exit__(self, *exc): ...


class MappedOutput:
    """Bytes [start, end) of the output file mapped writable; `execute(jobs, sources)` fills (tensor, byte view) jobs."""

    def __init__(self, fd: int, end: int, execute, device: str = "cpu", start: int = 0):
        base = start - start % mmap.ALLOCATIONGRANULARITY  # a mapping starts at a page boundary
        _reserve(fd, start, end)
        self._mapping = mmap.mmap(fd, end - base, access=mmap.ACCESS_WRITE, offset=base)
        self._view = memoryview(self._mapping)
        self._base = base
        self._execute, self._device = execute, device

    def write(self, pieces: list[PlacedTensor], sources: Source) -> list[int | None]:
        """Fill the pieces; their CRC-32Cs, taken from the freshly written pages."""
        views = [self._view[p.offset - self._base : p.offset - self._base + p.nbytes] for p in pieces]
        copied = [(p.tensor, view) for p, view in zip(pieces, views) if p.tensor.compute is None]
        if copied:
            self._execute(copied, sources)
        for p, view in zip(pieces, views):
            if p.tensor.compute is not None:
                fill(p.tensor, view, sources, self._device)
        crcs = [_ops.crc32c(view) for view in views]
        for view in views:
            view.release()
        return crcs

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._view.release()
        self._mapping.flush()
        self._mapping.close()


def _reserve(fd: int, start: int, end: int) -> None:
    """Allocate the range's blocks before mapping it: storing into a mapped page the disk has no
    room for kills the process with SIGBUS, while posix_fallocate fails cleanly with ENOSPC."""
    try:
        os.posix_fallocate(fd, start, end - start)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):  # a filesystem without it: map anyway
            raise


def fill(tensor: TensorPlan, destination: memoryview, sources: Source, device: str = "cpu") -> None:
    """One tensor's bytes into memory: computed (execute.computed, on `device`) or gathered by the torch engine."""
    if tensor.compute is not None:
        tensor.compute.compute_into(tensor, destination, sources, device, gather=torch_gather)
    else:
        torch_gather(tensor, destination, sources)


def torch_gather(tensor: TensorPlan, destination: memoryview, sources: Source) -> None:
    """One tensor gathered and converted by the pure-torch engine (execute.computed.Gather)."""
    from .torch_ref import TorchEngine

    TorchEngine().execute([(tensor, destination)], sources)


def write_through_buffer(fd: int, placed: PlacedTensor, sources: Source, device: str = "cpu") -> int | None:
    """Fill one piece in a buffer of its own size, then write it at its offset (rare dtype pairs,
    computed weights); its CRC-32C."""
    buffer = bytearray(placed.nbytes)
    fill(placed.tensor, memoryview(buffer), sources, device)
    view, offset = memoryview(buffer), placed.offset
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
    return _ops.crc32c(buffer)
