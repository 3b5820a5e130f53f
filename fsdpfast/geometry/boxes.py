"""Turn "this contiguous local piece fills this box of the global tensor" into extents."""

from __future__ import annotations

from itertools import product
from math import prod

from ..plan.model import Extent


def box_extents(
    source: int, src_offset: int, global_shape, offsets, sizes, local_shape=None, local_offsets=None
) -> list[Extent]:
    """Extents copying a box of shape `sizes` from a row-major local piece into the global box at `offsets`.

    The box is the whole local piece unless `local_shape` (the piece's shape) and `local_offsets`
    (where the box starts in it) say otherwise, as for the row-blocks of a _StridedShard piece.
    The innermost partial dimension and the full dimensions inside it make one contiguous run
    (full in the global tensor means full in the piece too); the dimensions outside it, up to
    and including the next partial one, become the strided runs of one extent; any dimensions
    further out are enumerated, one extent each.
    """
    ndim = len(global_shape)
    if prod(sizes) == 0:
        return []
    local_shape = tuple(sizes) if local_shape is None else tuple(local_shape)
    l_strides = _row_major_strides(local_shape)
    if local_offsets is not None:
        src_offset += sum(o * s for o, s in zip(local_offsets, l_strides))
    partial = [d for d in range(ndim) if sizes[d] != global_shape[d]]
    if not partial:
        return [Extent(source, src_offset, prod(global_shape), 0)]
    k = partial[-1]
    g_strides = _row_major_strides(global_shape)
    count = sizes[k] * g_strides[k]
    base = offsets[k] * g_strides[k]
    if k == 0:
        return [Extent(source, src_offset, count, base)]
    outer_partial = [d for d in partial if d < k]
    m = outer_partial[-1] if outer_partial else 0
    # Runs walk dims m..k-1 as one flat index: uniform strides since dims m+1..k-1 are full.
    runs = prod(sizes[m:k])
    base += offsets[m] * g_strides[m]
    extents = []
    for index in product(*(range(sizes[d]) for d in range(m))):
        dst = base + sum((offsets[d] + i) * g_strides[d] for d, i in enumerate(index))
        src = src_offset + sum(i * l_strides[d] for d, i in enumerate(index))
        extents.append(Extent(source, src, count, dst, runs, l_strides[k - 1], g_strides[k - 1]))
    return extents


def _row_major_strides(shape) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def first_overlap(boxes: list[tuple[tuple, tuple]]) -> tuple[int, int] | None:
    """Indices of two boxes (offsets, sizes) that share an element, or None; empty boxes share nothing.

    A sweep along the dimension where the boxes start at the most different places: the usual
    sharding along one dimension costs a sort instead of comparing every pair.
    """
    live = [i for i, (_, sizes) in enumerate(boxes) if prod(sizes)]
    if len(live) < 2:
        return None
    ndim = len(boxes[live[0]][0])
    if ndim == 0:
        return live[0], live[1]
    d = max(range(ndim), key=lambda k: len({boxes[i][0][k] for i in live}))
    active: list[int] = []
    for i in sorted(live, key=lambda i: boxes[i][0][d]):
        offsets, sizes = boxes[i]
        active = [j for j in active if boxes[j][0][d] + boxes[j][1][d] > offsets[d]]
        for j in active:
            other, other_sizes = boxes[j]
            if all(offsets[k] < other[k] + other_sizes[k] and other[k] < offsets[k] + sizes[k] for k in range(ndim)):
                return j, i
        active.append(i)
    return None
