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
