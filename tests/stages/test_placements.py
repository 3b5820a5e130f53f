"""Where a DTensor's local piece sits, for any placements on any mesh, checked against torch's own
code on random shapes and meshes: the left-to-right reading against the `_split_tensor` of Shard
and _StridedShard that distribute_tensor runs and `_compute_local_shape_and_global_offset` that
DCP saves by; the shard-order reading against torch's decoding of split factors (what
redistribute and full_tensor() follow, and FSDP2's own pieces)."""

from __future__ import annotations

import random
from itertools import product
from math import prod

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from fsdpfast.errors import BadInput
from fsdpfast.geometry.boxes import box_extents
from fsdpfast.geometry.placements import (
    LEFT_TO_RIGHT,
    SHARD_ORDER,
    DTensorLayout,
    _shard_order,
    choose_reading,
    strided_pick,
)
from fsdpfast.plan.checks import check_extents
from fsdpfast.plan.model import SourceBuffer


def _torch_local(tensor: torch.Tensor, placements, mesh_shape, coordinate) -> torch.Tensor:
    """The local piece as distribute_tensor cuts it: placements applied left to right."""
    for placement, parts, index in zip(placements, mesh_shape, coordinate):
        if not isinstance(placement, Replicate):
            tensor = placement._split_tensor(tensor, parts, with_padding=False)[0][index]
    return tensor


def _ours(placements, mesh_shape, coordinate, shape) -> DTensorLayout:
    kinds = tuple(
        ("replicate", None, 1)
        if isinstance(p, Replicate)
        else ("strided", p.dim, p.split_factor)
        if isinstance(p, _StridedShard)
        else ("shard", p.dim, 1)
        for p in placements
    )
    order = _shard_order(_NoSpec(), kinds, tuple(mesh_shape), "test")
    return DTensorLayout(tuple(shape), "int64", tuple(mesh_shape), tuple(coordinate), kinds, order)


class _NoSpec:
    def get(self, key, default=None):
        return default


def _random_case(rng: random.Random):
    shape = [rng.randint(0, 9) for _ in range(rng.randint(1, 3))]
    mesh_shape = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
    placements = []
    for _ in mesh_shape:
        roll, dim = rng.random(), rng.randrange(len(shape))
        placements.append(
            Replicate()
            if roll < 0.2
            else Shard(dim)
            if roll < 0.5
            else _StridedShard(dim, split_factor=rng.randint(2, 4))
        )
    return shape, mesh_shape, placements


def _apply(extents, local: torch.Tensor, out: torch.Tensor) -> None:
    flat_out, src = out.view(-1), local.reshape(-1)
    for e in extents:
        for run in range(e.runs):
            d, s = e.dst_offset + run * e.dst_stride, e.src_offset + run * e.src_stride
            flat_out[d : d + e.count] = src[s : s + e.count]


@pytest.mark.slow
def test_left_to_right_pieces_match_torch_for_random_placements():
    rng = random.Random(0)
    for _ in range(600):
        shape, mesh_shape, placements = _random_case(rng)
        full = torch.arange(prod(shape)).reshape(shape)
        merged = torch.full(shape, -1, dtype=torch.int64)
        extents, sources = [], []
        for coordinate in product(*(range(n) for n in mesh_shape)):
            layout = _ours(placements, mesh_shape, coordinate, shape)
            local = _torch_local(full, placements, mesh_shape, coordinate).contiguous()
            assert layout.local_shape(LEFT_TO_RIGHT) == tuple(local.shape), (shape, mesh_shape, placements, coordinate)
            torch_shape, torch_offset = _compute_local_shape_and_global_offset(
                shape, mesh_shape, list(coordinate), placements
            )
            assert layout.local_shape(LEFT_TO_RIGHT) == tuple(torch_shape)
            boxes = layout.local_boxes(LEFT_TO_RIGHT)
            if local.numel():  # DCP records the first element's place: where our first box starts
                assert boxes[0].offsets == tuple(torch_offset), (shape, mesh_shape, placements, coordinate)
            if not layout.is_primary_replica():
                continue
            piece = []
            for box in boxes:
                piece += box_extents(
                    len(sources), 0, shape, box.offsets, box.sizes, tuple(local.shape), box.local_offsets
                )
            _apply(piece, local, merged)
            extents += piece
            sources.append(SourceBuffer("local", 0, local.numel() * 8, "int64"))
        check_extents("t", tuple(shape), "int64", extents, sources)  # every element exactly once
        assert torch.equal(merged, full), (shape, mesh_shape, placements)


def test_strided_shard_of_fsdp2_over_tp_keeps_row_blocks_in_order():
    # torch's own example: 9 rows, _StridedShard(0, split_factor=2) over 4 ranks
    assert [strided_pick(((0, 9),), 2, 4, r) for r in range(4)] == [
        ((0, 2), (5, 1)),
        ((2, 2), (6, 1)),
        ((4, 1), (7, 1)),
        ((8, 1),),
    ]
    # contiguous row-blocks merge into one range
    assert strided_pick(((0, 8),), 1, 2, 1) == ((4, 4),)


class _MeshSizes:
    """What torch's split-factor decoding asks of a mesh: its dimension sizes."""

    def __init__(self, shape):
        self.shape = shape

    def size(self, mesh_dim: int) -> int:
        return self.shape[mesh_dim]


def test_split_factors_decode_to_torchs_shard_order():
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    rng = random.Random(1)
    for _ in range(2000):
        shape, mesh_shape, placements = _random_case(rng)
        theirs = DTensorSpec._maybe_convert_StridedShard_to_shard_order(tuple(placements), _MeshSizes(mesh_shape))
        ours = _ours(placements, mesh_shape, [0] * len(mesh_shape), shape).shard_order
        if not any(isinstance(p, _StridedShard) for p in placements):
            continue
        assert ours == (None if theirs is None else tuple((e.tensor_dim, tuple(e.mesh_dims)) for e in theirs)), (
            placements
        )


def test_shard_order_reading_nests_torch_chunks_in_the_decoded_order():
    # FSDP2 over tp: rows chunked over tp first, then each tp piece over dp (13 rows, dp 3, tp 2)
    placements = [_StridedShard(0, split_factor=2), Shard(0)]
    rows = torch.arange(13)
    for dp, tp in product(range(3), range(2)):
        layout = _ours(placements, (3, 2), (dp, tp), (13,))
        expected = rows.chunk(2)[tp].chunk(3)[dp] if dp < len(rows.chunk(2)[tp].chunk(3)) else rows[:0]
        (runs,) = layout.local_runs(SHARD_ORDER)
        got = [i for start, length in runs for i in range(start, start + length)]
        assert got == expected.tolist()
    # here the left-to-right reading gives coordinate (2, 0) two rows where FSDP2 holds one
    assert _ours(placements, (3, 2), (2, 0), (13,)).local_shape(LEFT_TO_RIGHT) == (2,)
    layouts = [_ours(placements, (3, 2), c, (13,)) for c in product(range(3), range(2))]
    assert choose_reading(layouts, [lay.local_shape(SHARD_ORDER) for lay in layouts], ["f"] * 6) == SHARD_ORDER
    assert choose_reading(layouts, [lay.local_shape(LEFT_TO_RIGHT) for lay in layouts], ["f"] * 6) == LEFT_TO_RIGHT


def test_two_readings_that_fit_the_shapes_but_place_pieces_differently_are_refused():
    placements = [_StridedShard(0, split_factor=6), Shard(0), Shard(0)]
    layouts = [_ours(placements, (2, 2, 3), c, (15,)) for c in product(range(2), range(2), range(3))]
    shapes = [lay.local_shape(SHARD_ORDER) for lay in layouts]
    assert shapes == [lay.local_shape(LEFT_TO_RIGHT) for lay in layouts]
    with pytest.raises(BadInput, match="cannot be told"):
        choose_reading(layouts, shapes, [f"rank {i}" for i in range(12)])


def test_no_reading_that_fits_is_refused_naming_the_shape():
    layouts = [
        _ours([_StridedShard(0, split_factor=2), Shard(0)], (2, 2), c, (8, 3)) for c in product(range(2), range(2))
    ]
    with pytest.raises(BadInput, match=r"rank 3: local shape \(1, 3\) but .* gives \(2, 3\) at coordinate \(1, 1\)"):
        choose_reading(layouts, [(2, 3), (2, 3), (2, 3), (1, 3)], [f"rank {i}" for i in range(4)])
