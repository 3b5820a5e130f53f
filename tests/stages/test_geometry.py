"""Where pieces go: torch.chunk spans and box extents, checked against torch itself."""

from __future__ import annotations

import random

import pytest
import torch

from fsdpfast.geometry.boxes import box_extents
from fsdpfast.geometry.placements import chunk_span


@pytest.mark.parametrize("size", [0, 1, 2, 7, 13, 64, 101])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_chunk_span_matches_torch_chunk(size, parts):
    pieces = torch.arange(size).chunk(parts) if size else ()
    lengths = [len(p) for p in pieces] + [0] * (parts - len(pieces))
    starts = [int(p[0]) if len(p) else size for p in pieces] + [size] * (parts - len(pieces))
    for index in range(parts):
        start, length = chunk_span(size, parts, index)
        assert length == lengths[index]
        if length:
            assert start == starts[index]


def _apply(extents, local: torch.Tensor, global_shape) -> torch.Tensor:
    out = torch.zeros(global_shape, dtype=local.dtype).view(-1)
    src = local.reshape(-1)
    for e in extents:
        for run in range(e.runs):
            d, s = e.dst_offset + run * e.dst_stride, e.src_offset + run * e.src_stride
            out[d : d + e.count] = src[s : s + e.count]
    return out.view(global_shape)


def test_box_extents_place_every_box_like_slicing():
    rng = random.Random(0)
    for _ in range(2000):
        shape = [rng.randint(1, 5) for _ in range(rng.randint(1, 4))]
        offsets = [rng.randint(0, g - 1) for g in shape]
        sizes = [rng.randint(1, g - o) for g, o in zip(shape, offsets)]
        local = torch.arange(1, 1 + torch.Size(sizes).numel()).reshape(sizes)
        expected = torch.zeros(shape, dtype=local.dtype)
        expected[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = local
        assert torch.equal(_apply(box_extents(0, 0, shape, offsets, sizes), local, shape), expected), (
            shape,
            offsets,
            sizes,
        )


def test_shard_on_inner_dim_is_one_strided_extent():
    extents = box_extents(0, 5, (6, 8, 3), (0, 4, 0), (6, 4, 3))
    assert len(extents) == 1
    (e,) = extents
    assert (e.runs, e.count, e.src_stride, e.dst_stride, e.src_offset, e.dst_offset) == (6, 12, 12, 24, 5, 12)


def test_empty_box_has_no_extents():
    assert box_extents(0, 0, (0, 4), (0, 0), (0, 4)) == []
