"""The CUDA engine: conversions stream through pinned staging buffers and the GPU.

Staging is one pinned host allocation and one device allocation per GPU, kept for the process
and cut into the slots' buffers: pinning memory costs about as much as copying it, so it is done
once, not per batch or per merge, and freed at exit. Each call uses buffers only as large as its
conversions need (a tiny job pins a little), up to STAGING_BYTES each. Plain copies never visit
the GPU; the op copies them on the CPU threads.
"""

from __future__ import annotations

import atexit
import threading

import torch

from .. import _ops
from ..dtypes import itemsize
from ..io.sources import Source
from ..io.target import TargetFile
from ..plan.model import TensorPlan
from .kernel_rows import build_rows, native_pair
from .sinks import WindowOutput
from .torch_engine import TorchEngine

STAGING_BYTES = 64 << 20  # the most each of a slot's four buffers holds
SLOTS = 3
MIN_SLOT_BYTES = 1 << 20  # below this a buffer is not worth sizing down further
ALIGN = 256  # buffers start at multiples of this in their allocation (the kernel's loads need 4)


def staging_needed(tensors: list[TensorPlan]) -> int:
    """Bytes of staging the conversions among `tensors` fill: a slot holds max(in, out) bytes per element."""
    return sum(
        t.numel * max(itemsize(t.source_dtype), itemsize(t.target_dtype))
        for t in tensors
        if t.source_dtype != t.target_dtype
    )


def slot_bytes(needed: int, slots: int, cap: int) -> int:
    """Bytes per staging buffer for a call needing `needed` bytes in all: the job spread over the
    slots, rounded up to a power of two (so the cached allocation grows in few steps), at least
    MIN_SLOT_BYTES, at most `cap`; ALIGN when there is nothing to convert."""
    if needed <= 0:
        return min(cap, ALIGN)
    per_slot = -(-needed // slots)
    size = max(MIN_SLOT_BYTES, 1 << (per_slot - 1).bit_length())
    return min(cap, size)


class _Staging:
    """One pinned host and one device allocation of `nbytes`, cut into 2 x slots buffers of a size."""

    def __init__(self, device: torch.device, nbytes: int):
        self.pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)

    @staticmethod
    def nbytes(slots: int, size: int) -> int:
        return 2 * slots * _round_up(size, ALIGN)

    def buffers(self, slots: int, size: int):
        """(pinned_in, pinned_out, device_in, device_out), `slots` buffers of `size` bytes each."""
        stride = _round_up(size, ALIGN)

        def cut(allocation: torch.Tensor, first: int) -> list[torch.Tensor]:
            return [allocation[(first + k) * stride : (first + k) * stride + size] for k in range(slots)]

        return cut(self.pinned, 0), cut(self.pinned, slots), cut(self.on_device, 0), cut(self.on_device, slots)


_staging: dict[int, _Staging] = {}  # by device index
_staging_lock = threading.Lock()  # one op at a time uses a device's buffers


def _staging_for(device: torch.device, nbytes: int) -> _Staging:
    kept = _staging.get(device.index)
    if kept is None or kept.pinned.numel() < nbytes:
        _staging.pop(device.index, None)
        del kept  # the smaller one goes first (back to torch's caching allocators)
        kept = _staging[device.index] = _Staging(device, nbytes)
    return kept


@atexit.register
def _free_staging() -> None:
    _staging.clear()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class CudaEngine:
    name = "cuda"

    def __init__(self, staging_bytes: int = STAGING_BYTES, slots: int = SLOTS, device: int | None = None):
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        self.staging_bytes = staging_bytes - staging_bytes % 4
        self.slots = slots
        self._fallback = TorchEngine()

    def output(self, file: TargetFile, end: int, start: int = 0) -> WindowOutput:
        return WindowOutput(file.window(start, end), self.execute, "cuda")  # --merge-lora: fused on the GPU, as before

    def execute(self, jobs: list[tuple[TensorPlan, memoryview]], sources: Source) -> None:
        native = [j for j in jobs if native_pair(j[0].source_dtype, j[0].target_dtype) and j[0].numel]
        if native:
            tensors = [tensor for tensor, _ in native]
            views, rows = build_rows(tensors, sources)
            source_tensors = [torch.frombuffer(view, dtype=torch.uint8) for view in views]
            destinations = [torch.frombuffer(view, dtype=torch.uint8) for _, view in native]
            plan = (
                torch.frombuffer(rows, dtype=torch.int64).view(-1, _ops.COLUMNS)
                if rows
                else torch.zeros((0, _ops.COLUMNS), dtype=torch.int64)
            )
            size = slot_bytes(staging_needed(tensors), self.slots, self.staging_bytes)
            with _staging_lock, torch.cuda.device(self.device):
                staging = _staging_for(self.device, _Staging.nbytes(self.slots, size))
                _ops.gather_convert_staged(source_tensors, destinations, plan, *staging.buffers(self.slots, size))
            del source_tensors, destinations, views
        other = [j for j in jobs if not native_pair(j[0].source_dtype, j[0].target_dtype)]
        if other:
            self._fallback.execute(other, sources)
