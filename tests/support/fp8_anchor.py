"""The reference for FP8 output: transformers' own fine-grained FP8 quantizer (Fp8Quantize._quantize_one,
integrations/finegrained_fp8.py) on the whole tensor. It passes through shapes that are not whole
128x128 blocks; for those (partial blocks, which fsdpfast quantizes with one scale each, as vLLM's
loaders expect) it runs on the tensor zero-padded to whole blocks, the padding cropped off: zeros
change no amax."""

from __future__ import annotations

import torch


class _Config:
    weight_block_size = (128, 128)
    scale_fmt = None


class _Quantizer:
    quantization_config = _Config()


def anchor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' quantization of `weight`: (float8_e4m3fn weight, float32 scale_inv per block)."""
    from transformers.integrations import finegrained_fp8

    rows, cols = weight.shape[-2:]
    padded = torch.nn.functional.pad(weight, (0, -cols % 128, 0, -rows % 128))
    out = finegrained_fp8.Fp8Quantize(_Quantizer())._quantize_one("m.weight", padded)
    return out["m.weight"][..., :rows, :cols], out["m.weight_scale_inv"]


def assert_fp8_is_the_anchors(merged: dict, reference: dict, tied=()) -> list[str]:
    """`merged` (a --dtype fp8 folder's tensors) holds each quantized weight of `reference` (the unsharded
    model) as the anchor quantizes its bf16 cast, everything else as the bf16 cast, and nothing more;
    the names quantized."""
    from fsdpfast.fp8.select import quantized

    chosen = [n for n, t in reference.items() if n not in tied and quantized(n, tuple(t.shape), "float32")]
    assert chosen, "the model has linear weights"
    for n, want in reference.items():
        if n in tied:
            continue
        bf16 = want.to(torch.bfloat16) if want.is_floating_point() else want
        if n in chosen:
            q, s = anchor(bf16)
            assert torch.equal(merged[n].view(torch.uint8), q.view(torch.uint8)), n
            assert merged[f"{n}_scale_inv"].dtype == torch.float32 and torch.equal(merged[f"{n}_scale_inv"], s), n
        else:
            assert merged[n].dtype == bf16.dtype and torch.equal(merged[n], bf16), n
    assert set(merged) == {n for n in reference if n not in tied} | {f"{n}_scale_inv" for n in chosen}
    return chosen
