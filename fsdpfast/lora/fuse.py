"""--merge-lora: the model with its LoRA adapters fused in, as peft's merge_and_unload() computes it.

`fuse` is a plan transform: each adapted weight keeps its place in the output (name, shape,
dtype) and gets a FusedWeight describing what to compute from which tensors; modules_to_save
copies simply replace the module's tensors (byte placement, nothing computed). Every sink
(execute.sinks) hands fused tensors to `FusedWeight.compute_into` (execute.computed), one batch
each (execute.runner): the unmerged weight, lora_A and lora_B are read through the pure-torch
engine's gather it is given, fused by the extension's torch op (torch.ops.fsdpfast.lora_merge,
csrc/lora_merge.cpp: peft's own ATen calls in peft's order), cast to the output dtype like every
other tensor, and written. Memory holds a few tensors of one weight at a time, never the model.

The op runs on the GPU when the merge's engine is the CUDA one, on the CPU otherwise; either
way it computes what peft computes for a model on that device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from .. import _ops
from ..errors import BadInput
from ..plan.model import MergePlan, TensorPlan
from .config import scaling
from .split import AdapterPlan, find_adapter

_OUTPUT_EMBEDDINGS = ("lm_head.weight", "embed_out.weight", "decoder.weight")  # what tie_word_embeddings ties


@dataclass
class LoraStep:
    lora_A: TensorPlan
    lora_B: TensorPlan
    scaling: float
    fan_in_fan_out: bool
    embedding: bool


@dataclass
class BiasStep:
    lora_bias: TensorPlan
    scaling: float


@dataclass(frozen=True)
class FusedWeight:
    base: TensorPlan  # the unmerged tensor (its extents and dtype)
    steps: tuple = ()  # applied in order, as peft merges adapters one after another

    """An execute.computed.Computed: the weight with each step's LoRA update added, as peft merges it."""

    def sources(self) -> set[int]:
        """The plan sources computing it reads (released by the runner once it is written)."""
        tensors = [self.base] + [
            t for s in self.steps for t in ((s.lora_bias,) if isinstance(s, BiasStep) else (s.lora_A, s.lora_B))
        ]
        return {e.source for t in tensors for e in t.extents}

    def compute_into(self, tensor: TensorPlan, destination: memoryview, sources, device: str, gather) -> None:
        import torch

        result = compute(tensor, sources, device, gather)
        torch.frombuffer(destination, dtype=torch.uint8).copy_(result.reshape(-1).view(torch.uint8))


def adapter_names(plan: MergePlan, wanted) -> list[str]:
    """The adapters to fuse, in order: True means the one adapter; a name list (or "a,b") names them."""
    if wanted is True:
        if len(plan.adapters) != 1:
            names = ", ".join(a.name for a in plan.adapters)
            raise BadInput(
                f"the checkpoint has {len(plan.adapters)} LoRA adapters ({names}): name those to fuse, "
                f"in order, with --merge-lora {names.replace(', ', ',')}"
            )
        return [plan.adapters[0].name]
    names = wanted.split(",") if isinstance(wanted, str) else list(wanted)
    for name in names:
        find_adapter(plan, name)
    if len(set(names)) != len(names):
        raise BadInput(f"--merge-lora names an adapter twice ({','.join(names)})")
    return names


def fuse(plan: MergePlan, names: list[str]) -> MergePlan:
    """The plan with each adapter's fused computation attached to the base tensors it changes (in `names` order)."""
    by_name = {t.name: t for t in plan.tensors}
    copied: dict[str, str] = {}
    count = 0
    for adapter in (find_adapter(plan, name) for name in names):
        if adapter.problems:
            raise BadInput(f"--merge-lora: {adapter.problems[0]}")
        for module in adapter.modules.values():
            _check_fusable(adapter, module)
            weight = _base_tensor(by_name, f"{module.module}.weight", adapter)
            step = LoraStep(
                module.lora_A,
                module.lora_B,
                scaling(adapter.config, module),
                bool(adapter.config.get("fan_in_fan_out")),
                module.kind == "embedding",
            )
            _check_shapes(weight, step, adapter.name)
            by_name[weight.name] = _with_step(weight, step)
            if module.lora_bias is not None:
                bias = _base_tensor(by_name, f"{module.module}.bias", adapter)
                by_name[bias.name] = _with_step(bias, BiasStep(module.lora_bias, step.scaling))
            count += 1
        for name, trained in adapter.copies.items():  # modules_to_save: the adapter's copy is the module
            target = _base_tensor(by_name, name, adapter)
            _check_untied(plan, by_name, target, adapter.name)
            if name in copied:
                raise BadInput(
                    f"--merge-lora: adapters {copied[name]} and {adapter.name} both train their own copy of {name}"
                )
            if (target.shape, target.source_dtype) != (trained.shape, trained.source_dtype):
                raise BadInput(
                    f"adapter {adapter.name}: its copy of {name} is {trained.source_dtype}{list(trained.shape)}, "
                    f"the model's is {target.source_dtype}{list(target.shape)}"
                )
            by_name[name], copied[name] = replace(target, extents=trained.extents), adapter.name
    tensors = _share_with_tied([by_name[t.name] for t in plan.tensors])
    return plan.but(tensors=tensors).noted(
        f"--merge-lora: adapter{'s' if len(names) > 1 else ''} {', '.join(names)} fused into {count} weights "
        "(W + scaling * B @ A, computed as peft's merge_and_unload)"
    )


def _check_untied(plan: MergePlan, by_name: dict[str, TensorPlan], target: TensorPlan, adapter: str) -> None:
    """A trained copy of a tied module (lm_head tied to embed_tokens) unties it, which the output cannot say."""
    shared = any(t.name != target.name and t.extents == target.extents for t in by_name.values()) and target.extents
    config = {}
    if plan.config_dir and os.path.isfile(os.path.join(plan.config_dir, "config.json")):
        from ..hf.config import load_config

        config = load_config(os.path.join(plan.config_dir, "config.json"))
    if shared or (config.get("tie_word_embeddings") and target.name.endswith(_OUTPUT_EMBEDDINGS)):
        raise BadInput(
            f"--merge-lora: adapter {adapter} trains its own copy of {target.name}, which the model ties to "
            "another weight; the fused model cannot keep both: merge without --merge-lora and use the adapter"
        )


def _check_fusable(adapter: AdapterPlan, module) -> None:
    if module.magnitude is not None:
        raise BadInput(
            f"--merge-lora: adapter {adapter.name} is DoRA ({module.module} has a magnitude vector); fusing DoRA "
            "is not supported: merge without --merge-lora and call peft's merge_and_unload() on the adapter folder"
        )
    if module.kind == "conv":
        raise BadInput(
            f"--merge-lora: {module.module} of adapter {adapter.name} is a convolution LoRA; only Linear and "
            "Embedding LoRA layers are fused"
        )


def _base_tensor(by_name: dict[str, TensorPlan], name: str, adapter: AdapterPlan) -> TensorPlan:
    if name not in by_name:
        raise BadInput(f"--merge-lora: adapter {adapter.name} changes {name}, which the base model does not have")
    return by_name[name]


def _check_shapes(weight: TensorPlan, step: LoraStep, adapter: str) -> None:
    out, rank = step.lora_B.shape
    _, inputs = step.lora_A.shape
    want = (inputs, out) if step.embedding or step.fan_in_fan_out else (out, inputs)
    if weight.shape != want:
        raise BadInput(
            f"adapter {adapter}: {weight.name} is {list(weight.shape)} but lora_B @ lora_A gives {list(want)}"
            f"{' transposed' if want != (out, inputs) else ''}; wrong base model or fan_in_fan_out"
        )


def _with_step(tensor: TensorPlan, step) -> TensorPlan:
    fused = tensor.compute or FusedWeight(replace(tensor, aliases=(), compute=None))
    return replace(tensor, compute=replace(fused, steps=(*fused.steps, step)))


def _share_with_tied(tensors: list[TensorPlan]) -> list[TensorPlan]:
    """peft merges in place: a weight tied to a fused one (one storage, e.g. lm_head and embed_tokens) changes too."""
    fused = {(t.shape, t.source_dtype, t.compute.base.extents): t.compute for t in tensors if t.compute}
    return [
        replace(t, compute=fused[(t.shape, t.source_dtype, t.extents)])
        if t.compute is None and t.extents and (t.shape, t.source_dtype, t.extents) in fused
        else t
        for t in tensors
    ]


# --- computing a fused tensor ---------------------------------------------------------------------


def compute(tensor: TensorPlan, sources, device: str, gather):
    """The fused tensor, in its target dtype, on the CPU; its inputs read by `gather` (execute.computed)."""
    import torch

    if not _ops.torch_ops():
        raise BadInput(
            f"--merge-lora needs fsdpfast's torch ops (torch.ops.fsdpfast.lora_merge), which did not load "
            f"({_ops.torch_ops_error()}); build the extension"
        )
    fused: FusedWeight = tensor.compute
    weight = _read(fused.base, sources, gather).to(device)
    for step in fused.steps:
        if isinstance(step, BiasStep):
            weight = torch.ops.fsdpfast.lora_merge_bias(
                weight, _read(step.lora_bias, sources, gather).to(device), step.scaling
            )
        else:
            weight = torch.ops.fsdpfast.lora_merge(
                weight,
                _read(step.lora_A, sources, gather).to(device),
                _read(step.lora_B, sources, gather).to(device),
                step.scaling,
                step.fan_in_fan_out,
                step.embedding,
            )
    return weight.cpu().to(getattr(torch, tensor.target_dtype)).contiguous()  # .to(): the cast every engine makes


def _read(tensor: TensorPlan, sources, gather):
    """One checkpoint tensor as it is stored (its own dtype), gathered by the pure-torch engine."""
    import torch

    dtype = getattr(torch, tensor.source_dtype)
    if not tensor.numel:
        return torch.empty(tensor.shape, dtype=dtype)
    buffer = bytearray(tensor.numel * torch.empty(0, dtype=dtype).element_size())
    gather(replace(tensor, target_dtype=tensor.source_dtype, compute=None), memoryview(buffer), sources)
    return torch.frombuffer(buffer, dtype=dtype).reshape(tensor.shape)
