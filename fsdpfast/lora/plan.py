"""PEFT LoRA checkpoints in plan_merge: split the names, resolve each adapter's config, add --base, fuse.

Applied right after the reader (any layout), before prepare: read_adapters, then (once lora.targets has
checked the adapted modules against the model) fuse_chosen. What the user chose is recorded in
the plan's options, so the manifest lets `verify --against` plan the same output again.
"""

from __future__ import annotations

import os
from dataclasses import replace

from ..errors import BadInput
from ..plan.model import MergePlan, TensorPlan
from .base_model import add_base
from .config import resolve
from .fuse import adapter_names, fuse
from .split import is_peft, split

_FLAGS = ("merge_lora", "lora_alpha", "lora_r", "base")


def read_adapters(
    plan: MergePlan,
    src: str,
    *,
    merge_lora=None,
    lora_alpha: float | None = None,
    lora_r: int | None = None,
    base: str | None = None,
) -> MergePlan:
    """The base plan with `adapters` and their configs (split, --base added, configs resolved); unchanged
    for a checkpoint without LoRA tensors, where any LoRA flag is refused."""
    given = _given(merge_lora, lora_alpha, lora_r, base)
    if not is_peft(plan):
        if given:
            flags = ", ".join(f"--{k.replace('_', '-')}" for k in given)
            raise BadInput(f"{src}: no LoRA tensors (no lora_A / lora_B names); {flags} apply to PEFT LoRA checkpoints")
        return plan
    _check_numbers(lora_alpha, lora_r)
    plan = split(plan)
    if base and plan.tensors:
        raise BadInput(
            f"--base {base}: {src} holds its own base weights ({len(plan.tensors)} tensors); "
            "--base is for LoRA-only checkpoints (save_lora_only)"
        )
    if base:
        plan = add_base(plan, os.fspath(base))
    notes: list[str] = []
    plan = plan.but(adapters=resolve(plan.adapters, src, plan.config_dir, lora_alpha, lora_r, notes))
    return plan.noted(*notes)


def fuse_chosen(
    plan: MergePlan,
    src: str,
    *,
    merge_lora=None,
    lora_alpha: float | None = None,
    lora_r: int | None = None,
    base: str | None = None,
) -> MergePlan:
    """After read_adapters (and lora.targets' check): --merge-lora fuses the chosen adapters; what the user
    chose is recorded in the plan's and the adapters' options."""
    if not plan.adapters:
        return plan
    given = _given(merge_lora, lora_alpha, lora_r, base)
    lora_only = bool(base) or not plan.tensors  # read_adapters took --base only for a LoRA-only checkpoint
    adapter_options = {**plan.options, "lora_alpha": lora_alpha, "lora_r": lora_r}
    keep_adapters = not merge_lora
    if lora_only and not base:
        if merge_lora:
            raise BadInput(
                f"--merge-lora: {src} holds only LoRA tensors (save_lora_only), no base weights to fuse them "
                "into; give the base model with --base HF_DIR"
            )
        plan = plan.noted(
            "LoRA-only checkpoint (save_lora_only): only the adapter folder is written; "
            "--base HF_DIR also writes the base model with the adapter fused in"
        )
    elif lora_only:  # with --base: the fused model, and the adapter the checkpoint holds
        merge_lora = merge_lora or True
        keep_adapters = True
    if merge_lora:
        names = adapter_names(plan, merge_lora)
        plan = fuse(plan, names)
        given["merge_lora"] = ",".join(names)
        if not keep_adapters:
            plan = plan.but(adapters=())
    if base:
        given["base"] = os.path.abspath(base)
    kept = {k: v for k, v in adapter_options.items() if v is not None}
    adapters = [replace(a, plan=a.plan.but(options={**kept, "peft_adapter": a.name})) for a in plan.adapters]
    return plan.but(adapters=adapters, options={**plan.options, **given})


def _given(merge_lora, lora_alpha, lora_r, base) -> dict:
    return {k: v for k, v in zip(_FLAGS, (merge_lora, lora_alpha, lora_r, base)) if v not in (None, False, "")}


def describe(plan: MergePlan) -> list[dict]:
    """What `inspect` shows of each adapter."""
    return [
        {
            "adapter": a.name,
            "folder": a.folder,
            "r": a.config.get("r"),
            "lora_alpha": a.config.get("lora_alpha"),
            "target_modules": a.config.get("target_modules"),
            "task_type": a.config.get("task_type"),
            "use_dora": a.config.get("use_dora"),
            "modules": len(a.modules),
            "tensors": len(a.plan.tensors),
            "bytes": sum(_nbytes(t) for t in a.plan.tensors),
            "problems": list(a.problems),
        }
        for a in plan.adapters
    ]


def _nbytes(tensor: TensorPlan) -> int:
    from ..dtypes import itemsize

    return tensor.numel * itemsize(tensor.source_dtype)


def _check_numbers(lora_alpha, lora_r) -> None:
    if lora_alpha is not None and (
        isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float)) or not 0 < lora_alpha < float("inf")
    ):
        raise BadInput(f"--lora-alpha {lora_alpha!r} is not a positive number")
    if lora_r is not None and (isinstance(lora_r, bool) or not isinstance(lora_r, int) or lora_r <= 0):
        raise BadInput(f"--lora-r {lora_r!r} is not a positive whole number")
