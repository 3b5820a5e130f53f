"""The native CPU engine: one multithreaded gather + convert + write pass per batch of tensors."""
from __future__ import annotations

from .. import _ops
from ..plan import TensorPlan
from .rows import build_rows, native_pair
from .sources import SourceFiles
from .torch_ref import TorchEngine


class NativeCpuEngine:
    name = "cpu"

    def __init__(self):
        self._fallback = TorchEngine()  # for dtype pairs the kernels do not cover (float64 casts)

    def execute(self, jobs: list[tuple[TensorPlan, memoryview]], sources: SourceFiles) -> None:
        native = [j for j in jobs if native_pair(j[0].source_dtype, j[0].target_dtype)]
        other = [j for j in jobs if not native_pair(j[0].source_dtype, j[0].target_dtype)]
        if native:
            src, dst, plan = build_rows(native, sources)
            if plan.shape[0]:
                _ops.gather_convert(src, dst, plan)
            del src, dst
        if other:
            self._fallback.execute(other, sources)
