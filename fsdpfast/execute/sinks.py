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
in memory one at a time (execute.fallback).
"""

from __future__ import annotations

from typing import Protocol

from .. import _ops
from ..io.sources import Source
from ..io.target import Window
from ..plan.layout import PlacedTensor
from .fallback import fill


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
