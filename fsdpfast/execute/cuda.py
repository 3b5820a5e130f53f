"""The CUDA engine: conversions stream through pinned staging buffers and the GPU.

Pinned and device buffers are allocated once, when the engine is made for a merge. Plain
copies never visit the GPU; the op copies them on the CPU.
"""
from __future__ import annotations

import torch

from .. import _ops
from ..plan.model import TensorPlan
from .outputs import MappedOutput
from .rows import build_rows, native_pair
from ..io.sources import Source
from .torch_ref import TorchEngine

STAGING_BYTES = 64 << 20  # per slot, input side; the output side holds twice as much
SLOTS = 3


class CudaEngine:
    name = "cuda"

    def __init__(self, staging_bytes: int = STAGING_BYTES, slots: int = SLOTS, device: int | None = None):
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        staging_bytes -= staging_bytes % 4
        self.pinned_in = [torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self.pinned_out = [torch.empty(2 * staging_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self.device_in = [torch.empty(staging_bytes, dtype=torch.uint8, device=self.device) for _ in range(slots)]
        self.device_out = [torch.empty(2 * staging_bytes, dtype=torch.uint8, device=self.device) for _ in range(slots)]
        self._fallback = TorchEngine()

    def output(self, fd: int, end: int, start: int = 0) -> MappedOutput:
        return MappedOutput(fd, end, self.execute, "cuda", start)  # --merge-lora: fused on the GPU, as before

    def execute(self, jobs: list[tuple[TensorPlan, memoryview]], sources: Source) -> None:
        native = [j for j in jobs if native_pair(j[0].source_dtype, j[0].target_dtype) and j[0].numel]
        if native:
            views, rows = build_rows([tensor for tensor, _ in native], sources)
            source_tensors = [torch.frombuffer(view, dtype=torch.uint8) for view in views]
            destinations = [torch.frombuffer(view, dtype=torch.uint8) for _, view in native]
            plan = torch.frombuffer(rows, dtype=torch.int64).view(-1, _ops.COLUMNS) if rows else torch.zeros((0, _ops.COLUMNS), dtype=torch.int64)
            with torch.cuda.device(self.device):
                _ops.gather_convert_staged(source_tensors, destinations, plan, self.pinned_in, self.pinned_out,
                                           self.device_in, self.device_out)
            del source_tensors, destinations, views
        other = [j for j in jobs if not native_pair(j[0].source_dtype, j[0].target_dtype)]
        if other:
            self._fallback.execute(other, sources)
