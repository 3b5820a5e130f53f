"""--dtype fp8 on the MoE and vision-language families: experts quantized one by one, routers and vision towers not.

The anchor is the unsharded model's own save_pretrained folder, each weight cast to bfloat16 and, where
--dtype fp8 quantizes it, run through transformers' Fp8Quantize (tests/stages/test_fp8_output.py says why
zero-padded to whole blocks); what it leaves is the --dtype bf16 merge (which keeps what transformers keeps
in float32 when it casts). The folder loads with from_pretrained (on the CPU transformers dequantizes
it to bf16) with no missing or unexpected key.
"""

from __future__ import annotations

import json

import pytest
import torch
from fp8_anchor import anchor
from helpers import read_merged

import fsdpfast
from fsdpfast import _ops
from fsdpfast._testing.family_writer import DEEPSEEK_V3, QWEN2_5_VL, FamilySpec, write_family_checkpoints
from fsdpfast.fp8.select import quantized

pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.torch_ops,
    pytest.mark.skipif(not _ops.torch_ops(), reason=f"fsdpfast torch ops not built: {_ops.torch_ops_error()}"),
]
finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")

SPECS = [
    FamilySpec("qwen3_moe", "qwen3_moe", dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2), seed=1),
    FamilySpec("deepseek_v3", "deepseek_v3", DEEPSEEK_V3, seed=3),
    FamilySpec("qwen2_5_vl", "qwen2_5_vl", QWEN2_5_VL, seed=6, auto_class="AutoModelForImageTextToText"),
]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-families")
    write_family_checkpoints(str(root), SPECS, 2)
    return root


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_fp8_family_is_the_anchors_quantization(families, tmp_path, spec):
    out = tmp_path / "fp8"
    fsdpfast.merge(spec.ranks_folder(str(families)), out, dtype="fp8")
    merged = read_merged(out)
    reference = read_merged(spec.anchor_folder(str(families)))
    fsdpfast.merge(spec.ranks_folder(str(families)), tmp_path / "bf16", dtype="bf16")
    cast = read_merged(tmp_path / "bf16")  # bf16, but what transformers keeps in float32 (families.keep_fp32)
    chosen = [n for n, t in reference.items() if quantized(n, tuple(t.shape), "float32")]
    assert chosen
    for name, want in reference.items():
        bf16 = want.to(cast[name].dtype)
        assert torch.equal(cast[name], bf16), name
        if name in chosen:
            q, s = anchor(bf16)
            assert torch.equal(merged[name].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(merged[f"{name}_scale_inv"], s), name
        else:
            assert merged[name].dtype == bf16.dtype and torch.equal(merged[name], bf16), name
    assert sorted(merged) == sorted([*reference, *(f"{n}_scale_inv" for n in chosen)])
    if spec.name != "qwen2_5_vl":  # per-expert weights quantized per expert, the router not
        assert any(".experts.1." in n for n in chosen) and not any(n.endswith("mlp.gate.weight") for n in chosen)
    else:
        assert not any("visual" in n for n in chosen) and any("visual" in n for n in reference)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert fsdpfast.verify(out).ok
    assert fsdpfast.verify(out, against=spec.ranks_folder(str(families))).ok  # DeepSeek's float32 gates too
    import transformers

    _, info = getattr(transformers, spec.auto_class).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
