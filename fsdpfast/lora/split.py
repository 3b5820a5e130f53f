"""Split a PEFT LoRA checkpoint's plan into the base model and one plan per adapter.

A peft model's state dict (verl trains LoRA actors as peft models wrapped by FSDP) names every
tensor through peft's wrappers: `base_model.model.` before the model's own name, `.base_layer.`
inside an adapted module, `lora_A.<adapter>.weight` / `lora_B.<adapter>.weight` (and `.bias`
with lora_bias), `lora_embedding_A.<adapter>` / `lora_embedding_B.<adapter>` on embeddings,
`lora_magnitude_vector.<adapter>.weight` for DoRA, `modules_to_save.<adapter>.` (a trained copy
of a whole module) beside `original_module.`. Written under those names the output is neither a
model nor an adapter. Split, the base plan carries the model's own names and each adapter plan
the names peft's save_pretrained writes (`base_model.model.` kept, the adapter name dropped).

Only names are read: this works the same for every layout a reader turns into a plan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from ..errors import BadInput
from ..plan.model import MergePlan, TensorPlan
from ..plan.normalise import clean_name

PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the model
ADAPTER_ROOT = "lora_adapter"  # OUT/lora_adapter (default), OUT/lora_adapter/<name> (others), as peft saves them
_PAIRS = ("lora_A", "lora_B")  # nn.ModuleDict of Linear (or Conv): <adapter>.weight, <adapter>.bias
_EMBEDDING = ("lora_embedding_A", "lora_embedding_B")  # nn.ParameterDict: <adapter>
_MAGNITUDE = "lora_magnitude_vector"  # DoRA: <adapter>.weight
_COPIES, _ORIGINAL, _BASE_LAYER = "modules_to_save", "original_module", "base_layer"
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9_-]{1,100}")  # becomes a folder name


@dataclass
class LoraModule:
    """One adapted module of one adapter."""

    module: str  # its name in the model, e.g. model.layers.0.self_attn.q_proj
    kind: str = "linear"  # linear | embedding | conv (exported, never fused)
    lora_A: TensorPlan | None = None
    lora_B: TensorPlan | None = None
    lora_bias: TensorPlan | None = None  # lora_B's bias (lora_bias=True)
    magnitude: TensorPlan | None = None  # DoRA

    @property
    def rank(self) -> int:
        return self.lora_A.shape[0]


@dataclass(frozen=True)  # inside the frozen MergePlan: changed only through dataclasses.replace
class AdapterPlan:
    name: str
    plan: MergePlan  # tensors under peft's saved names; shares the checkpoint plan's sources
    modules: dict[str, LoraModule] = field(default_factory=dict)  # read-only once split
    copies: dict[str, TensorPlan] = field(default_factory=dict)  # modules_to_save: model tensor name -> trained copy
    config: dict = field(default_factory=dict)  # adapter_config.json (lora.config.resolve); read-only
    problems: tuple[str, ...] = ()  # what keeps the folder from being written (a missing alpha)

    @property
    def folder(self) -> str:
        return ADAPTER_ROOT if self.name == "default" else f"{ADAPTER_ROOT}/{self.name}"


def is_peft(plan: MergePlan) -> bool:
    return any(_role(*_inner(t.name))[0] != "base" for t in plan.tensors)


def lora_role(name: str) -> tuple[str, str | None, str, str]:
    """(base | lora | copy, adapter, module, part) of one state-dict name (fsdp1-flat rebuilds the peft model from them)."""
    return _role(*_inner(name))


def _inner(name: str) -> tuple[list[str], bool]:
    """The name's parts without wrapper prefixes (FSDP1, torch.compile, DDP) and peft's, and whether peft's was there."""
    full = clean_name(name)
    return (full[len(PREFIX) :] if full.startswith(PREFIX) else full).split("."), full.startswith(PREFIX)


def split(plan: MergePlan) -> MergePlan:
    """The base plan (the model's own names; empty for a LoRA-only checkpoint) with `adapters` set."""
    base: dict[str, TensorPlan] = {}
    adapters: dict[str, AdapterPlan] = {}  # each with its modules and copies; its tensors gathered apart
    saved: dict[str, list[TensorPlan]] = {}
    for tensor in plan.tensors:
        role, adapter, module, part = _role(*_inner(tensor.name))
        if role == "base":
            if module in base:
                raise BadInput(
                    f"{tensor.name} and {base[module].name} are both the base model's {module}; "
                    "the checkpoint holds two copies of one weight"
                )
            base[module] = tensor
            continue
        if not _ADAPTER_NAME.fullmatch(adapter):
            raise BadInput(
                f"{tensor.name}: adapter name {adapter[:40]!r} is not a plain name (letters, digits, _ or -)"
            )
        found = adapters.setdefault(adapter, AdapterPlan(adapter, MergePlan(plan.layout, plan.world_size, (), ())))
        tensors = saved.setdefault(adapter, [])
        if role == "copy":  # modules_to_save: saved without the adapter name, under the module's own
            found.copies[f"{module}.{part}"] = _renamed(tensor, f"{PREFIX}{module}.{part}", tensors)
            continue
        entry = found.modules.setdefault(module, LoraModule(module))
        _place(entry, part, _renamed(tensor, _saved_name(module, part), tensors), tensor.name)
    for found in adapters.values():
        for entry in found.modules.values():
            _check_module(entry, found.name)
    return plan.but(
        tensors=[replace(tensor, name=name) for name, tensor in base.items()],
        adapters=sorted(
            (
                replace(a, plan=MergePlan(plan.layout, plan.world_size, plan.sources, saved[a.name]))
                for a in adapters.values()
            ),
            key=lambda a: (a.name != "default", a.name),
        ),
    )


def _role(parts: list[str], prefixed: bool = True) -> tuple[str, str | None, str, str]:
    """(base | lora | copy, adapter, module or base name, part) for a name split at its dots. Another `lora_*`
    part under peft's prefix is a PEFT tensor fsdpfast does not know (AdaLoRA's lora_E...): refused."""
    for i, part in enumerate(parts):
        rest = parts[i + 1 :]
        module = ".".join(parts[:i])
        if part in _PAIRS and len(rest) == 2 and rest[1] in ("weight", "bias"):
            return "lora", rest[0], module, part + ("_bias" if rest[1] == "bias" else "")
        if part in _EMBEDDING and len(rest) == 1:
            return "lora", rest[0], module, part
        if part == _MAGNITUDE and len(rest) == 2 and rest[1] == "weight":
            return "lora", rest[0], module, part
        if part == _COPIES and len(rest) >= 2:
            return "copy", rest[0], module, ".".join(rest[1:])
        if part in (_BASE_LAYER, _ORIGINAL):  # the wrapped module's own parameters
            return "base", None, ".".join(parts[:i] + [p for p in rest if p != _BASE_LAYER]), ""
        if prefixed and (part.startswith("lora_") or part == _COPIES):
            raise BadInput(
                f"{'.'.join(parts)}: a PEFT tensor of a kind fsdpfast does not know ({part}); "
                "only LoRA (lora_A/B, lora_embedding_A/B, DoRA magnitudes, modules_to_save) is understood"
            )
    return "base", None, ".".join(parts), ""


def _saved_name(module: str, part: str) -> str:
    """peft's save_pretrained name: the adapter name and a magnitude's `.weight` dropped."""
    if part in _PAIRS:
        return f"{PREFIX}{module}.{part}.weight"
    if part.endswith("_bias"):
        return f"{PREFIX}{module}.{part[: -len('_bias')]}.bias"
    return f"{PREFIX}{module}.{part}"


def _renamed(tensor: TensorPlan, name: str, saved: list[TensorPlan]) -> TensorPlan:
    copy = replace(tensor, name=name, aliases=())
    saved.append(copy)
    return copy


def _place(entry: LoraModule, part: str, tensor: TensorPlan, original: str) -> None:
    slot = {
        "lora_A": "lora_A",
        "lora_embedding_A": "lora_A",
        "lora_B": "lora_B",
        "lora_embedding_B": "lora_B",
        "lora_B_bias": "lora_bias",
        _MAGNITUDE: "magnitude",
    }[part]
    if getattr(entry, slot) is not None:
        raise BadInput(f"{original}: the checkpoint holds this adapter tensor twice")
    setattr(entry, slot, tensor)
    if part in _EMBEDDING:
        entry.kind = "embedding"


def _check_module(entry: LoraModule, adapter: str) -> None:
    where = f"adapter {adapter!r}, module {entry.module}"
    if entry.lora_A is None or entry.lora_B is None:
        raise BadInput(
            f"{where}: has {'lora_B' if entry.lora_A is None else 'lora_A'} but not "
            f"{'lora_A' if entry.lora_A is None else 'lora_B'}; the checkpoint is incomplete"
        )
    a, b = entry.lora_A.shape, entry.lora_B.shape
    if len(a) == 4 and len(b) == 4 and entry.kind == "linear":
        entry.kind = "conv"
    elif len(a) != 2 or len(b) != 2:
        raise BadInput(f"{where}: lora_A {list(a)} and lora_B {list(b)} are not matrices")
    if b[1] != a[0]:
        raise BadInput(f"{where}: lora_A {list(a)} and lora_B {list(b)} do not share a rank")
    if entry.magnitude is not None and entry.magnitude.shape != (b[0],):
        raise BadInput(f"{where}: DoRA magnitude {list(entry.magnitude.shape)} does not match lora_B {list(b)}")
    if entry.lora_bias is not None and entry.lora_bias.shape != (b[0],):
        raise BadInput(f"{where}: lora_B bias {list(entry.lora_bias.shape)} does not match lora_B {list(b)}")


def find_adapter(plan: MergePlan, name: str) -> AdapterPlan:
    for adapter in plan.adapters:
        if adapter.name == name:
            return adapter
    known = ", ".join(a.name for a in plan.adapters) or "none"
    raise BadInput(f"the checkpoint has no LoRA adapter {name!r} (adapters: {known})")
