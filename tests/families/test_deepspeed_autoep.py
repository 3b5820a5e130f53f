"""DeepSpeed AutoEP checkpoints (readers.deepspeed_experts) merged to the Hub layout.

Fixtures (tests/data/deepspeed_autoep/, by tests/fixtures/make_deepspeed_autoep.py): tiny Qwen3-MoE,
Mixtral and DeepSeek-V3 (shared experts, a dense first layer, router correction biases set) models wrapped by real DeepSpeed 0.19.8 on gloo CPU ranks with AutoEP over 2 expert-parallel
ranks, ZeRO 1 and 2, saved by `engine.save_checkpoint` (per-expert files, each rank's experts in an
optimizer group of its own); the anchor is the unsharded model's save_pretrained. Each merge must
equal it bit for bit, load with from_pretrained with no missing or unexpected keys and compute the
model's logits.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from helpers import assert_folder_is_anchor, read_merged
from refusals import api_refuses

import fsdpfast

pytestmark = [pytest.mark.slow]

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "deepspeed_autoep")
FIXTURES = ["qwen3_moe_zero1_ep2", "qwen3_moe_zero2_ep2", "mixtral_zero1_ep2", "deepseek_v3_zero1_ep2"]


def anchor(name: str) -> str:
    return os.path.join(DATA, name, "save_pretrained")


def checkpoint(name: str) -> str:
    return os.path.join(DATA, name, "checkpoint")


@pytest.mark.parametrize("name", FIXTURES)
def test_autoep_merged_as_save_pretrained_writes_it(tmp_path, name):
    report = fsdpfast.merge(checkpoint(name), tmp_path / "out")
    assert_folder_is_anchor(tmp_path / "out", anchor(name))
    assert any("AutoEP" in note for note in report.notes), report.notes
    assert fsdpfast.verify(tmp_path / "out", against=checkpoint(name)).ok


def test_deepseek_v3_router_bias_kept_in_fp32_by_a_bf16_merge(tmp_path):
    """AutoEP keeps DeepSeek-V3's correction bias on its router; a bf16 merge writes it as
    from_pretrained(dtype=bf16) + save_pretrained does: under transformers' name, in float32."""
    import transformers

    name = "deepseek_v3_zero1_ep2"
    cast = transformers.AutoModelForCausalLM.from_pretrained(anchor(name), dtype=torch.bfloat16)
    cast.save_pretrained(tmp_path / "anchor")
    fsdpfast.merge(checkpoint(name), tmp_path / "out", dtype="bf16")
    merged, want = read_merged(tmp_path / "out"), read_merged(tmp_path / "anchor")
    assert sorted(merged) == sorted(want)
    for key, value in want.items():
        assert merged[key].dtype == value.dtype and torch.equal(merged[key], value), key
    bias = merged["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0


def test_autoep_packed_on_request(tmp_path):
    fsdpfast.merge(checkpoint(FIXTURES[0]), tmp_path / "out", expert_layout="packed")
    merged = read_merged(tmp_path / "out")
    assert merged["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    want = read_merged(anchor(FIXTURES[0]))
    assert torch.equal(
        merged["model.layers.0.mlp.experts.gate_up_proj"][1, 16:], want["model.layers.0.mlp.experts.1.up_proj.weight"]
    )


def copied(tmp_path, name: str):
    src = tmp_path / "ckpt"
    shutil.copytree(checkpoint(name), src)
    return src


def test_a_missing_expert_file_is_refused(tmp_path):
    src = copied(tmp_path, FIXTURES[0])
    os.remove(src / "global_step0" / "layer_1_expert_3_mp_rank_00_model_states.pt")
    api_refuses(src, tmp_path / "out", mentions=["layer_1_expert_3_mp_rank_00_model_states.pt", "is missing"])


def test_a_config_of_another_family_is_refused(tmp_path):
    src = copied(tmp_path, FIXTURES[0])
    shutil.copy(os.path.join(checkpoint("mixtral_zero1_ep2"), "config.json"), src / "config.json")
    api_refuses(src, tmp_path / "out", mentions=["MixtralForCausalLM"])


def test_expert_counts_that_disagree_with_config_are_refused(tmp_path):
    import json

    src = copied(tmp_path, FIXTURES[1])  # 6 experts over 2 ranks
    config = json.loads((src / "config.json").read_text())
    config["num_local_experts"] = 4  # transformers 5 saves num_experts under this name
    (src / "config.json").write_text(json.dumps(config))
    api_refuses(src, tmp_path / "out", mentions=["experts"])
