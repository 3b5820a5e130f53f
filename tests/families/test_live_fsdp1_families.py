"""MoE families held by FSDP1 (FullyShardedDataParallel, use_orig_params True
and False, device_id=cpu on gloo ranks, 2 and 3 of them): the Hub layout, bit for bit what transformers'
save_pretrained of the unsharded model writes (Mixtral's block_sparse_moe w1/w3/w2, DeepSeek-V3's
per-expert names), and, cast to bf16, what from_pretrained(dtype=bf16) + save_pretrained writes (the
float32-kept router bias of DeepSeek-V3 kept). Each rank cuts its experts out of its own run of FSDP1's
flat shard. The same sharded models' FSDP1 LOCAL_STATE_DICT rank files, merged offline (fsdp1-flat), are
save_pretrained's files too. (FSDP2 on 2 and 3 ranks: tests/families/test_hub_layout.py.)"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import read_merged

import fsdpfast
from fsdpfast._testing.family_writer import DEEPSEEK_V3, FamilySpec, Fsdp1FamilySpec, write_family_fsdp1_saves

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2)
QWEN3_MOE = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
SPECS = {
    2: [
        Fsdp1FamilySpec(FamilySpec("mixtral-orig", "mixtral", MIXTRAL, seed=11), use_orig_params=True),
        Fsdp1FamilySpec(FamilySpec("mixtral-flat", "mixtral", MIXTRAL, seed=12), use_orig_params=False),
        Fsdp1FamilySpec(
            FamilySpec("deepseek_v3-flat", "deepseek_v3", {**DEEPSEEK_V3, "num_key_value_heads": 4}, seed=13),
            use_orig_params=False,
        ),
    ],
    3: [Fsdp1FamilySpec(FamilySpec("qwen3_moe-orig-w3", "qwen3_moe", QWEN3_MOE, seed=14), use_orig_params=True)],
}
CASES = [(world, spec) for world, specs in SPECS.items() for spec in specs]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("live-fsdp1-families")
    for world, specs in SPECS.items():
        write_family_fsdp1_saves(str(root / f"w{world}"), specs, world)
    return root


def same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


@pytest.mark.parametrize("world,spec", CASES, ids=[f"w{w}-{s.name}" for w, s in CASES])
def test_live_fsdp1_save_is_save_pretrained(saved, world, spec):
    import transformers

    root = str(saved / f"w{world}")
    family = spec.family
    same(read_merged(family.live_folder(root)), read_merged(family.anchor_folder(root)))
    model, info = transformers.AutoModelForCausalLM.from_pretrained(family.live_folder(root), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


@pytest.mark.parametrize("world,spec", CASES, ids=[f"w{w}-{s.name}" for w, s in CASES])
def test_live_fsdp1_bf16_save_is_a_bf16_save_pretrained(saved, tmp_path, world, spec):
    import transformers

    root = str(saved / f"w{world}")
    family = spec.family
    cast = transformers.AutoModelForCausalLM.from_pretrained(family.anchor_folder(root), dtype=torch.bfloat16)
    cast.save_pretrained(tmp_path / "anchor")
    want = read_merged(tmp_path / "anchor")
    same(read_merged(family.live_folder(root) + "-bf16"), want)
    if family.model_type == "deepseek_v3":
        assert want["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


@pytest.mark.parametrize("world,spec", CASES, ids=[f"w{w}-{s.name}" for w, s in CASES])
def test_fsdp1_rank_files_merge_to_save_pretrained(saved, tmp_path, world, spec):
    root = str(saved / f"w{world}")
    src = os.path.join(spec.family.folder(root), "fsdp1")
    report = fsdpfast.merge(src, tmp_path / "out")
    assert report.layout == "fsdp1-flat" and report.world_size == world
    same(read_merged(tmp_path / "out"), read_merged(spec.family.anchor_folder(root)))
