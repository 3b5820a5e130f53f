"""Checkpoints saved with megatron-core's TransformerEngine spec merge exactly as their local-spec twins.

tp2_ep2_qwen3_moe_dense0_te_spec and tp2_ep2_deepseek_v3_te_spec were written by megatron-core 0.16.1 at TP2/EP2
with its own TE spec functions (get_gpt_decoder_block_spec(use_transformer_engine=True); te_spec in
tests/fixtures/make_megatron_checkpoints.py). TransformerEngine needs CUDA and is not installed: its modules are a
stand-in holding TE's parameters (layer_norm_weight, weight, weight{i}), while the saved names and sharding are
megatron-core's TE wrappers' own (TELayerNormColumnParallelLinear, TENorm, TE*GroupedLinear ...). Their values are
those of tp2_ep2_qwen3_moe_dense0 and tp2_ep2_deepseek_v3 (the local spec, SequentialMLP), parameter for parameter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import assert_bit_exact, read_merged
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

import fsdpfast

pytestmark = pytest.mark.slow  # merges two fixtures

DATA = Path(__file__).parents[1] / "data" / "megatron"
TWINS = ["tp2_ep2_qwen3_moe_dense0", "tp2_ep2_deepseek_v3"]  # layer 0 dense, the others MoE, in both
# what the two specs save under different names (layer 0 dense, layer 1 MoE); the rest is named alike
TE_ONLY = {
    "tp2_ep2_qwen3_moe_dense0": ["decoder.layers.1.pre_mlp_layernorm.weight"],
    "tp2_ep2_deepseek_v3": [
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",  # the dense layer's; the MoE layer's is TENorm in both
        "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight",
        "decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight",
    ],
}
LOCAL_ONLY = {  # the local spec saves its standalone norms under TE's fused names where it has a keys map (not MLA)
    "tp2_ep2_qwen3_moe_dense0": ["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"],
    "tp2_ep2_deepseek_v3": [
        "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.self_attention.q_layernorm.weight",
        "decoder.layers.0.self_attention.kv_layernorm.weight",
    ],
}


def _saved_names(name: str) -> set[str]:
    metadata = FileSystemReader(str(DATA / name / "run" / "iter_0000007")).read_metadata()
    return {key for key in metadata.state_dict_metadata if "_extra_state" not in key}


@pytest.mark.parametrize("twin", TWINS)
def test_the_te_spec_checkpoint_names_its_norms_as_transformer_engine_does(twin):
    te, local = _saved_names(f"{twin}_te_spec"), _saved_names(twin)
    assert set(TE_ONLY[twin]) <= te - local, sorted(te - local)
    assert set(LOCAL_ONLY[twin]) <= local - te, sorted(local - te)
    assert "decoder.layers.1.mlp.experts.experts.linear_fc1.weight" in te & local  # one global (expert, ...) tensor


@pytest.mark.parametrize("twin", TWINS)
def test_the_te_spec_checkpoint_merges_bit_exact_as_its_local_spec_twin(tmp_path, twin):
    merged = {}
    for name in (f"{twin}_te_spec", twin):
        fsdpfast.merge(DATA / name / "run", tmp_path / name, config=DATA / name / "hf")
        merged[name] = read_merged(str(tmp_path / name))
    assert_bit_exact(merged[f"{twin}_te_spec"], merged[twin])
    assert_bit_exact(merged[twin], load_file(str(DATA / twin / "reference.safetensors")))
