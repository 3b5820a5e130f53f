"""--dtype fp8 on a prepared plan: each quantized weight becomes two computed tensors.

`x.weight` (float8_e4m3fn, its shape) and `x.weight_scale_inv` (float32, one per 128x128 block),
both computed by one Fp8Weight from the weight's own extents: the executor gathers the weight as
the plan converts it (bfloat16 with --dtype fp8, or float32 for what the family keeps there) and
the extension's op quantizes it (csrc/fp8_block.h), on the GPU with the CUDA engine. Quantizing
the bfloat16 weight is what the two-pass way does (merge to bf16, then quantize the folder).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from .. import _ops
from ..errors import BadInput
from ..plan.model import MergePlan, TensorPlan
from .select import BLOCK, quantization_config, quantized, scale_name, scale_shape


@dataclass(eq=False)
class Fp8Weight:
    """An execute.computed.Computed for both parts of one quantized weight (`part`: weight or scale)."""

    base: TensorPlan  # the weight as the plan writes it unquantized
    part: str
    keeps_dtype = True  # its target dtype is the format's, not the merge's --dtype (verify.against)
    shared: dict = field(default_factory=dict)  # the other part's result, until it is written
    lock: threading.Lock = field(default_factory=threading.Lock)

    def sources(self) -> set[int]:
        return {e.source for e in self.base.extents}

    def compute_into(self, tensor: TensorPlan, destination: memoryview, sources, device: str, gather) -> None:
        import torch

        with self.lock:
            result = self.shared.pop(self.part, None)
            if result is None:
                weight = torch.empty(self.base.shape, dtype=getattr(torch, self.base.target_dtype))
                gather(self.base, memoryview(weight.view(torch.uint8).reshape(-1).numpy()), sources)
                q, s = _ops.fp8_block_quantize(weight.to(device), *BLOCK)
                parts = {"weight": q.cpu(), "scale": s.cpu()}
                result = parts.pop(self.part)
                self.shared.update(parts)  # the other part, for its own call
        torch.frombuffer(destination, dtype=torch.uint8).copy_(result.reshape(-1).view(torch.uint8))


def unquantized(plan: MergePlan) -> MergePlan:
    """The plan as it was before quantize_plan (the model check's view): the weights, no scales."""
    tensors = [
        t.compute.base if isinstance(t.compute, Fp8Weight) else t
        for t in plan.tensors
        if not (isinstance(t.compute, Fp8Weight) and t.compute.part == "scale")
    ]
    return plan.but(tensors=tuple(tensors))


def written_config(plan: MergePlan) -> dict | None:
    """config.json's quantization_config for a --dtype fp8 plan (every unquantized 2-D weight named), else None."""
    if "fp8" not in plan.options:
        return None
    left_out = [
        t.name.removesuffix(".weight")
        for t in plan.tensors
        if len(t.shape) == 2 and t.name.endswith(".weight") and t.target_dtype != "float8_e4m3fn"
    ]
    return quantization_config(left_out)


def quantize_plan(plan: MergePlan, skip: tuple[str, ...], packed: bool | None = None) -> MergePlan:
    """The plan with its linear weights quantized and config.json's quantization_config recorded.
    `packed`: the experts are in transformers' packed layout (default: as the plan's options say);
    their 3-D tensors are quantized per expert unless they have biases (FP8Experts has none)."""
    if not _ops.torch_ops():
        raise BadInput(f"--dtype fp8 needs fsdpfast's torch ops, which did not load: {_ops.torch_ops_error()}")
    packed = plan.options.get("expert_layout") == "packed" if packed is None else packed
    names = {t.name for t in plan.tensors}
    tensors: list[TensorPlan] = []
    left_out = 0
    count = 0
    for t in plan.tensors:
        unbiased = packed and f"{t.name}_bias" not in names
        if t.compute is None and quantized(t.name, t.shape, t.source_dtype, skip, unbiased):
            shared: dict = {}
            lock = threading.Lock()
            tensors.append(replace(t, target_dtype="float8_e4m3fn", compute=Fp8Weight(t, "weight", shared, lock)))
            tensors.append(
                replace(
                    t,
                    name=scale_name(t.name),
                    shape=scale_shape(t.shape),
                    target_dtype="float32",
                    aliases=(),
                    compute=Fp8Weight(t, "scale", shared, lock),
                )
            )
            count += 1
            continue
        left_out += len(t.shape) == 2 and t.name.endswith(".weight")
        tensors.append(t)
    if count == 0:
        raise BadInput("--dtype fp8: no linear weight to quantize (every 2-D weight is left out or skipped)")
    # recorded with the layout options, so verify --against plans the same way
    return plan.but(tensors=tuple(tensors), options={**plan.options, "fp8": list(skip)}).noted(
        f"--dtype fp8: {count} linear weights in float8_e4m3fn with float32 scale_inv per 128x128 block; "
        f"{left_out} 2-D weights left unquantized (modules_to_not_convert)"
    )
