"""The model-shape safety net: check a merge's names and shapes against the model config.json names.

A merge whose names or shapes differ from the model's would exit 0 and then load with random
weights (a missing tensor is initialised silently by transformers) or not load at all. So when
config.json is known and transformers is importable, the class it names is built on the meta
device (no memory, no weights, no code from the checkpoint: only classes transformers itself
ships) and the merge's tensors are checked against its state dict before any byte is written.
The same model tells which names transformers ties on load (written once).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import ModelMismatch, option
from ..hf.config import load_config

SHOWN = 3  # names listed per kind of problem in the one-line error


@dataclass(frozen=True)
class ExpectedModel:
    """What `from_pretrained` of config.json's class expects to find in the folder."""

    architecture: str
    config_path: str
    shapes: dict[str, tuple[int, ...]]  # its state dict: parameters and persistent buffers
    tied: dict[str, str]  # a name transformers re-ties on load -> the name it shares the parameter with
    prefix: str  # base_model_prefix: a base model's names lack it, and transformers maps them
    ignore_missing: tuple[str, ...]  # patterns transformers itself does not miss
    ignore_unexpected: tuple[str, ...]
    base_only: bool = False  # config.json names no class: the base model, the head's tensors unchecked


def load_expected_model(config_dir: str | None, built: dict | None = None) -> tuple[ExpectedModel | None, str]:
    """(the model config.json describes, "") or (None, why the check cannot run).

    `built`: the config.json a reader built (MergePlan.built_config), used when there is no config_dir.
    A config.json without `architectures` (saved from a bare config, not a model) names no head:
    the base model of its `model_type` is built instead, and only the tensors under it are checked.
    """
    if not config_dir and built is not None:
        path, config = "config.json (built from the checkpoint's own records)", built
    elif not config_dir or not os.path.isfile(os.path.join(config_dir, "config.json")):
        return None, "no config.json"
    else:
        path = os.path.join(config_dir, "config.json")
        config = load_config(path)
    architectures = config.get("architectures")
    named = isinstance(architectures, list) and architectures and isinstance(architectures[0], str)
    if not named and not isinstance(config.get("model_type"), str):
        return None, f"{path} has neither an 'architectures' field naming the model class nor a 'model_type'"
    try:
        import torch
        import transformers
    except ImportError:
        return None, "transformers is not installed"
    if named:
        cls = getattr(transformers, architectures[0], None)
        if not isinstance(cls, type) or not hasattr(cls, "config_class"):
            return None, (
                f"{path} names {architectures[0]}, which this transformers ({transformers.__version__}) "
                "does not ship (custom model code is never run)"
            )
    else:
        cls = _base_model_class(transformers, config["model_type"])
        if cls is None:
            return None, (
                f"{path} has no 'architectures' field and transformers ({transformers.__version__}) "
                f"knows no model_type {config['model_type']!r}"
            )
    try:
        model = _build_on_meta(torch, transformers, cls, config)
    except Exception as exc:  # noqa: BLE001 - any failure to build means the check cannot run, said in a note
        return None, f"{cls.__name__} could not be built from {path} ({type(exc).__name__}: {str(exc)[:200]})"
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    return ExpectedModel(
        cls.__name__,
        path,
        shapes,
        _tied_names(model),
        getattr(model, "base_model_prefix", "") or "",
        _patterns(model, "_keys_to_ignore_on_load_missing"),
        _patterns(model, "_keys_to_ignore_on_load_unexpected"),
        base_only=not named,
    ), ""


def _base_model_class(transformers, model_type: str):
    try:
        config_class = transformers.CONFIG_MAPPING[model_type]
        return transformers.MODEL_MAPPING[config_class]
    except (KeyError, ValueError):
        return None


def _build_on_meta(torch, transformers, cls, config: dict):
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        hf_config = cls.config_class.from_dict(dict(config))
        hf_config._attn_implementation = "eager"  # the kernels are irrelevant on meta; flash-attn may be absent
        with torch.device("meta"):
            return cls(hf_config)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _tied_names(model) -> dict[str, str]:
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def _patterns(model, attribute: str) -> tuple[str, ...]:
    value = getattr(model, attribute, None) or ()
    return tuple(str(p) for p in value)


def match_names(names: list[str], expected: ExpectedModel) -> dict[str, str]:
    """{checkpoint name: the model's name for it}. A checkpoint of the base model (names without
    base_model_prefix) or of a model with a head given a base-model config is mapped the way
    transformers maps it on load; the mapping that matches most names is taken."""
    prefix = expected.prefix + "." if expected.prefix else ""
    candidates = [{n: n for n in names}]
    if prefix:
        candidates.append({n: n if n.startswith(prefix) else prefix + n for n in names})
        candidates.append({n: n[len(prefix) :] if n.startswith(prefix) else n for n in names})
    return max(candidates, key=lambda mapping: sum(v in expected.shapes for v in mapping.values()))


def check_against_model(
    shapes: dict[str, tuple[int, ...]], expected: ExpectedModel, allow_extra: bool, left_out: tuple[str, ...] = ()
) -> list[str]:
    """Refuse a merge that would not load as `expected` with every weight; notes about what was accepted.
    `left_out`: names the user asked to leave out (they may be missing)."""
    mapping = match_names(list(shapes) + list(left_out), expected)
    omitted = {mapping.pop(name) for name in left_out if name not in shapes}
    head = sorted(name for name, mapped in mapping.items() if expected.base_only and mapped not in expected.shapes)
    mapping = {name: mapped for name, mapped in mapping.items() if name not in head}
    present = set(mapping.values())
    missing = sorted(
        name
        for name in expected.shapes
        if name not in present
        and name not in omitted
        and expected.tied.get(name) not in present
        and not _ignored(name, expected.ignore_missing)
    )
    extra = sorted(
        name
        for name, mapped in mapping.items()
        if mapped not in expected.shapes and not _ignored(mapped, expected.ignore_unexpected)
    )
    wrong = [
        f"{name} {list(shapes[name])} (the model: {list(expected.shapes[mapped])})"
        for name, mapped in mapping.items()
        if mapped in expected.shapes and shapes[name] != expected.shapes[mapped]
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} weights missing ({_listed(missing)})")
    if wrong:
        problems.append(f"{len(wrong)} with the wrong shape ({_listed(wrong)})")
    if extra and not allow_extra:
        problems.append(f"{len(extra)} unexpected ({_listed(extra)})")
    if problems:
        hint = f"check that config.json describes the trained model ({option('config', meta='DIR')})"
        if extra and not missing and not wrong:
            hint += f", or pass {option('allow_extra_tensors', True)} to keep tensors the model class does not have (e.g. a value head)"
        raise ModelMismatch(
            f"the merged tensors do not match {expected.architecture} built from {expected.config_path}: "
            f"{'; '.join(problems)}; {hint}"
        )
    notes = [
        f"checked against {expected.architecture} built from {expected.config_path} on the meta device: "
        f"every weight present with the model's shape"
    ]
    if head:
        notes.append(
            f"{expected.config_path} has no 'architectures' field, so only the base model was checked; "
            f"{len(head)} tensors outside it were not ({_listed(head)}); add 'architectures' for the full check"
        )
    if extra:
        notes.append(
            f"kept {len(extra)} tensors {expected.architecture} does not have ({option('allow_extra_tensors', True)}): {_listed(extra)}"
        )
    renamed = sum(1 for name, mapped in mapping.items() if name != mapped)
    if renamed and not expected.base_only:
        notes.append(
            f"{renamed} names differ from the model's by its '{expected.prefix}.' prefix; transformers maps them on load"
        )
    return notes


def _ignored(name: str, patterns: tuple[str, ...]) -> bool:
    return any(re.search(pattern, name) for pattern in patterns)


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown + (f", ... {len(items) - SHOWN} more" if len(items) > SHOWN else "")
