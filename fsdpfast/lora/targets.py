"""Every adapted module must be one the base model has, with the shape its lora_B @ lora_A gives.

peft loads an adapter onto a base model by module name: lora_A / lora_B of a module the model
lacks are dropped without a word (the adapter then does less than it was trained to), so such
an adapter is refused, whether it is written (OUT/lora_adapter) or fused (--merge-lora). What the
model has is decided, in order, by the class config.json names (plan.model_check, built on the
meta device), else the checkpoint's own base weights; a LoRA-only checkpoint without config.json
gives neither, and a note says the modules were not checked.
"""

from __future__ import annotations

from ..errors import BadInput, ModelMismatch, option
from ..plan.model import MergePlan
from ..plan.model_check import ExpectedModel, match_names
from .split import LoraModule

SHOWN = 3  # more weights named in the one-line refusal


def check_targets(plan: MergePlan, expected: ExpectedModel | None, why_not: str) -> MergePlan:
    """The plan, with a note of what the adapters were checked against; refused (one line) when an
    adapter's module or modules_to_save copy is not the model's, or not of its shape."""
    if not plan.adapters:
        return plan
    wanted = _wanted(plan)  # weight name -> (the shapes the adapter fits, who wants it)
    base = {name: t.shape for t in plan.tensors for name in (t.name, *t.aliases)}
    if expected is not None:
        mapping = match_names(list(base) + list(wanted), expected)
        shapes = {name: expected.shapes[mapped] for name, mapped in mapping.items() if mapped in expected.shapes}
        if expected.base_only:  # the head is not in the model built: the checkpoint's base weights say
            shapes = {**base, **shapes}
        against, error = f"{expected.architecture} built from {expected.config_path}", ModelMismatch
        hint = f"check that config.json describes the model it was trained on ({option('config', meta='DIR')})"
    elif base:
        shapes, against, error = base, "the checkpoint's base model", BadInput
        hint = "the checkpoint's adapter and base weights do not belong together"
    else:
        return plan.noted(
            f"the LoRA adapters' modules were not checked against a model ({why_not}, and a LoRA-only checkpoint "
            f"holds no base weights): peft ignores an adapter's tensors for a module the base it is loaded onto lacks"
        )
    if expected is not None and expected.base_only and not base:
        wanted = {name: want for name, want in wanted.items() if name in shapes}
    missing = [name for name in wanted if name not in shapes]
    if missing:
        more = ""
        if len(missing) > 1:
            more = f" (and {len(missing) - 1} more: {', '.join(missing[1 : SHOWN + 1])}{', ...' * (len(missing) > SHOWN + 1)})"
        raise error(
            f"{wanted[missing[0]][1]} is for a weight {against} does not have{more}; the adapter is not this "
            f"model's: {hint}"
        )
    for name, (fits, who) in wanted.items():
        if fits and tuple(shapes[name]) not in fits:
            raise error(
                f"{who} fits a weight of {' or '.join(str(list(s)) for s in sorted(fits))}, but {name} of {against} "
                f"is {list(shapes[name])}; the adapter is not this model's"
            )
    return plan.noted(f"the LoRA adapters' {len(wanted)} modules and copies checked against {against}")


def _wanted(plan: MergePlan) -> dict[str, tuple[set, str]]:
    wanted: dict[str, tuple[set, str]] = {}
    for adapter in plan.adapters:
        for module in adapter.modules.values():
            who = f"adapter {adapter.name}: {module.module} (lora_A {list(module.lora_A.shape)})"
            wanted.setdefault(f"{module.module}.weight", (_fits(module), who))
        for name, copy in adapter.copies.items():
            wanted.setdefault(name, ({tuple(copy.shape)}, f"adapter {adapter.name}: its modules_to_save copy {name}"))
    return wanted


def _fits(module: LoraModule) -> set[tuple[int, ...]]:
    """The weight shapes lora_B @ lora_A can change: (out, in), or (in, out) for fan_in_fan_out (GPT-2's
    Conv1D) and embeddings; a convolution's kernel is not shown by its lora_A alone."""
    out, inputs = module.lora_B.shape[0], module.lora_A.shape[1]
    if module.kind == "embedding":
        return {(inputs, out)}
    if module.kind == "conv":
        return set()
    return {(out, inputs), (inputs, out)}
