"""Turn jobs (tensor plans and their destination bytes) into the int64 plan rows the ops take."""
from __future__ import annotations

import torch

from .. import _ops
from ..dtypes import itemsize
from ..plan import TensorPlan
from .sources import SourceFiles


def native_pair(source: str, target: str) -> bool:
    """Whether the native ops handle this dtype pair (plain copies, or between the 16/32-bit floats)."""
    return source == target or (_ops.code(source) != 0 and _ops.code(target) != 0)


def build_rows(jobs: list[tuple[TensorPlan, memoryview]], sources: SourceFiles):
    """(source byte tensors, destination byte tensors, plan rows) for jobs the ops can run."""
    source_index: dict[int, int] = {}
    source_views: list[torch.Tensor] = []
    destinations: list[torch.Tensor] = []
    rows: list[list[int]] = []
    for tensor, destination in jobs:
        if tensor.numel == 0:
            continue
        same = tensor.source_dtype == tensor.target_dtype
        src_code = 0 if same else _ops.code(tensor.source_dtype)
        dst_code = 0 if same else _ops.code(tensor.target_dtype)
        src_size, dst_size = itemsize(tensor.source_dtype), itemsize(tensor.target_dtype)
        destinations.append(torch.frombuffer(destination, dtype=torch.uint8))
        dst_index = len(destinations) - 1
        for e in tensor.extents:
            if e.source not in source_index:
                source_index[e.source] = len(source_views)
                source_views.append(torch.frombuffer(sources.view(e.source), dtype=torch.uint8))
            rows.append([source_index[e.source], dst_index, src_code, dst_code, src_size, dst_size,
                         e.src_offset, e.count, e.dst_offset, e.runs, e.src_stride, e.dst_stride])
    plan = torch.tensor(rows, dtype=torch.int64) if rows else torch.zeros((0, 12), dtype=torch.int64)
    return source_views, destinations, plan
