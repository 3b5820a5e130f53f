"""Check a reader's plan before any byte moves: every element of every tensor written exactly once.

Readers check what their format promises; this checks the result, whatever the layout: each
extent stays inside its tensor and inside the bytes of its source, no two extents write the same
element, and together they cover the whole tensor. A gap or an overlap means damaged or
inconsistent metadata, and the error names the tensor. The engines rely on it: they copy
without bounds checks.

Strided extents (Shard(d) for d > 0) are arithmetic progressions of runs. Extents that share a
stride S never collide when their runs, taken modulo S, do not collide, which checks a
well-formed plan in O(E log E) for E extents however many rows they span; only a group that
fails that test is expanded run by run to find (or rule out) a real overlap.
"""

from __future__ import annotations

import heapq
from array import array
from math import prod

from ..dtypes import itemsize
from ..errors import BadInput
from .columns import Records
from .model import Extent, MergePlan, SourceBuffer


def check_plan(plan: MergePlan) -> None:
    # read once, a million buffers at 1,024 ranks
    sources = plan.sources
    sizes = sources.column("nbytes") if isinstance(sources, Records) else [source.nbytes for source in sources]
    tiles = _native_tiles() if isinstance(sizes, array) else None
    for tensor in plan.tensors:
        extents, total = tensor.extents, prod(tensor.shape)
        numbers = extents.numbers() if tiles is not None and isinstance(extents, Records) else None
        if numbers is not None and total < 1 << 63 and tiles(numbers, sizes, total, itemsize(tensor.source_dtype)):
            continue  # surely right (csrc/plan_checks.h); anything else is decided, and named, below
        check_extents(tensor.name, tensor.shape, tensor.source_dtype, extents, plan.sources, sizes)


def _native_tiles():
    """The native module's extents_tile, where it is built (and new enough to have it)."""
    from .. import _ops

    return getattr(_ops.native(), "extents_tile", None)


def check_extents(
    name: str, shape, dtype: str, extents: list[Extent], sources: list[SourceBuffer], sizes: list[int] | None = None
) -> None:
    """`sizes`: each source buffer's nbytes, if at hand."""
    total = prod(shape)
    size = itemsize(dtype)
    if sizes is None:
        sizes = [source.nbytes for source in sources]
    spans = []
    covered = 0
    for extent in extents:
        end = _check_bounds(name, shape, total, size, extent, sources, sizes)
        if extent.numel:
            spans.append((extent.dst_offset, end, extent))
            covered += extent.numel
    spans.sort(key=lambda span: (span[0], span[1]))
    for group in _overlapping_groups(spans):
        where = _first_overlap(group)
        if where is not None:
            raise BadInput(
                f"{name}: two pieces of the checkpoint both hold element {where} of this {list(shape)} tensor; "
                "its shards overlap, so the metadata is damaged or comes from different checkpoints"
            )
    if covered != total:
        raise BadInput(
            f"{name}: the pieces of the checkpoint cover {covered} of the {total} elements of this {list(shape)} "
            "tensor; shards are missing or the metadata is damaged"
        )


def _check_bounds(name, shape, total: int, size: int, e: Extent, sources: list[SourceBuffer], sizes: list[int]) -> int:
    """The end (exclusive) of the extent's last run in the tensor; an error if it leaves its tensor or source."""
    if min(e.src_offset, e.dst_offset, e.count, e.src_stride, e.dst_stride) < 0 or e.runs < 0:
        raise BadInput(
            f"{name}: the checkpoint describes a piece of it with negative offsets or sizes; the metadata is damaged"
        )
    if not e.numel:
        return e.dst_offset
    if e.runs > 1 and e.dst_stride < e.count:
        raise BadInput(
            f"{name}: a piece of it overlaps itself (runs of {e.count} elements {e.dst_stride} apart); "
            "the metadata is damaged"
        )
    end = e.dst_offset + (e.runs - 1) * e.dst_stride + e.count
    if end > total:
        raise BadInput(
            f"{name}: a piece of it reaches element {end - 1} of a {list(shape)} tensor of {total}; "
            "the metadata is damaged"
        )
    if not 0 <= e.source < len(sizes):
        raise BadInput(f"{name}: a piece of it names no input file; the metadata is damaged")
    src_end = (e.src_offset + (e.runs - 1) * e.src_stride + e.count) * size
    if src_end > sizes[e.source]:
        raise BadInput(
            f"{sources[e.source].path}: {name} reads {src_end} bytes from a record of {sizes[e.source]}; "
            "the file is truncated or its metadata is damaged"
        )
    return end


def _overlapping_groups(spans):
    """Runs of spans (sorted by start) whose [first, last element] ranges chain into each other."""
    group, group_end = [], -1
    for span in spans:
        if group and span[0] >= group_end:
            if len(group) > 1:
                yield group
            group, group_end = [], -1
        group.append(span)
        group_end = max(group_end, span[1])
    if len(group) > 1:
        yield group


def _first_overlap(group) -> int | None:
    """An element written twice within this group, or None."""
    if _disjoint_modulo_stride([extent for _, _, extent in group]):
        return None
    # Expand run by run, in order of start, and stop at the first run that begins inside another.
    heap = [(e.dst_offset, 0, i) for i, (_, _, e) in enumerate(group)]
    heapq.heapify(heap)
    reached = -1
    while heap:
        start, run, i = heapq.heappop(heap)
        if start < reached:
            return start
        extent = group[i][2]
        reached = max(reached, start + extent.count)
        if run + 1 < extent.runs:
            heapq.heappush(heap, (start + extent.dst_stride, run + 1, i))
    return None


def _disjoint_modulo_stride(extents: list[Extent]) -> bool:
    """True if the extents share one stride S and their runs, folded modulo S, do not overlap."""
    strides = {e.dst_stride for e in extents if e.runs > 1}
    if len(strides) != 1:
        return False
    (stride,) = strides
    if any(e.count > stride for e in extents):
        return False
    pieces = []
    for e in extents:
        start = e.dst_offset % stride
        if start + e.count <= stride:
            pieces.append((start, start + e.count))
        else:  # wraps around the end of the period
            pieces += [(start, stride), (0, start + e.count - stride)]
    pieces.sort()
    return all(a[1] <= b[0] for a, b in zip(pieces, pieces[1:]))
