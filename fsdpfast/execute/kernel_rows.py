"""Turn tensor plans into the int64 plan rows the kernels take (csrc/plan_rows.h)."""

from __future__ import annotations

from array import array

from .. import _ops
from ..dtypes import itemsize
from ..io.sources import SourceFiles
from ..plan.model import TensorPlan


def native_pair(source: str, target: str) -> bool:
    """Whether the kernels handle this dtype pair (plain copies, or between the 16/32-bit floats)."""
    return source == target or (_ops.code(source) != 0 and _ops.code(target) != 0)


def build_rows(tensors: list[TensorPlan], sources: SourceFiles) -> tuple[list[memoryview], array]:
    """(views of the sources used, flat int64 plan rows); destination i of the rows is tensors[i]."""
    source_index: dict[int, int] = {}
    views: list[memoryview] = []
    rows = array("q")
    for dst_index, tensor in enumerate(tensors):
        same = tensor.source_dtype == tensor.target_dtype
        src_code = 0 if same else _ops.code(tensor.source_dtype)
        dst_code = 0 if same else _ops.code(tensor.target_dtype)
        src_size, dst_size = itemsize(tensor.source_dtype), itemsize(tensor.target_dtype)
        for e in tensor.extents:
            if e.source not in source_index:
                source_index[e.source] = len(views)
                views.append(sources.view(e.source))
            rows.extend(
                (
                    source_index[e.source],
                    dst_index,
                    src_code,
                    dst_code,
                    src_size,
                    dst_size,
                    e.src_offset,
                    e.count,
                    e.dst_offset,
                    e.runs,
                    e.src_stride,
                    e.dst_stride,
                )
            )
    return views, rows
