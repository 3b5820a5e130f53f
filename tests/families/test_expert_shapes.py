"""Packed expert tensors whose shapes cannot be what the family packs are refused in one line, before any
byte moves (families.hub_experts): rows that do not split into gate and up, tensors without an expert axis."""

from __future__ import annotations

import pytest

from fsdpfast.errors import BadInput
from fsdpfast.families.hub_experts import PER_EXPERT, hub_parts, transpose_experts
from fsdpfast.plan.model import Extent, TensorPlan

NAME = "model.layers.0.mlp.experts.gate_up_proj"


def packed(shape) -> TensorPlan:
    numel = 1
    for n in shape:
        numel *= n
    return TensorPlan(NAME, tuple(shape), "float32", "float32", (Extent(0, 0, numel, 0),))


def test_rows_that_do_not_split_into_gate_and_up_are_refused():
    with pytest.raises(BadInput, match="31 rows do not split in two"):
        hub_parts(NAME, (4, 31, 8), PER_EXPERT["qwen3_moe"])


@pytest.mark.parametrize("shape", [(31, 8), (2, 4, 31, 8)])
def test_packed_experts_without_three_dimensions_are_refused(shape):
    with pytest.raises(BadInput, match="packed experts have 3 dimensions"):
        hub_parts(NAME, shape, PER_EXPERT["mixtral"])
    with pytest.raises(BadInput, match="packed experts have 3 dimensions"):
        transpose_experts((packed(shape),), lambda name: name)


def test_each_expert_is_a_block_of_rows():
    parts = hub_parts(NAME, (3, 16, 8), PER_EXPERT["mixtral"])
    assert [(name.rsplit("experts.", 1)[1], window.offsets) for name, _, window in parts[:2]] == [
        ("0.w1.weight", (0, 0, 0)),
        ("0.w3.weight", (0, 8, 0)),
    ]
    assert parts[0][0].startswith("model.layers.0.block_sparse_moe.") and len(parts) == 6
