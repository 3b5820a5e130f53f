"""A tensor computed from others rather than copied (TensorPlan.compute): what the executor needs of it.

A plan transform may set `compute` on a tensor (a LoRA weight fused by --merge-lora). The executor
knows only this protocol: which plan sources the computation reads (released once it is written,
execute.runner), and how to produce the bytes, in the tensor's target dtype, into a buffer of its
size. `gather` is the pure-torch gather a computation reads its inputs with, handed in so that
nothing a transform defines is imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..io.sources import Source
from ..plan.model import TensorPlan

# gather(tensor, destination, sources): one tensor's bytes, as its plan converts them, into `destination`
Gather = Callable[[TensorPlan, memoryview, Source], None]


class Computed(Protocol):
    def sources(self) -> set[int]:
        """The indices of the plan sources the computation reads."""

    def compute_into(
        self, tensor: TensorPlan, destination: memoryview, sources: Source, device: str, gather: Gather
    ) -> None:
        """Write `tensor`'s bytes (its target dtype) into `destination`, computing on `device`."""
