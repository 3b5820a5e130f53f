"""A tensor made of windows of a plan's tensors: names and extents mapped, never a byte read.

A Window is a box (offsets and sizes per dimension) of one tensor's elements, placed at `at` in a
new tensor; the new tensor's extents are computed from the plan's extents of the tensors it cuts
(geometry.extent_boxes), so what a plan transform builds with it is as exact as the reader's plan:
a fused projection split into parts, a layer of a stacked tensor, an expert, a rename (the window
of a whole tensor). Leading dimensions of size one line up with nothing: layer i of a stacked
(L, r, c) tensor is the window (i, 0, 0) + (1, r, c), placed at (0, 0) of an (r, c) tensor.
A window is looked up among the extents that may meet it (a bisection), not among all of a
tensor's: a stacked tensor has a piece per layer and TP rank, and a layer's window meets a few.
A window may land every `step`-th slot of a dimension of the new tensor (gpt-oss's gate rows at 0, 2,
4, ... of its packed gate_up_proj): its rows then become the runs of one strided extent per piece it
meets, so the plan's size does not grow with the number of rows.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from math import prod

from ..errors import BadInput
from ..geometry.extent_boxes import extent_boxes, row_major_strides, strided_extents
from .model import Extent, TensorPlan, Transposed


@dataclass(frozen=True)
class Window:
    """The box (offsets, sizes) of tensor `tensor`, placed at `at` of the new tensor, element k of the box's
    dimension d at `at[d] + k * step[d]` there (step None: every slot, 1 in each dimension)."""

    tensor: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    at: tuple[int, ...]
    step: tuple[int, ...] | None = None

    def steps(self) -> tuple[int, ...]:
        return self.step if self.step is not None else (1,) * len(self.sizes)

    def span(self) -> tuple[int, ...]:
        """The slots of each dimension of the new tensor from the window's first element to its last."""
        return tuple((n - 1) * k + 1 if n else 0 for n, k in zip(self.sizes, self.steps()))


class Windows:
    """A plan's tensors, for building tensors out of windows of them."""

    def __init__(self, tensors: Iterable[TensorPlan]):
        self._tensors = {t.name: t for t in tensors}
        self._index: dict[str, tuple[list[Extent], list[int], list[int]]] = {}

    def tensor(self, name: str, shape: Sequence[int], windows: Sequence[Window]) -> TensorPlan:
        """The tensor `name` of `shape` made of `windows`, of tensors of one dtype. A part of a window
        no extent fills is left empty: the caller compares the result's elements with its shape
        (`whole` does). A window that does not fit is refused in one line (BadInput, a ValueError)."""
        if not windows:
            raise BadInput(f"{name}: no windows")
        shape = tuple(shape)
        given = [self._given(name, shape, w) for w in windows]
        dtypes = {(t.source_dtype, t.target_dtype) for t in given}
        if len(dtypes) > 1:
            raise BadInput(f"{name}: windows of tensors of different dtypes ({sorted(dtypes)})")
        extents: list[Extent] = []
        for window, source in zip(windows, given):
            extents += self._extents(window, source.shape, shape)
        return TensorPlan(name, shape, given[0].source_dtype, given[0].target_dtype, _merged(extents))

    def whole(self, name: str, shape: Sequence[int], windows: Sequence[Window]) -> TensorPlan:
        """`tensor`, every element of it filled: the windows of a conversion cover their tensor, so a
        part left empty is refused (it would be written as zeros) rather than returned."""
        made = self.tensor(name, shape, windows)
        filled = sum(e.numel for e in made.extents)
        if filled != prod(made.shape):
            raise BadInput(
                f"{name}: its windows fill {filled} of its {prod(made.shape)} elements; the checkpoint is "
                f"incomplete ({', '.join(sorted({w.tensor for w in windows}))})"
            )
        return made

    def transposed(self, name: str, window: Window) -> TensorPlan:
        """Tensor `name`: the window (a box of one tensor, two dimensions at least) with its last two
        dimensions swapped, every element filled (as `whole`). Its extents are the window's in its own
        order; its `compute` (plan.model.Transposed) has the engines write it transposed."""
        if len(window.sizes) < 2:
            raise BadInput(
                f"{name}: a transposed window needs two dimensions, {window.tensor}'s has {len(window.sizes)}"
            )
        return self.transposed_of(name, window.sizes, [replace(window, at=(0,) * len(window.sizes))])

    def transposed_of(self, name: str, shape: Sequence[int], windows: Sequence[Window]) -> TensorPlan:
        """Tensor `name`: the tensor of `shape` (two dimensions at least) the windows fill whole (as `whole`),
        written with its last two dimensions swapped (plan.model.Transposed)."""
        if len(shape) < 2:
            raise BadInput(f"{name}: a transposed tensor needs two dimensions, not {list(shape)}")
        inner = self.whole(name, shape, windows)
        rows, cols = inner.shape[-2:]
        used = frozenset(e.source for e in inner.extents)
        return replace(inner, shape=(*inner.shape[:-2], cols, rows), compute=Transposed(rows, cols, used))

    def _given(self, name: str, shape: tuple[int, ...], w: Window) -> TensorPlan:
        """The tensor a window cuts, the window checked against it and against the new tensor."""
        source = self._tensors.get(w.tensor)
        if source is None:
            raise BadInput(f"{name}: a window of {w.tensor}, which the plan does not hold")
        if source.compute is not None:
            raise BadInput(f"{name}: a window of {w.tensor}, a computed tensor (its extents are not its bytes)")
        fits = len(w.offsets) == len(w.sizes) == len(source.shape) == len(w.steps()) and all(
            0 <= o and s >= 0 and o + s <= n for o, s, n in zip(w.offsets, w.sizes, source.shape)
        )
        fits = fits and all(k >= 1 for k in w.steps())
        region, out, at = _aligned(w.span(), shape, w.at)
        if not fits or len(w.at) != len(shape) or not all(0 <= a and a + s <= n for a, s, n in zip(at, region, out)):
            raise BadInput(
                f"{name}: the window {list(w.offsets)} + {list(w.sizes)} of {w.tensor} {list(source.shape)} "
                f"at {list(w.at)} does not fit in both tensors ({list(shape)})"
            )
        return source

    def _extents(self, w: Window, source_shape: tuple[int, ...], shape: tuple[int, ...]) -> list[Extent]:
        if prod(w.sizes) == 0:
            return []
        strides = row_major_strides(source_shape)
        low = sum(o * s for o, s in zip(w.offsets, strides))
        high = sum((o + n - 1) * s for o, n, s in zip(w.offsets, w.sizes, strides)) + 1
        _, out_shape, at = _aligned(w.sizes, shape, w.at)
        out_strides = row_major_strides(out_shape)
        lead = len(out_shape) - len(source_shape)  # the new tensor's dimension of the window's first one
        base = sum(a * s for a, s in zip(at, out_strides))
        dst_strides = tuple(out_strides[d + lead] * k for d, k in zip(range(len(source_shape)), w.steps()))
        found = []
        for extent in self._meeting(w.tensor, low, high):
            for offsets, sizes, src, src_strides in extent_boxes(extent, source_shape, low, high):
                lo = [max(p, o) for p, o in zip(offsets, w.offsets)]
                hi = [min(p + n, o + m) for p, n, o, m in zip(offsets, sizes, w.offsets, w.sizes)]
                if any(h <= low_d for low_d, h in zip(lo, hi)):
                    continue
                src += sum((a - p) * s for a, p, s in zip(lo, offsets, src_strides))
                dst = base + sum((a - o) * s for a, o, s in zip(lo, w.offsets, dst_strides))
                sizes = [h - a for a, h in zip(lo, hi)]
                found += strided_extents(extent.source, src, dst, sizes, src_strides, dst_strides)
        return found

    def _meeting(self, name: str, low: int, high: int) -> list[Extent]:
        """The extents of tensor `name` whose elements span part of the flat range [low, high)."""
        if name not in self._index:
            ordered = sorted(self._tensors[name].extents, key=lambda e: e.dst_offset)
            starts = [e.dst_offset for e in ordered]
            reach, furthest = [], 0  # the furthest any extent so far reaches: ascending, so bisectable
            for e in ordered:
                furthest = max(furthest, e.dst_offset + (e.runs - 1) * e.dst_stride + e.count)
                reach.append(furthest)
            self._index[name] = ordered, starts, reach
        ordered, starts, reach = self._index[name]
        first, last = bisect.bisect_right(reach, low), bisect.bisect_left(starts, high)
        return [e for e in ordered[first:last] if e.dst_offset + (e.runs - 1) * e.dst_stride + e.count > low]


def _aligned(sizes, shape, at) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The window's sizes, the new tensor's shape and `at`, given the same number of dimensions by
    leading ones (of size one: the fit check keeps a window's extra leading dimensions to one slot)."""
    ndim = max(len(sizes), len(shape))
    return (
        (1,) * (ndim - len(sizes)) + tuple(sizes),
        (1,) * (ndim - len(shape)) + tuple(shape),
        (0,) * (ndim - len(at)) + tuple(at),
    )


def _merged(extents: list[Extent]) -> tuple[Extent, ...]:
    """Extents that continue the one before (contiguous single runs, a strided one's next runs) joined."""
    out: list[Extent] = []
    for e in extents:
        p = out[-1] if out else None
        if p is not None and p.source == e.source:
            if p.runs == 1 == e.runs and (e.src_offset, e.dst_offset) == (
                p.src_offset + p.count,
                p.dst_offset + p.count,
            ):
                out[-1] = Extent(p.source, p.src_offset, p.count + e.count, p.dst_offset)
                continue
            if (
                p.runs > 1
                and p.count == e.count
                and (e.runs == 1 or (e.src_stride, e.dst_stride) == (p.src_stride, p.dst_stride))
                and e.src_offset == p.src_offset + p.runs * p.src_stride
                and e.dst_offset == p.dst_offset + p.runs * p.dst_stride
            ):
                out[-1] = Extent(
                    p.source, p.src_offset, p.count, p.dst_offset, p.runs + e.runs, p.src_stride, p.dst_stride
                )
                continue
        out.append(e)
    return tuple(out)
