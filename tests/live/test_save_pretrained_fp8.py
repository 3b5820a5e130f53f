"""`fsdpfast.save_pretrained(model, out, dtype="fp8")` from live sharded models on real gloo ranks.

The 128x128 blocks straddle the ranks' pieces (FSDP2's rows or columns, FSDP1's flat runs, 3 ranks
cutting uneven pieces); the ranks agree on every block's amax (one all-reduce MAX) and quantize their
own elements. The folder must be, bit for bit, transformers' Fp8Quantize of the unsharded model's
weights (tests/support/fp8_anchor.py) with the rest in bf16, its files byte for byte the offline
`--dtype fp8` merge of the same model's rank files, per expert in the Hub layout of an MoE family;
it verifies and loads with from_pretrained.
"""

from __future__ import annotations

import json

import pytest
import torch
from fp8_anchor import anchor
from helpers import assert_same_weight_files, read_merged

import fsdpfast
from fsdpfast import _ops
from fsdpfast._testing.family_writer import DEEPSEEK_V3, FamilySpec
from fsdpfast._testing.live_fp8_examples import LiveFp8Spec, save_live_fp8
from fsdpfast.fp8.select import quantized

pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.torch_ops,
    pytest.mark.skipif(not _ops.torch_ops(), reason=f"fsdpfast torch ops not built: {_ops.torch_ops_error()}"),
]
pytest.importorskip("transformers.integrations.finegrained_fp8")

# 300 x 192 MLP weights: 3 x 2 blocks, partial at the bottom and right edges, cut by every rank count
SIZES = dict(hidden_size=192, intermediate_size=300, num_attention_heads=4, num_key_value_heads=2)
PACKED_SIZES = dict(hidden_size=256, moe_intermediate_size=128, num_experts_per_tok=2, head_dim=64)
SPECS = {
    2: [
        LiveFp8Spec("w2-fsdp2-rows", sizes=SIZES, seed=61),
        LiveFp8Spec("w2-fsdp2-columns", wrap="fsdp2-dim1", sizes=SIZES, seed=62),
        LiveFp8Spec(
            "w2-deepseek-experts",
            family=FamilySpec("deepseek_v3", "deepseek_v3", {**DEEPSEEK_V3, "num_key_value_heads": 4}, seed=63),
        ),
        # transformers' packed experts [E, 2I, H] and [E, H, I], quantized per expert (3 x 2 x 2 and 3 x 2 x 1 blocks)
        LiveFp8Spec(
            "w2-qwen3-moe-packed",
            expert_layout="packed",
            family=FamilySpec("qwen3_moe", "qwen3_moe", {**PACKED_SIZES, "num_experts": 3}, seed=67),
        ),
    ],
    3: [
        LiveFp8Spec("w3-fsdp2-uneven", sizes=SIZES, fp8_skip="*.o_proj.weight", seed=64),
        LiveFp8Spec("w3-fsdp1", wrap="fsdp1", sizes=SIZES, seed=65),
        LiveFp8Spec(
            "w3-qwen3-moe-fsdp1",
            wrap="fsdp1",
            family=FamilySpec(
                "qwen3_moe", "qwen3_moe", dict(moe_intermediate_size=16, num_experts=5, num_experts_per_tok=2), seed=66
            ),
        ),
    ],
}
ALL = {spec.name: (world, spec) for world, specs in SPECS.items() for spec in specs}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("live-fp8")
    for world, specs in SPECS.items():
        save_live_fp8(str(root), specs, world)
    return root


def skipped(spec: LiveFp8Spec, name: str) -> bool:
    return spec.fp8_skip is not None and name.endswith(".o_proj.weight")


@pytest.mark.parametrize("name", list(ALL))
def test_the_folder_is_the_anchors_quantization_of_the_unsharded_model(saved, name):
    _, spec = ALL[name]
    folder = saved / name
    live, reference = read_merged(folder / "live"), read_merged(folder / "anchor")
    packed = spec.expert_layout == "packed"
    chosen = [
        n for n, t in reference.items() if quantized(n, tuple(t.shape), "float32", (), packed) and not skipped(spec, n)
    ]
    assert chosen
    assert packed == any(reference[n].ndim == 3 for n in chosen)
    for key, want in reference.items():
        bf16 = want.to(torch.bfloat16)
        if key in chosen:
            q, s = anchor(bf16)
            assert torch.equal(live[key].view(torch.uint8), q.view(torch.uint8)), key
            assert torch.equal(live[f"{key}_scale_inv"], s), key
        else:  # bf16, but what transformers keeps in float32 (DeepSeek's gate bias, families.keep_fp32)
            kept = spec.family is not None and live[key].dtype == torch.float32 and ".gate." in key
            assert torch.equal(live[key], want if kept else bf16), key
    assert sorted(live) == sorted([*reference, *(f"{n}_scale_inv" for n in chosen)])
    if spec.family is not None:  # per-expert weights quantized per expert, the router not
        assert any(".experts." in n for n in chosen) and not any(n.endswith("mlp.gate.weight") for n in chosen)
    else:  # some block is cut between ranks
        assert any(t.shape[0] > 128 for n, t in reference.items() if n in chosen)
    config = json.loads((folder / "live" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [128, 128]
    assert ("model.layers.0.self_attn.o_proj" in config["modules_to_not_convert"]) == (spec.fp8_skip is not None)


@pytest.mark.parametrize("name", [n for n, (_, s) in ALL.items() if s.wrap != "fsdp1"])
def test_the_files_are_the_offline_fp8_merges_byte_for_byte(saved, name, tmp_path):
    _, spec = ALL[name]
    folder = saved / name
    merged = tmp_path / "merged"
    fsdpfast.merge(folder / "ckpt", merged, dtype="fp8", fp8_skip=spec.fp8_skip, expert_layout=spec.expert_layout)
    assert_same_weight_files(folder / "live", merged)


@pytest.mark.parametrize("name", ["w3-fsdp2-uneven", "w3-qwen3-moe-fsdp1"])
def test_the_folder_verifies_and_loads(saved, name):
    import transformers

    _, spec = ALL[name]
    folder = saved / name / "live"
    assert fsdpfast.verify(folder).ok
    cls = getattr(transformers, spec.family.auto_class if spec.family else "AutoModelForCausalLM")
    _, info = cls.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
