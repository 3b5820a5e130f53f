"""Pieces no fast path handles, one tensor at a time in memory: float64 casts, and tensors computed
from others (execute.computed) on the device the merge computes on."""

from __future__ import annotations

from .. import _ops
from ..io.sources import Source
from ..io.target import TargetFile
from ..plan.layout import PlacedTensor
from ..plan.model import TensorPlan
from .torch_copy import torch_copy
from .transposed import fill_transposed, is_transposed, write_transposed


def fill(tensor: TensorPlan, destination: memoryview, sources: Source, device: str = "cpu") -> None:
    """One tensor's bytes into memory: computed (execute.computed, on `device`) or gathered by the torch engine."""
    if is_transposed(tensor):
        fill_transposed(tensor, destination, sources, device)
    elif tensor.compute is not None:
        tensor.compute.compute_into(tensor, destination, sources, device, gather=torch_gather)
    else:
        torch_gather(tensor, destination, sources)


def torch_gather(tensor: TensorPlan, destination: memoryview, sources: Source) -> None:
    """One tensor gathered and converted by the pure-torch copy (execute.computed.Gather)."""
    torch_copy([(tensor, destination)], sources)


def write_through_buffer(file: TargetFile, placed: PlacedTensor, sources: Source, device: str = "cpu") -> int | None:
    """Fill one piece in a buffer of its own size, then write it at its offset (rare dtype pairs,
    computed weights); its CRC-32C. A transposed tensor a matrix at a time (execute.transposed)."""
    if is_transposed(placed.tensor):
        return write_transposed(file, placed, sources, device)
    buffer = bytearray(placed.nbytes)
    fill(placed.tensor, memoryview(buffer), sources, device)
    file.write_at(buffer, placed.offset)
    return _ops.crc32c(buffer)
