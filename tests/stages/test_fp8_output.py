"""--dtype fp8 on the corpus: every layout's merge, bit for bit the anchor's quantization of the unsharded model.

The reference is transformers' own fine-grained FP8 quantizer (Fp8Quantize._quantize_one) run on each
weight of the unsharded model cast to bfloat16 (what the two-pass way quantizes: merge to bf16, then
quantize the folder), zero-padded to whole 128x128 blocks (the anchor passes partial-block shapes
through unquantized; zeros change no amax) and cropped back. Everything left unquantized is the bf16
cast. The folder loads with from_pretrained on the CPU and its logits are close to the bf16 model's;
verify passes, and a flipped byte of a scale fails it.
"""

from __future__ import annotations

import json

import pytest
import torch
from corpus import specs_read_by
from fp8_anchor import assert_fp8_is_the_anchors
from helpers import load_reference, read_merged, transformers_logits

import fsdpfast
from fsdpfast import _ops

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch_ops,
    pytest.mark.skipif(not _ops.torch_ops(), reason=f"fsdpfast torch ops not built: {_ops.torch_ops_error()}"),
]
finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")

# One corpus checkpoint per reader, plus a tied and a bf16 one.
NAMES = sorted({specs_read_by(reader)[0] for reader in ("fsdp-ranks", "guide-ranks", "dcp", "dcp-hf")}) + [
    "w2-tied-bf16",
    "w3-bert-dim1",
]


@pytest.mark.parametrize("name", NAMES)
def test_fp8_merge_is_the_anchors_quantization(checkpoints, tmp_path, name):
    spec, folder = checkpoints.get(name)
    reference, tied = load_reference(spec.reference_path(checkpoints.root))
    out = tmp_path / "fp8"
    fsdpfast.merge(folder, out, dtype="fp8")
    assert_fp8_is_the_anchors(read_merged(out), reference, tied)
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    assert (q["quant_method"], q["fmt"], q["activation_scheme"], q["weight_block_size"]) == (
        "fp8",
        "e4m3",
        "dynamic",
        [128, 128],
    )
    assert "lm_head" in q["modules_to_not_convert"] or spec.model != "llama"
    assert fsdpfast.verify(out).ok
    assert fsdpfast.verify(out, against=folder).ok


def test_fp8_folder_loads_with_logits_close_to_bf16(checkpoints, tmp_path):
    spec, folder = checkpoints.get("w2-llama")
    fsdpfast.merge(folder, tmp_path / "fp8", dtype="fp8")
    fsdpfast.merge(folder, tmp_path / "bf16", dtype="bf16")
    fp8 = transformers_logits(str(tmp_path / "fp8"), spec.model, "float32")
    bf16 = transformers_logits(str(tmp_path / "bf16"), spec.model, "float32")
    # e4m3 keeps 3 mantissa bits (relative error up to 2^-4 per weight); on the tiny model the logits
    # stay within a few hundredths of their spread.
    assert torch.allclose(fp8, bf16, atol=0.05 * bf16.abs().max().item()), (fp8 - bf16).abs().max()


def test_flipped_scale_byte_fails_verify(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    out = tmp_path / "fp8"
    fsdpfast.merge(folder, out, dtype="fp8")
    merged = read_merged(out)
    scale = next(n for n in merged if n.endswith("_scale_inv"))
    path = next(out.glob("*.safetensors"))
    raw = bytearray(path.read_bytes())
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    start = 8 + int.from_bytes(raw[:8], "little") + header[scale]["data_offsets"][0]
    raw[start] ^= 0x01
    path.write_bytes(bytes(raw))
    assert not fsdpfast.verify(out).ok


def test_fp8_skip_leaves_named_weights_in_bf16(checkpoints, tmp_path):
    spec, folder = checkpoints.get("w2-llama")
    out = tmp_path / "fp8"
    fsdpfast.merge(folder, out, dtype="fp8", fp8_skip="*.mlp.*")
    merged = read_merged(out)
    assert all(merged[n].dtype == torch.bfloat16 for n in merged if ".mlp." in n)
    assert any(merged[n].dtype == torch.float8_e4m3fn for n in merged if ".self_attn." in n)
    modules = json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.mlp.down_proj" in modules


def test_command_line_fp8_block_with_skip(checkpoints, tmp_path):
    """The CLI (its model check runs beside the reading, then checks the unquantized names) and verify --against."""
    import subprocess
    import sys

    _, folder = checkpoints.get("w2-llama")
    out = tmp_path / "fp8"
    merge = [sys.executable, "-m", "fsdpfast", "merge", str(folder), "--out", str(out), "--dtype", "fp8-block"]
    done = subprocess.run([*merge, "--fp8-skip", "*.down_proj.*"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.down_proj" in config["modules_to_not_convert"]
    verify = [sys.executable, "-m", "fsdpfast", "verify", str(out), "--against", str(folder)]
    done = subprocess.run(verify, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    refused = subprocess.run(
        [*merge[:-2], "--fp8-skip", "x", "--out", str(tmp_path / "no")], capture_output=True, text=True
    )
    assert refused.returncode != 0 and "--fp8-skip applies to --dtype fp8 only" in refused.stderr
