"""`fsdpfast.save_pretrained` from live FSDP1 models (FullyShardedDataParallel) on real gloo ranks.

Each rank writes the runs of FSDP1's flat shard that are its, with no collective. The folder must
hold, bit for bit, FSDP1's own FULL_STATE_DICT (gathered in the writing processes), load with
transformers, and its safetensors files must be byte for byte those an offline merge of the same
model's LOCAL_STATE_DICT rank files writes; 2 and 3 ranks split the flat parameters unevenly
(and parameters across ranks); FULL_SHARD, SHARD_GRAD_OP, NO_SHARD (also FSDP1's choice on 1 rank)
and HYBRID_SHARD (4 ranks, two replica groups); a rank whose writes fail publishes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import (
    assert_an_offline_merges_files,
    assert_holds_tied_once,
    assert_loads_as_written,
    assert_nothing_published,
    live_outcomes,
    read_merged,
)
from safetensors.torch import load_file

from fsdpfast._testing.live_fsdp1_examples import LiveFsdp1Spec, save_live_fsdp1

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SPECS = {
    1: [LiveFsdp1Spec("w1-no-shard", seed=47)],  # one rank: FSDP1 switches to NO_SHARD
    2: [
        LiveFsdp1Spec("w2-orig-fp32", seed=41),
        LiveFsdp1Spec("w2-flat-tied-bf16", model="llama-tied", dtype="bfloat16", use_orig_params=False, seed=42),
        LiveFsdp1Spec(
            "w2-orig-wrapped-to-bf16", checkpoint_wrappers=True, save_dtype="bf16", max_shard_size="40KB", seed=43
        ),
        LiveFsdp1Spec("w2-no-shard", use_orig_params=False, strategy="NO_SHARD", seed=49),  # rank 0 writes
        LiveFsdp1Spec("w2-shard-grad-op", strategy="SHARD_GRAD_OP", seed=50),
        # saved mid-step (a forward, no backward) under MixedPrecision(param_dtype=bf16): the fp32 shards written
        LiveFsdp1Spec("w2-shard-grad-op-bf16-compute", strategy="SHARD_GRAD_OP", compute_in_bf16=True, seed=51),
        LiveFsdp1Spec("w2-fails", fail_rank=1, seed=44),
    ],
    3: [
        LiveFsdp1Spec("w3-orig-tied-bf16-to-fp32", model="llama-tied", dtype="bfloat16", save_dtype="fp32", seed=45),
        LiveFsdp1Spec("w3-flat-fp32", use_orig_params=False, max_shard_size="40KB", seed=46),
    ],
    4: [
        LiveFsdp1Spec("w4-hybrid-tied", model="llama-tied", strategy="HYBRID_SHARD", seed=48)
    ],  # HYBRID_SHARD: replica 0 writes
}
ALL = {spec.name: (world, spec) for world, specs in SPECS.items() for spec in specs}
SAVED = [name for name, (_, spec) in ALL.items() if spec.fail_rank is None]
# NO_SHARD's LOCAL_STATE_DICT holds a plain flat tensor, not the ShardedTensor the offline reader reads;
# FSDP1 on a device mesh (HYBRID_SHARD here) has no LOCAL_STATE_DICT
MERGED = [name for name in SAVED if ALL[name][0] > 1 and ALL[name][1].strategy not in ("NO_SHARD", "HYBRID_SHARD")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("live-fsdp1")
    for world, specs in SPECS.items():
        save_live_fsdp1(str(root), specs, world)
    return root


@pytest.mark.parametrize("name", SAVED)
def test_the_folder_is_fsdp1s_full_state_dict(saved, name):
    world, spec = ALL[name]
    folder = saved / name
    assert all(o["ok"] for o in live_outcomes(folder, world)), live_outcomes(folder, world)
    live, reference = read_merged(folder / "live"), load_file(folder / "reference.safetensors")
    tied = live_outcomes(folder, world)[0]["tied"]  # written once, as the offline merge writes it
    assert bool(tied) == (spec.model == "llama-tied"), tied
    assert_holds_tied_once(live, reference, tied, spec.save_dtype)


@pytest.mark.parametrize("name", SAVED)
def test_the_names_come_in_the_state_dicts_order(saved, name):
    world, _ = ALL[name]
    folder = saved / name
    order = json.loads((folder / "reference-order.json").read_text())
    for outcome in live_outcomes(folder, world):
        assert outcome["walked"] == order


@pytest.mark.parametrize("name", MERGED)
def test_the_files_are_an_offline_merges_byte_for_byte(saved, name, tmp_path):
    _, spec = ALL[name]
    assert_an_offline_merges_files(saved / name, spec, tmp_path / "merged")


@pytest.mark.parametrize("name", SAVED)
def test_the_folder_loads_and_verifies(saved, name):
    world, _ = ALL[name]
    folder = saved / name / "live"
    assert_loads_as_written(folder)
    assert json.loads((folder / "fsdpfast-manifest.json").read_text())["world_size"] == world


def test_a_rank_whose_writes_fail_publishes_nothing(saved):
    world, spec = ALL["w2-fails"]
    assert_nothing_published(saved / "w2-fails", world, spec.fail_rank)
