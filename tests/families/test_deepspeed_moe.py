"""Native DeepSpeed MoE checkpoints (readers.deepspeed_moe) merged to the Hub layout.

Fixtures (tests/data/deepspeed_moe/, by tests/fixtures/make_deepspeed_moe.py): tiny Qwen3-MoE and Mixtral
models whose MoE blocks are deepspeed.moe.layer.MoE (experts with gate_proj/up_proj/down_proj, or
w1/w3/w2), wrapped by real DeepSpeed 0.19.8 on gloo CPU ranks (ZeRO 1 and 2; 2 expert-parallel ranks,
or one, the experts then partitioned over both ranks) and saved by `engine.save_checkpoint`
(per-expert files under global expert ids); no config.json beside them. The anchor is the unsharded
transformers model's save_pretrained: each merge (with --config) must equal it bit for bit, load with
from_pretrained with no missing or unexpected keys and compute the model's logits.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from helpers import assert_folder_is_anchor, read_merged
from refusals import api_refuses, cli_refuses

import fsdpfast

pytestmark = [pytest.mark.slow]

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "deepspeed_moe")
FIXTURES = ["qwen3_moe_zero1_ep2", "qwen3_moe_zero2_ep1", "mixtral_zero2_ep2"]


def anchor(name: str) -> str:
    return os.path.join(DATA, name, "save_pretrained")


def checkpoint(name: str) -> str:
    return os.path.join(DATA, name, "checkpoint")


def assert_is_anchor(out, name: str) -> None:
    merged, want = read_merged(out), read_merged(anchor(name))
    assert sorted(merged) == sorted(want)
    for key, value in want.items():
        assert merged[key].dtype == value.dtype and torch.equal(merged[key], value), key


@pytest.mark.parametrize("name", FIXTURES)
def test_native_moe_merged_as_save_pretrained_writes_it(tmp_path, name):
    report = fsdpfast.merge(checkpoint(name), tmp_path / "out", config=anchor(name))
    assert_folder_is_anchor(tmp_path / "out", anchor(name))
    assert any("deepspeed.moe" in note for note in report.notes), report.notes
    assert fsdpfast.verify(tmp_path / "out", against=checkpoint(name)).ok


def test_mixtral_experts_are_written_under_block_sparse_moe(tmp_path):
    fsdpfast.merge(checkpoint("mixtral_zero2_ep2"), tmp_path / "out", config=anchor("mixtral_zero2_ep2"))
    merged = read_merged(tmp_path / "out")
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in merged
    assert "model.layers.1.block_sparse_moe.gate.weight" in merged


def test_without_a_config_the_merge_is_refused_naming_config(tmp_path):
    line = cli_refuses(checkpoint(FIXTURES[0]), tmp_path / "out", mentions=["--config", "deepspeed_moe"])
    assert "layer_0_expert_0_mp_rank_00_model_states.pt" in line


def test_a_config_beside_the_checkpoint_is_taken(tmp_path):
    src = shutil.copytree(checkpoint(FIXTURES[0]), tmp_path / "ckpt")
    shutil.copy(os.path.join(anchor(FIXTURES[0]), "config.json"), src / "config.json")
    fsdpfast.merge(src, tmp_path / "out")
    assert_is_anchor(tmp_path / "out", FIXTURES[0])


def test_packed_on_request(tmp_path):
    name = FIXTURES[0]
    fsdpfast.merge(checkpoint(name), tmp_path / "out", config=anchor(name), expert_layout="packed")
    merged, want = read_merged(tmp_path / "out"), read_merged(anchor(name))
    assert merged["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    for e in range(4):  # experts 2 and 3 were rank 1's local experts 0 and 1
        assert torch.equal(
            merged["model.layers.0.mlp.experts.gate_up_proj"][e, 16:],
            want[f"model.layers.0.mlp.experts.{e}.up_proj.weight"],
        )
        assert torch.equal(
            merged["model.layers.0.mlp.experts.down_proj"][e], want[f"model.layers.0.mlp.experts.{e}.down_proj.weight"]
        )


def test_a_missing_expert_file_is_refused(tmp_path):
    src = shutil.copytree(checkpoint(FIXTURES[0]), tmp_path / "ckpt")
    os.remove(src / "global_step0" / "layer_1_expert_2_mp_rank_00_model_states.pt")
    api_refuses(
        src,
        tmp_path / "out",
        mentions=["layer_1_expert_2_mp_rank_00_model_states.pt", "is missing"],
        config=anchor(FIXTURES[0]),
    )


def test_a_config_of_another_family_is_refused(tmp_path):
    api_refuses(checkpoint(FIXTURES[0]), tmp_path / "out", mentions=["MixtralForCausalLM"], config=anchor(FIXTURES[2]))


def test_a_config_of_a_family_without_such_experts_is_refused(tmp_path):
    import json

    config = tmp_path / "config"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    api_refuses(checkpoint(FIXTURES[0]), tmp_path / "out", mentions=["'llama'", "qwen3_moe"], config=config)


def test_expert_counts_that_disagree_with_config_are_refused(tmp_path):
    import json

    config = tmp_path / "config"
    shutil.copytree(anchor(FIXTURES[0]), config)
    values = json.loads((config / "config.json").read_text())
    values["num_local_experts"] = 6  # transformers 5 saves num_experts under this name
    (config / "config.json").write_text(json.dumps(values))
    api_refuses(checkpoint(FIXTURES[0]), tmp_path / "out", mentions=["experts"], config=config)


def test_expert_counts_that_do_not_divide_over_the_ranks_are_refused(tmp_path):
    # the model states count 3 experts per layer (and its files agree), the 2 expert-parallel ranks hold 2 each
    src = shutil.copytree(checkpoint(FIXTURES[0]), tmp_path / "ckpt")
    for layer in (0, 1):
        os.remove(src / "global_step0" / f"layer_{layer}_expert_3_mp_rank_00_model_states.pt")
    path = src / "global_step0" / "mp_rank_00_model_states.pt"
    states = torch.load(path, weights_only=False)
    states["num_experts"] = [3, 3]
    torch.save(states, path)
    api_refuses(
        src,
        tmp_path / "out",
        mentions=["on each of 2 expert-parallel ranks", "num_experts counts 3"],
        config=anchor(FIXTURES[0]),
    )
