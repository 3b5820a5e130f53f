"""Which tensors --dtype fp8 quantizes, and the quantization_config that says so in config.json.

As the released FP8 checkpoints of the families (DeepSeek-V3, Qwen3-FP8, GLM-4.5-FP8) and
transformers' FP8 loader have it: the 2-D `.weight` of every linear layer of attention, MLP and
experts (per expert when the experts are written one by one). Left out: embeddings, `lm_head`,
norms, routers and gates (`mlp.gate`, not `gate_proj`), biases, vision towers, anything 1-D or of
integer dtype, and names matching a --fp8-skip pattern (fnmatch, on the name written). Every 2-D
weight left out is named in `modules_to_not_convert`, so transformers keeps its layer unquantized.
"""

from __future__ import annotations

import fnmatch
import re

BLOCK = (128, 128)
FLOATING = {"float32", "bfloat16", "float16", "float64"}
# A name part that keeps the weight unquantized (matched on whole dotted parts or their prefixes).
_LEFT_OUT = re.compile(
    r"(^|\.)(embed\w*|wte|wpe|lm_head|output|\w*norm\w*|ln_\w*|gate|router|\w*shared_expert_gate|"
    r"visual|vision\w*|vision_tower|multi_modal_projector|mm_projector|score|classifier)(\.|$)"
)


# transformers' packed experts ([E, out, in]), which its FP8Experts holds in float8 with a
# `<name>_scale_inv` of [E, ceil(out/128), ceil(in/128)]
_PACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|up_proj|down_proj)$")


def quantized(
    name: str, shape: tuple[int, ...], dtype: str, skip: tuple[str, ...] = (), packed_experts: bool = False
) -> bool:
    """Whether --dtype fp8 writes `name` as float8 with a scale_inv. `packed_experts`: the experts are
    written in transformers' own packed layout (--expert-layout packed) and have no bias: their 3-D
    tensors are quantized per expert, as transformers' Fp8Quantize does and FP8Experts loads them."""
    if dtype not in FLOATING:
        return False
    if len(shape) == 3 and packed_experts and _PACKED_EXPERTS.search(name):
        pass
    elif len(shape) != 2 or not name.endswith(".weight") or _LEFT_OUT.search(name.removesuffix(".weight")):
        return False
    return not any(fnmatch.fnmatchcase(name, pattern) for pattern in skip)


def scale_name(name: str) -> str:
    """`x.weight` -> `x.weight_scale_inv`, the name transformers, vLLM and SGLang read."""
    return f"{name}_scale_inv"


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-2], -(-shape[-2] // BLOCK[0]), -(-shape[-1] // BLOCK[1]))


def quantization_config(not_converted: list[str]) -> dict:
    """config.json's quantization_config, as transformers (FineGrainedFP8Config), vLLM and SGLang read it."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
        "modules_to_not_convert": sorted(not_converted),
    }
