"""The tensors transformers keeps in float32 when it casts a model: `_keep_in_fp32_modules(_strict)`.

`from_pretrained(dtype=bfloat16)` leaves the modules a class lists in `_keep_in_fp32_modules_strict`
in float32 (DeepSeek-V3's router `gate.weight` and `e_score_correction_bias`), and for float16 those
in `_keep_in_fp32_modules` too (gpt-oss's norms); `save_pretrained` then writes them so. A cast
merge does the same: each listed pattern is searched in the written name as transformers searches
it (its globs joined in one regular expression, `*` as `.*`; transformers 5.24
core_model_loading.build_glob_alternation, modeling_utils._get_dtype_plan).

The lists are read from the installed transformers' modeling source of the config's `model_type`
(its class bodies, parsed, never imported: the import costs seconds on every merge), and the model
check compares them with the lists of the class it builds (pipeline.model_check), so a list this
reading missed refuses the merge rather than writing it wrong.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re

STRICT = "_keep_in_fp32_modules_strict"  # kept for float16 and bfloat16
LOOSE = "_keep_in_fp32_modules"  # kept for float16 only


@functools.lru_cache(maxsize=16)  # the installed source does not change while a process runs
def kept_lists(model_type: str | None) -> dict[str, frozenset[str]] | None:
    """{STRICT: patterns, LOOSE: patterns} the model type's modeling source lists ({} of each: none);
    None when its source cannot be read this way (not found, or a list that is not a literal)."""
    source = _modeling_source(model_type)
    if source is None:
        return None
    found: dict[str, set[str]] = {STRICT: set(), LOOSE: set()}
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for statement in node.body:
            targets, value = _assigned(statement)
            for name in set(targets) & set(found):
                try:
                    listed = ast.literal_eval(value) if value is not None else None
                except ValueError:
                    return None
                if listed is None:
                    continue
                if not isinstance(listed, (list, tuple, set)) or not all(isinstance(p, str) for p in listed):
                    return None
                found[name].update(listed)
    return {name: frozenset(patterns) for name, patterns in found.items()}


def kept_patterns(lists: dict[str, frozenset[str]], dtype: str | None) -> frozenset[str]:
    """The patterns whose tensors stay float32 when the merge casts to `dtype` (a torch dtype name)."""
    if dtype == "float16":
        return lists[STRICT] | lists[LOOSE]
    if dtype == "bfloat16":
        return lists[STRICT]
    return frozenset()


def matcher(patterns: frozenset[str]):
    """name -> whether transformers keeps it in float32 (None for no pattern)."""
    if not patterns:
        return None
    alternation = re.compile("|".join(f"({p.replace('*', '.*')})" for p in sorted(patterns)))
    return lambda name: alternation.search(name) is not None


def _assigned(statement) -> tuple[list[str], ast.expr | None]:
    if isinstance(statement, ast.Assign):
        return [t.id for t in statement.targets if isinstance(t, ast.Name)], statement.value
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        return [statement.target.id], statement.value
    return [], None


def _modeling_source(model_type: str | None) -> str | None:
    if not model_type or not re.fullmatch(r"[a-z0-9_.-]+", model_type):
        return None
    model_type = model_type.replace("-", "_").replace(".", "_")  # the module folder: blip-2 is models/blip_2
    spec = importlib.util.find_spec("transformers")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "models", model_type, f"modeling_{model_type}.py")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None
