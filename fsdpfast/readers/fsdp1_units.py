"""FSDP1's units and parameter order, rebuilt from the model (FSDP1 saves neither).

A LOCAL_STATE_DICT holds one flat parameter per FSDP unit and nothing that says which
parameters it concatenates. FSDP1 decides that from the module tree, so we rebuild the
tree: config.json -> the transformers model class it names, built on the meta device (no
memory, no weights) -> the units an auto-wrap policy over module classes makes:

- units are made bottom-up (post-order over the children, in registration order), every
  module that is an instance of a wrap class, then the root;
- a unit flattens the parameters of its subtree that no earlier unit took;
- inside a unit the order is `named_modules(remove_duplicate=False)` and, per module, its own
  parameters in registration order; a parameter met again (tied weights) is stored once,
  under its first name, the later names being views of it (also when the later name sits in
  another unit: that unit does not hold it again).

The registration order is the installed transformers' (order_source names it): the sizes
in the files check the units, not the order of same-shaped parameters within one.

Needs torch and transformers; only the fsdp1-flat layout imports this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import BadInput, option
from ..hf.config import load_config


@dataclass(frozen=True)
class UnitParam:
    name: str  # the parameter's name in the model's state dict
    shape: tuple[int, ...]
    aliases: tuple[str, ...] = ()  # later names of the same parameter in this unit (tied)


@dataclass(frozen=True)
class Unit:
    path: str  # module path in the model; "" for the root
    cls: str  # the module's class name
    params: tuple[UnitParam, ...]  # FSDP1's flattening order


def _imports():
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise BadInput(
            f"the fsdp1-flat layout rebuilds FSDP1's parameter order from the model, which needs torch and "
            f"transformers ({exc.name} is not installed): pip install torch transformers"
        ) from None
    return torch, transformers


def meta_model(config_dir: str):
    """(the model config.json names, built on the meta device; its class name)."""
    path = os.path.join(config_dir, "config.json")
    config = load_config(path)
    names = config.get("architectures")
    if not names:  # absent, null or []: a config saved on its own (AutoConfig, a model made with from_config)
        raise BadInput(
            f'{path}: has no "architectures" field, and fsdp1-flat needs the model class (FSDP1 flattens '
            f'parameters in its order): add "architectures": ["{_class_for(config)}"] or pass {option("config", meta="DIR")} '
            "with a config.json that has it"
        )
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise BadInput(
            f'{path}: "architectures" is {str(names)[:80]!r}, not a list of class names (e.g. ["LlamaForCausalLM"])'
        )
    if not isinstance(config.get("model_type"), str):
        raise BadInput(
            f'{path}: has no "model_type" field, which transformers needs to build {names[0]} '
            f'(e.g. "model_type": "llama"); add it or pass {option("config", meta="DIR")} with a complete config.json'
        )
    torch, transformers = _imports()
    cls = getattr(transformers, str(names[0]), None)
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):  # nothing else is built
        raise BadInput(
            f"{path}: architecture {names[0]} is not a transformers model class (models with custom code are not supported)"
        )
    try:
        hf_config = transformers.AutoConfig.from_pretrained(config_dir)
        with torch.device("meta"):
            model = cls(hf_config)
    except Exception as exc:  # transformers raises many kinds for configs it cannot build
        raise BadInput(f"{path}: transformers cannot build {names[0]} from it ({type(exc).__name__}: {exc})") from None
    return model, names[0]


def _class_for(config: dict) -> str:
    """The causal-LM class transformers maps config.json's model_type to, for the error that asks for it."""
    model_type = config.get("model_type")
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES
    except ImportError:
        return "LlamaForCausalLM"
    if not isinstance(model_type, str):
        return "LlamaForCausalLM"
    return (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_MAPPING_NAMES.get(model_type) or "LlamaForCausalLM"
    )


def order_source(model) -> str:
    """Where the parameter order comes from: the transformers version and the model class (and peft's, for a peft model)."""
    import transformers

    inner = model.get_base_model() if type(model).__module__.startswith("peft.") else model
    cls = type(inner)
    origin = f"transformers {transformers.__version__} {cls.__module__}.{cls.__qualname__}"
    if inner is model:
        return origin
    import peft

    return f"peft {peft.__version__} {type(model).__module__}.{type(model).__qualname__} over {origin}"


def default_wrap(model) -> list[str]:
    """The model's `_no_split_modules` (its decoder-layer class), as FSDP users wrap by default."""
    return sorted(model._no_split_modules or ())


def units(model, wrap: list[str], leaves: frozenset[str] = frozenset()) -> list[Unit]:
    """FSDP1's units for an auto-wrap policy over the classes named `wrap` (and the modules at the
    paths `leaves`: peft's policy wraps trainable leaf modules), in construction order.

    Units without parameters are left out: FSDP1 saves no flat parameter for them.
    """
    present = {c.__name__ for m in model.modules() for c in type(m).__mro__}
    unknown = [name for name in wrap if name not in present]
    if unknown:
        known = sorted({type(m).__name__ for m in model.modules()})
        raise BadInput(
            f"{option('wrap', unknown[0])}: no module of that class in {type(model).__name__}; its classes: {', '.join(known)}"
        )
    wanted = set(wrap)
    targets = []
    _post_order(model, "", wanted, targets, set(), leaves)
    targets.append(("", model))
    claimed: set[int] = set()
    found = []
    for path, module in targets:
        mine = [p for p in module.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in mine)
        if mine:
            found.append(Unit(path, type(module).__name__, _flattening_order(module, path, {id(p) for p in mine})))
    return _with_tied_elsewhere(model, found)


def _with_tied_elsewhere(model, found: list[Unit]) -> list[Unit]:
    """Add, as aliases, names of a parameter that an earlier unit holds (tied across units: FSDP1
    flattens it once, in the first unit; the later name would otherwise be missing from the merge)."""
    by_name = dict(model.named_parameters(remove_duplicate=False))
    named = {n for unit in found for p in unit.params for n in (p.name, *p.aliases)}
    extra: dict[int, tuple[str, ...]] = {}
    for name, param in by_name.items():
        if name not in named:
            extra[id(param)] = extra.get(id(param), ()) + (name,)
    if not extra:
        return found
    return [
        Unit(
            unit.path,
            unit.cls,
            tuple(UnitParam(p.name, p.shape, p.aliases + extra.get(id(by_name.get(p.name)), ())) for p in unit.params),
        )
        for unit in found
    ]


def _post_order(module, path: str, wanted: set[str], out: list, seen: set[int], leaves: frozenset[str]) -> None:
    for name, child in module.named_children():
        if id(child) in seen:
            continue
        seen.add(id(child))
        child_path = f"{path}.{name}" if path else name
        _post_order(child, child_path, wanted, out, seen, leaves)
        if child_path in leaves or any(c.__name__ in wanted for c in type(child).__mro__):
            out.append((child_path, child))


def _flattening_order(module, path: str, mine: set[int]) -> tuple[UnitParam, ...]:
    order: list[list] = []  # [name, shape, aliases]
    first: dict[int, list] = {}
    for sub_name, sub in module.named_modules(remove_duplicate=False):
        for param_name, param in sub.named_parameters(recurse=False, remove_duplicate=False):
            if id(param) not in mine:
                continue
            name = ".".join(p for p in (path, sub_name, param_name) if p)
            if id(param) in first:
                first[id(param)][2].append(name)
            else:
                first[id(param)] = [name, tuple(param.shape), []]
                order.append(first[id(param)])
    return tuple(UnitParam(name, shape, tuple(aliases)) for name, shape, aliases in order)


def module_classes(model, paths: list[str]) -> list[str]:
    """Class names of the modules at `paths` (those that exist), for a --wrap suggestion."""
    modules = dict(model.named_modules())
    return sorted({type(modules[p]).__name__ for p in paths if p and p in modules})
