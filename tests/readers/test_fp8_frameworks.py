"""--dtype fp8 on the framework layouts the corpus does not cover: Megatron-Core torch_dist, DeepSpeed ZeRO and
accelerate's rank files, each merged to fp8 bit for bit the anchor's quantization of its unsharded model.

The anchor (tests/support/fp8_anchor.py) is transformers' own fine-grained FP8 quantizer on the bf16 cast of
each weight; the unsharded models are the ones the readers' own tests compare against (Megatron's live weights
gathered over TP/PP/EP, the DeepSpeed engine's fp32 masters, accelerate's model before sharding).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fp8_anchor import assert_fp8_is_the_anchors
from framework_checkpoints import needs_accelerate
from helpers import read_merged
from safetensors.torch import load_file

import fsdpfast
from fsdpfast import _ops

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch_ops,
    pytest.mark.skipif(not _ops.torch_ops(), reason=f"fsdpfast torch ops not built: {_ops.torch_ops_error()}"),
]
finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")

MEGATRON = Path(__file__).parents[1] / "data" / "megatron"


def _merged_fp8_is_the_anchors(folder, out: Path, reference: dict, tied=(), **options) -> None:
    fsdpfast.merge(folder, out, dtype="fp8", **options)
    assert_fp8_is_the_anchors(read_merged(out), reference, tied)
    assert fsdpfast.verify(out).ok
    assert fsdpfast.verify(out, against=folder).ok


# dense Llama over TP2, and Qwen3-MoE with its experts over EP2 (per-expert names on the Hub side)
@pytest.mark.parametrize("name", ["tp2_pp1", "tp2_ep2_qwen3_moe"])
def test_megatron_fp8_is_the_anchors_quantization(tmp_path, name):
    reference = load_file(str(MEGATRON / name / "reference.safetensors"))
    _merged_fp8_is_the_anchors(MEGATRON / name / "run", tmp_path / "fp8", reference, config=MEGATRON / name / "hf")


@pytest.mark.distributed
def test_deepspeed_zero3_fp8_is_the_anchors_quantization(deepspeed_checkpoints, tmp_path):
    # stage 3 on 2 ranks: parameters split flat across ranks, a tied embedding, frozen parameters and a buffer
    spec, root = deepspeed_checkpoints.get("ds-w2-z3-fp32-tied-frozen")
    saved = torch.load(spec.reference_path(deepspeed_checkpoints.root), weights_only=True)
    _merged_fp8_is_the_anchors(root, tmp_path / "fp8", saved["state_dict"], saved["tied"])


@needs_accelerate
@pytest.mark.distributed
def test_accelerate_rank_files_fp8_is_the_anchors_quantization(frameworks, tmp_path):
    _, folder = frameworks.get("acc-ranks")
    reference, tied = frameworks.reference("acc-ranks")
    _merged_fp8_is_the_anchors(folder, tmp_path / "fp8", reference, tied)
