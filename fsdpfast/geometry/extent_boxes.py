"""An extent's elements as boxes of its tensor, and a box of strided elements as extents.

The arithmetic under plan.windows (a tensor made of boxes of others): an Extent's runs fill a
set of elements of a row-major tensor; each piece of it that is a box, with where its first
element is in the source buffer and the source strides per dimension, can be cut by any other box
and placed anywhere, and `strided_extents` turns the result back into as few extents as it can.
"""

from __future__ import annotations

from itertools import product

from ..plan.model import Extent


def row_major_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(strides[::-1])


def _unravel(position: int, strides) -> tuple[int, ...]:
    """Coordinates of a flat position (the first dimension unbounded)."""
    return tuple(position // s if d == 0 else position % strides[d - 1] // s for d, s in enumerate(strides))


def run_boxes(start: int, count: int, shape) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The flat run [start, start + count) of a row-major tensor as boxes (offsets, sizes), in order:
    at most 2·ndim − 1 (the partial blocks up to an aligned one, the whole blocks, the partial ones after)."""
    if count <= 0:
        return []
    if not shape:
        return [((), ())]
    strides, ndim = row_major_strides(shape), len(shape)
    boxes, position, end = [], start, start + count

    def take(d: int, slots: int) -> None:  # `slots` slots of dimension d from `position`, aligned to strides[d]
        nonlocal position
        if slots:
            boxes.append((_unravel(position, strides), (1,) * d + (slots,) + tuple(shape[d + 1 :])))
            position += slots * strides[d]

    d, short = ndim - 1, False
    while d > 0:  # up: whole slots of ever larger dimensions until `position` starts a block of dimension d - 1
        block = strides[d - 1]
        if position % block:
            take(d, min((block - position % block) // strides[d], (end - position) // strides[d]))
            if position % block:  # the run ends inside this block: the rest is less than a slot of d
                short = True
                break
        d -= 1
    for smaller in range(d + 1 if short else 0, ndim):  # down: what is left, in ever smaller slots
        take(smaller, (end - position) // strides[smaller])
    return boxes


def extent_boxes(extent: Extent, shape, low: int, high: int):
    """(offsets, sizes, source offset of the box's first element, source strides) of the boxes of `shape`
    the extent's runs fill, for its runs that meet the flat range [low, high) of the tensor only.

    Runs a whole slot apart of one dimension (a TP piece's rows, a stacked tensor's layers) make one
    box for as many runs as that dimension holds in a row; other runs are taken one at a time.
    """
    e, strides = extent, row_major_strides(shape)
    first, last = 0, e.runs
    if e.runs > 1 and e.dst_stride > 0:  # only the runs that meet [low, high)
        first = max(0, (low - e.count - e.dst_offset) // e.dst_stride + 1)
        last = min(e.runs, -((e.dst_offset - high) // e.dst_stride))
    elif e.runs > 1:
        last = 1  # runs on top of each other: the first stands for them (plan.checks refuses the plan)
    if first >= last:
        return
    if not shape:
        yield (), (), e.src_offset, ()
        return
    m = next((d for d, s in enumerate(strides) if s == e.dst_stride), None) if last - first > 1 else None
    if m is not None and e.dst_offset % strides[m] + e.count <= strides[m]:
        # each run within one slot of dimension m, the next run in the next slot: runs along m
        within = e.dst_offset % strides[m]
        inner = [
            (offsets, sizes, sum(o * s for o, s in zip(offsets, strides[m + 1 :])) - within)
            for offsets, sizes in run_boxes(within, e.count, shape[m + 1 :])
        ]
        run = first
        while run < last:
            at = e.dst_offset - within + run * e.dst_stride  # the run's slot of dimension m
            outer = _unravel(at, strides[: m + 1])
            together = min(last - run, shape[m] - outer[m]) if m else last - run
            for offsets, sizes, shift in inner:
                yield (
                    (*outer, *offsets),
                    (1,) * m + (together, *sizes),
                    e.src_offset + run * e.src_stride + shift,
                    (0,) * m + (e.src_stride, *strides[m + 1 :]),
                )
            run += together
        return
    for run in range(first, last):
        at, src = e.dst_offset + run * e.dst_stride, e.src_offset + run * e.src_stride
        for offsets, sizes in run_boxes(at, e.count, shape):
            yield offsets, sizes, src + sum(o * s for o, s in zip(offsets, strides)) - at, strides


def strided_extents(source: int, src: int, dst: int, sizes, src_strides, dst_strides) -> list[Extent]:
    """Extents copying a box of `sizes` whose elements are at `src + index · src_strides` of a source
    buffer to `dst + index · dst_strides` of a tensor: dimensions contiguous in both make the count,
    the next ones out, as long as they step evenly in both, the runs, any further out one extent each."""
    if any(size == 0 for size in sizes):
        return []
    dims = [d for d, size in enumerate(sizes) if size != 1]
    count, i = 1, len(dims) - 1
    while i >= 0 and src_strides[dims[i]] == count == dst_strides[dims[i]]:
        count *= sizes[dims[i]]
        i -= 1
    if i < 0:
        return [Extent(source, src, count, dst)]
    d = dims[i]
    runs, src_step, dst_step = sizes[d], src_strides[d], dst_strides[d]
    i -= 1
    while i >= 0 and src_strides[dims[i]] == src_step * runs and dst_strides[dims[i]] == dst_step * runs:
        runs *= sizes[dims[i]]
        i -= 1
    outer = dims[: i + 1]
    extents = []
    for index in product(*(range(sizes[d]) for d in outer)):
        s = src + sum(k * src_strides[d] for d, k in zip(outer, index))
        t = dst + sum(k * dst_strides[d] for d, k in zip(outer, index))
        extents.append(Extent(source, s, count, t, runs, src_step, dst_step))
    return extents
