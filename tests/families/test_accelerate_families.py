"""MoE families prepared by accelerate (FSDP2 on gloo ranks, 2 and 3) and saved by its own code, merged to
the Hub layout: `save_fsdp_model(..., use_dcp=False)` rank files (accelerate-ranks) and
`Accelerator.save_state` (its DCP folder), each bit for bit the unsharded model's save_pretrained."""

from __future__ import annotations

import os

import pytest
import torch
from framework_checkpoints import needs_accelerate
from helpers import read_merged

import fsdpfast
from fsdpfast._testing.family_writer import FamilySpec, write_family_accelerate_saves

pytestmark = [pytest.mark.slow, pytest.mark.distributed, needs_accelerate]

SPECS = {
    2: [FamilySpec("mixtral", "mixtral", dict(num_local_experts=4, num_experts_per_tok=2), seed=31)],
    # 5 experts over 3 ranks: FSDP2 cuts the packed tensors between experts unevenly
    3: [
        FamilySpec(
            "qwen3_moe-w3", "qwen3_moe", dict(moe_intermediate_size=16, num_experts=5, num_experts_per_tok=2), seed=32
        )
    ],
}
CASES = [(world, spec, kind) for world, specs in SPECS.items() for spec in specs for kind in ("ranks", "state")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("accelerate-families")
    for world, specs in SPECS.items():
        write_family_accelerate_saves(str(root / f"w{world}"), specs, world)
    return root


@pytest.mark.parametrize("world,spec,kind", CASES, ids=[f"w{w}-{s.name}-{k}" for w, s, k in CASES])
def test_accelerate_saves_merge_to_save_pretrained(saved, tmp_path, world, spec, kind):
    root = str(saved / f"w{world}")
    report = fsdpfast.merge(os.path.join(spec.folder(root), f"accelerate-{kind}"), tmp_path / "out")
    assert report.world_size == world
    merged, want = read_merged(tmp_path / "out"), read_merged(spec.anchor_folder(root))
    assert sorted(merged) == sorted(want)
    for name, value in want.items():
        assert merged[name].dtype == value.dtype and torch.equal(merged[name], value), name
