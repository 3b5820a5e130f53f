"""The one interface every engine's output has: a Sink takes batches of placed tensors.

`sink.write(pieces, sources)` produces each piece's bytes (a whole tensor, or a byte range of
one: execute.parts) and returns their CRC-32Cs. The runner (execute.runner) feeds every sink the
same way, batch after batch:
- a file sink, `engine.output(file, end, start)`: writes the pieces into bytes [start, end) of a
  Target's file (io.target.TargetFile), through a window of it (torch, cuda) or by writing chunks
  at offsets (native);
- the compare sink (execute.compare): recomputes the pieces and compares them with a written
  output (verify --against).
Pieces no fast path handles (float64 casts, tensors computed from others: execute.computed) are filled
in memory one at a time by `fill`.
"""

from __future__ import annotations

from typing import Protocol

from .. import _ops
from ..io.sources import Source
from ..io.target import TargetFile, Window
from ..plan.layout import PlacedTensor
from ..plan.model import TensorPlan


class Sink(Protocol):
    def write(self, pieces: list[PlacedTensor], sources: Source) -> list[int | None]:
        """Produce the pieces; their CRC-32Cs (None without the native module), in order."""

    def __enter__(self): ...

    def __exit__(self, *exc): ...


class WindowOutput:
    """A window of an output file (io.target.Window), filled in memory: `execute(jobs, sources)`
    fills (tensor, byte view) jobs."""

    def __init__(self, window: Window, execute, device: str = "cpu"):
        self._window = window
        self._execute, self._device = execute, device

    def write(self, pieces: list[PlacedTensor], sources: Source) -> list[int | None]:
        """Fill the pieces; their CRC-32Cs, taken from the freshly written pages."""
        views = [self._window.at(p.offset, p.nbytes) for p in pieces]
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
        self._window.close()


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


def write_through_buffer(file: TargetFile, placed: PlacedTensor, sources: Source, device: str = "cpu") -> int | None:
    """Fill one piece in a buffer of its own size, then write it at its offset (rare dtype pairs,
    computed weights); its CRC-32C."""
    buffer = bytearray(placed.nbytes)
    fill(placed.tensor, memoryview(buffer), sources, device)
    file.write_at(buffer, placed.offset)
    return _ops.crc32c(buffer)
