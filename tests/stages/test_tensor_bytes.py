"""Windows over a plan's extents: the pieces that land in [lo, hi) are exactly those of the whole."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpfast.checks.tensor_bytes import runs_in_window
from fsdpfast.plan.model import Extent


def _elements(extent: Extent) -> dict[int, int]:
    """tensor element -> source element, run by run."""
    placed = {}
    for run in range(extent.runs):
        for i in range(extent.count):
            placed[extent.dst_offset + run * extent.dst_stride + i] = extent.src_offset + run * extent.src_stride + i
    return placed


@st.composite
def extents_and_windows(draw):
    count = draw(st.integers(0, 7))
    runs = draw(st.integers(1, 6))
    dst_stride = draw(st.integers(count, count + 5)) if runs > 1 else 0
    src_stride = draw(st.integers(count, count + 5)) if runs > 1 else 0
    extent = Extent(0, draw(st.integers(0, 9)), count, draw(st.integers(0, 20)), runs, src_stride, dst_stride)
    lo = draw(st.integers(0, 60))
    return extent, lo, draw(st.integers(lo, 70))


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(extents_and_windows())
def test_window_pieces_are_the_extents_elements_in_the_window(case):
    extent, lo, hi = case
    want = {dst: src for dst, src in _elements(extent).items() if lo <= dst < hi}
    got = {}
    for src, dst, count in runs_in_window(extent, lo, hi):
        assert count > 0 and lo <= dst and dst + count <= hi
        for i in range(count):
            assert dst + i not in got
            got[dst + i] = src + i
    assert got == want
