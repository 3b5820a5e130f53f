"""The model-shape safety net: check a merge's names and shapes against the model config.json names.

A merge whose names or shapes differ from the model's would exit 0 and then load with random
weights (a missing tensor is initialised silently by transformers) or not load at all. So when
config.json is known and transformers is importable, the class it names is built on the meta
device (no memory, no weights, no code from the checkpoint: only classes transformers itself
ships; plan.model_build, in a child process, or read back from the cache of models built before,
plan.model_cache) and the merge's tensors are checked against its state dict before the output is
published. The same model tells which names transformers ties on load (written once).
"""

from __future__ import annotations

import re

from ..errors import ModelMismatch, option
from .expected_builds import start_build
from .expected_model import ExpectedModel

__all__ = ["ExpectedModel", "check_against_model", "load_expected_model", "match_names", "FROM_CACHE"]

SHOWN = 3  # names listed per kind of problem in the one-line error
FROM_CACHE = "the model's names, shapes and ties were read from the cache"  # a note's start (the report's)


def load_expected_model(
    config_dir: str | None, built: dict | None = None, *, transformers_version: str | None = None
) -> tuple[ExpectedModel | None, str]:
    """(the model config.json describes, "") or (None, why the check cannot run), waiting for it.

    `built`: the config.json a reader built (MergePlan.built_config), used when there is no config_dir.
    A config.json without `architectures` (saved from a bare config, not a model) names no head:
    the base model of its `model_type` is built instead, and only the tensors under it are checked.
    `transformers_version`: the version the cache key is made of (default: the installed one).
    """
    return start_build(config_dir, built, version=transformers_version).result()


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
    if expected.cached:
        notes.append(f"{FROM_CACHE} ({expected.cached}), built before from the same config.json bytes")
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
