"""Read a planned tensor's bytes a window at a time from a Source, and compare two planned tensors.

The checks sometimes have to look at data, not only metadata: two names that config.json ties
must hold the same bytes before one is dropped (checks.ties), and copies that every rank holds
(buffers, HSDP replicas, whole-model saves) must agree before one is read (checks.copies). These
reads go through the plan's own extents, in the source dtype, a window of elements at a time, so
memory stays bounded whatever the tensor's size. Pure Python over the Source's byte views: no
torch, no native module. They read through the Source the merge would use (`sources_for`: mapped
files or large preads, io.read_modes), announcing each extent's ranges before viewing it, so on a
slow mount a check reads what it compares, with the merge's requests, and no whole rank file.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..dtypes import itemsize
from ..io.read_modes import chosen_read_mode
from ..io.sources import Source, open_sources
from ..plan.model import Extent, SourceBuffer, TensorPlan

WINDOW_BYTES = 16 << 20  # bytes of one tensor held at once


def runs_in_window(extent: Extent, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
    """(source element, tensor element, count) of each piece of `extent` that falls in [lo, hi)."""
    if not extent.numel or hi <= lo:
        return
    stride = extent.dst_stride if extent.runs > 1 else 0
    first, last = 0, extent.runs - 1
    if stride:  # only the runs that can touch the window
        first = max(0, (lo - extent.count - extent.dst_offset) // stride + 1)
        last = min(last, -(-(hi - extent.dst_offset) // stride) - 1)
    src_stride = extent.src_stride if extent.runs > 1 else 0
    for run in range(first, last + 1):
        dst = extent.dst_offset + run * stride
        start, end = max(dst, lo), min(dst + extent.count, hi)
        if start < end:
            yield extent.src_offset + run * src_stride + (start - dst), start, end - start


def sources_for(buffers: list[SourceBuffer], read_mode: str = "auto") -> Source:
    """The Source a merge of these buffers reads with under `read_mode` (auto: by their filesystem)."""
    return open_sources(buffers, chosen_read_mode(read_mode, buffers)[0])


def read_window(tensor: TensorPlan, lo: int, hi: int, sources: Source) -> bytearray:
    """Elements [lo, hi) of the tensor (row-major), in its source dtype."""
    size = itemsize(tensor.source_dtype)
    out = bytearray((hi - lo) * size)
    for extent in tensor.extents:
        runs = list(runs_in_window(extent, lo, hi))
        if not runs:
            continue
        sources.read_ahead({extent.source: [(src * size, (src + count) * size) for src, _, count in runs]})
        view = sources.view(extent.source)
        try:
            for src, dst, count in runs:
                out[(dst - lo) * size : (dst - lo + count) * size] = view[src * size : (src + count) * size]
        finally:
            view.release()
            sources.release(extent.source)  # the ranges announced above: their memory goes back
    return out


def first_difference(a: TensorPlan, b: TensorPlan, sources: Source) -> int | None:
    """The first element at which two tensors of one shape and dtype differ, or None if they are equal."""
    if a.shape != b.shape or a.source_dtype != b.source_dtype:
        return 0
    if a.extents == b.extents:  # one storage under two names
        return None
    step = max(1, WINDOW_BYTES // itemsize(a.source_dtype))
    for lo in range(0, a.numel, step):
        hi = min(a.numel, lo + step)
        x, y = read_window(a, lo, hi, sources), read_window(b, lo, hi, sources)
        if x != y:
            return lo + _first_differing_byte(x, y) // itemsize(a.source_dtype)
    return None


def _first_differing_byte(x: bytearray, y: bytearray) -> int:
    block = 4096
    for start in range(0, len(x), block):
        if x[start : start + block] != y[start : start + block]:
            return start + next(i for i in range(block) if x[start + i] != y[start + i])
    return -1
