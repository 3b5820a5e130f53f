"""Each adapter's adapter_config.json: from what the checkpoint records, the flags, and the tensors.

Recorded values, highest first: `--lora-r` / `--lora-alpha` (for every adapter); a saved
adapter_config.json (peft's own: `DIR/adapter_config.json` for the `default` adapter,
`DIR/<name>/adapter_config.json` for another, DIR being the checkpoint folder, its
`huggingface/` or `lora_adapter/`, or --config); verl's `lora_train_meta.json` (`r`,
`lora_alpha`, `task_type`; beside the rank files or one folder up) for the default or only
adapter. Read off the tensors: every module's rank, the target modules, DoRA, lora_bias,
modules_to_save. What was inferred, and from what, is said in one note per adapter. A missing
lora_alpha is recorded as a problem (an error when the adapter is written or fused), never a
silent 0: verl records 0 when alpha was not set.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from dataclasses import replace

from ..errors import BadInput, option
from ..hf.config import load_config
from .split import ADAPTER_ROOT, AdapterPlan, LoraModule

META_NAME = "lora_train_meta.json"  # verl
CONFIG_NAME = "adapter_config.json"  # peft
_TASKS = {
    "ForCausalLM": "CAUSAL_LM",
    "ForSequenceClassification": "SEQ_CLS",
    "ForTokenClassification": "TOKEN_CLS",
    "ForQuestionAnswering": "QUESTION_ANS",
    "ForSeq2SeqLM": "SEQ_2_SEQ_LM",
    "Model": "FEATURE_EXTRACTION",
}


def resolve(
    adapters: list[AdapterPlan],
    folder: str,
    config_dir: str | None,
    lora_alpha: float | None,
    lora_r: int | None,
    notes: list[str],
) -> list[AdapterPlan]:
    """Each adapter with its `config` (and `problems`); one note per adapter says where each value came from."""
    meta, meta_path = train_meta(folder)
    architecture = _architecture(config_dir)
    folders = config_folders(folder, config_dir)
    resolved = []
    for adapter in adapters:
        mine = adapter.name == "default" or len(adapters) == 1  # verl's meta is the one adapter's
        recorded, where = recorded_values(
            adapter.name, folders, (meta, meta_path) if mine else ({}, None), lora_r, lora_alpha, notes
        )
        origin = {key: os.path.basename(path) for key, path in where.items()}
        problems: list[str] = []
        config = _config(adapter, recorded, origin, where, architecture, problems)
        resolved.append(replace(adapter, config=config, problems=(*adapter.problems, *problems)))
        notes.append(f"LoRA adapter {adapter.name} -> {adapter.folder}: {_origins(config, origin)}")
    return resolved


# Values that decide the adapter's bytes or its scaling: every file that records one must record the same.
_AGREED = ("r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora", "fan_in_fan_out")
_META_KEYS = ("r", "lora_alpha", "task_type")  # what verl's lora_train_meta.json records
_FLAGS = {"r": ("lora_r", "R"), "lora_alpha": ("lora_alpha", "A")}


def recorded_values(
    adapter: str,
    folders: list[str],
    meta: tuple[dict, str | None],
    lora_r,
    lora_alpha,
    notes: list[str],
    agreed: tuple[str, ...] = _AGREED,
) -> tuple[dict, dict[str, str]]:
    """(what is recorded for `adapter`, the file path or flag each value came from).

    Every adapter_config.json found for it (peft's; see config_folders) and verl's lora_train_meta.json
    (`meta`: its values and path, or ({}, None)) must agree on the values in _AGREED; a contradiction is
    refused naming both, unless --lora-r / --lora-alpha gives that value (then a note says what it replaced).
    `agreed`: the values checked (a reader that rebuilds the model checks those that shape it).
    """
    flags = {"r": lora_r, "lora_alpha": lora_alpha}
    records = [(path, config) for path, config in saved_configs(folders, adapter)]
    meta_values, meta_path = meta
    if meta_path:  # verl records lora_alpha 0 when it was not set: that is no value to contradict
        kept = {k: meta_values[k] for k in _META_KEYS if k in meta_values}
        if kept.get("lora_alpha") == 0 and any("lora_alpha" in config for _, config in records):
            kept.pop("lora_alpha")
        records.append((meta_path, kept))
    recorded: dict = {}
    where: dict[str, str] = {}
    for path, config in records:
        for key, value in config.items():
            if key not in recorded:
                recorded[key], where[key] = value, path
            elif key in agreed and recorded[key] != value and flags.get(key) is None:
                raise BadInput(_contradiction(adapter, key, (recorded[key], where[key]), (value, path)))
    for key, value in flags.items():
        if value is None:
            continue
        flag = "--" + _FLAGS[key][0].replace("_", "-")
        replaced = [f"{key} {c[key]} of {os.path.basename(p)}" for p, c in records if key in c and c[key] != value]
        if replaced:
            notes.append(f"adapter {adapter}: {flag} {value} replaces {', '.join(dict.fromkeys(replaced))}")
        recorded[key], where[key] = value, flag
    return recorded, where


def source(where: dict[str, str], key: str) -> str:
    """Where `key` was recorded, for a message: the file's path, or the option as the user gave it."""
    found = where.get(key, key)
    return option(_FLAGS[key][0]) if found.startswith("--") and key in _FLAGS else found


def _contradiction(adapter: str, key: str, first: tuple, second: tuple) -> str:
    settle = (
        f"give the training's value with {option(_FLAGS[key][0], meta=_FLAGS[key][1])}"
        if key in _FLAGS
        else "remove or correct the file that is not this training's"
    )
    return (
        f"adapter {adapter}: {first[1]} records {key} {_shown(first[0])} but {second[1]} records "
        f"{key} {_shown(second[0])}; {settle}"
    )


def scaling(config: dict, module: LoraModule) -> float:
    """peft's scaling of one module: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (Python floats, as peft)."""
    alpha = pattern_value(config.get("alpha_pattern") or {}, module.module, config["lora_alpha"])
    return alpha / math.sqrt(module.rank) if config.get("use_rslora") else alpha / module.rank


def pattern_value(patterns: dict, module: str, default):
    """peft's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module name."""
    for key, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error:
            raise BadInput(f"{key!r} in a rank_pattern or alpha_pattern is not a regular expression") from None
    return default


def _config(
    adapter: AdapterPlan, recorded: dict, origin: dict, where: dict, architecture: str | None, problems: list[str]
) -> dict:
    """adapter_config.json from what is recorded (`where`: each value's file or flag) and the tensors."""
    config = dict(recorded)
    modules = list(adapter.modules.values())
    ranks = {m.module: m.rank for m in modules}
    config["peft_type"] = "LORA"
    if recorded.get("peft_type", "LORA") != "LORA":
        raise BadInput(
            f"{source(where, 'peft_type')}: peft_type {recorded['peft_type']!r} for adapter {adapter.name}, "
            "whose tensors are LoRA's"
        )
    if recorded.get("target_parameters"):  # peft's LoRA on bare parameters (MoE experts): lora_A is not [r, in]
        raise BadInput(
            f"{source(where, 'target_parameters')}: adapter {adapter.name} records target_parameters "
            f"{_shown(recorded['target_parameters'])[:80]}: LoRA on parameters (peft's ParamWrapper) is not "
            "merged by fsdpfast; merge the base weights without it, or fuse with peft's merge_and_unload"
        )
    r = _whole(recorded.get("r"), "r", where)
    pattern = _pattern(recorded.get("rank_pattern"), where, "rank_pattern")
    if r is None:  # nothing records r: the most common rank, the others in rank_pattern
        r = Counter(ranks.values()).most_common(1)[0][0] if ranks else 0
        origin["r"] = "from the lora_A shapes"
        wrong = {name: rank for name, rank in ranks.items() if pattern_value(pattern, name, r) != rank}
        if wrong:
            pattern.update(wrong)
            origin["rank_pattern"] = f"{len(wrong)} modules' ranks from the lora_A shapes"
    else:
        _check_ranks(adapter, r, pattern, where)
    config["r"], config["rank_pattern"] = r, pattern
    alpha = recorded.get("lora_alpha")
    if alpha is None or isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        said = (
            f"{origin['lora_alpha']} records lora_alpha {alpha!r}"
            if "lora_alpha" in origin
            else "no lora_alpha is recorded"
        )
        problems.append(
            f"adapter {adapter.name}: {said} (verl records 0 when it was not set): give the training's --lora-alpha"
        )
        config["lora_alpha"] = None
        origin["lora_alpha"] = "missing"
    else:
        config["lora_alpha"] = alpha
    config["alpha_pattern"] = _pattern(recorded.get("alpha_pattern"), where, "alpha_pattern")
    targets = recorded.get("target_modules")
    if not _targets_cover(targets, [m.module for m in modules]):
        if targets is not None:
            origin["target_modules"] = f"from the tensors; {origin['target_modules']} named {_shown(targets)}"
        else:
            origin["target_modules"] = "from the tensors"
        targets = sorted({m.module.rsplit(".", 1)[-1] for m in modules})
    config["target_modules"] = sorted(targets) if isinstance(targets, (list, tuple, set)) else targets
    task = recorded.get("task_type")
    if task is None and architecture:
        task = next((t for suffix, t in _TASKS.items() if architecture.endswith(suffix)), None)
        if task:
            origin["task_type"] = f"from config.json's {architecture}"
    config["task_type"] = task
    for key, found in (
        ("use_dora", any(m.magnitude is not None for m in modules)),
        ("lora_bias", any(m.lora_bias is not None for m in modules)),
    ):
        if recorded.get(key, found) != found:
            origin[key] = f"from the tensors; {origin[key]} said {recorded[key]}"
        elif found and key not in origin:
            origin[key] = "from the tensors"
        config[key] = found
    copies = sorted({name.rsplit(".", 1)[0].rsplit(".", 1)[-1] for name in adapter.copies})
    config["modules_to_save"] = recorded.get("modules_to_save") or (copies or None)
    for key in ("use_rslora", "fan_in_fan_out"):  # the tensors cannot show these: peft's defaults, said in the note
        if key not in config:
            config[key], origin[key] = False, "not recorded: peft's default"
    config.setdefault("bias", "none")
    config.setdefault("lora_dropout", 0.0)
    config.setdefault("base_model_name_or_path", None)
    config["inference_mode"] = True
    return config


def _whole(value, key: str, where: dict) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadInput(f"{source(where, key)}: {key} {value!r} is not a positive whole number")
    return value


def _pattern(value, where: dict, key: str) -> dict:
    """A recorded rank_pattern or alpha_pattern: module name patterns (peft's regular expressions) -> positive
    whole ranks, or positive alphas."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadInput(f"{source(where, key)}: {key} {_shown(value)[:80]} is not an object")
    number = (int,) if key == "rank_pattern" else (int, float)
    for name, given in value.items():
        if isinstance(given, bool) or not isinstance(given, number) or given <= 0:
            what = "whole number" if key == "rank_pattern" else "number"
            raise BadInput(f"{source(where, key)}: {key} {name[:80]!r}: {given!r} is not a positive {what}")
    return dict(value)


def _check_ranks(adapter: AdapterPlan, r: int, pattern: dict, where: dict) -> None:
    """Refuse a recorded r (and rank_pattern) that another rank of a module's lora_A contradicts: the tensors
    are the trained adapter, so the record is another training's (and its lora_alpha is not to be trusted)."""
    wrong = [(m, pattern_value(pattern, m.module, r)) for m in adapter.modules.values()]
    wrong = [(m, said) for m, said in wrong if said != m.rank]
    if not wrong:
        return
    module, said = wrong[0]
    by = "rank_pattern" if pattern_value(pattern, module.module, None) is not None else "r"
    more = f" ({len(wrong)} of {len(adapter.modules)} modules differ)" if len(wrong) > 1 else ""
    ranks = Counter(m.rank for m in adapter.modules.values())
    common = ranks.most_common(1)[0][0]
    if by == "r" and all(pattern_value(pattern, m.module, common) == m.rank for m in adapter.modules.values()):
        settle = f"give {option('lora_r', common)} if that file is this training's, else correct or remove it"
        if where.get("r", "").startswith("--"):
            settle = f"give {option('lora_r', common)} or leave it out"
    else:
        settle = f"correct or remove {source(where, by)}"
    raise BadInput(
        f"adapter {adapter.name}: {source(where, by)} gives {module.module} rank {said} ({by}), but its lora_A is "
        f"{list(module.lora_A.shape)} (rank {module.rank}){more}; {settle}"
    )


def _targets_cover(targets, modules: list[str]) -> bool:
    """peft's target matching: a string is a full-match regex; a list matches a name or its last components."""
    if targets is None:
        return False
    if isinstance(targets, str):
        return all(re.fullmatch(targets, m) for m in modules)
    if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
        return False
    return all(m in targets or any(m.endswith(f".{t}") for t in targets) for m in modules)


def config_folders(folder: str, config_dir: str | None) -> list[str]:
    """Where a saved adapter_config.json is looked for, in order."""
    return [folder, os.path.join(folder, "huggingface"), os.path.join(folder, ADAPTER_ROOT)] + (
        [config_dir] if config_dir else []
    )


def saved_config(folders: list[str], adapter: str) -> tuple[dict, str | None]:
    """peft's adapter_config.json of `adapter` in the first of `folders` that has one, and its path."""
    found = saved_configs(folders, adapter)
    return (found[0][1], found[0][0]) if found else ({}, None)


def saved_configs(folders: list[str], adapter: str) -> list[tuple[str, dict]]:
    """Every adapter_config.json of `adapter` in `folders`, in their order, each file once: (path, its values)."""
    found, seen = [], set()
    for folder in folders:
        path = os.path.join(folder, CONFIG_NAME) if adapter == "default" else os.path.join(folder, adapter, CONFIG_NAME)
        if os.path.isfile(path) and os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            found.append((path, load_config(path)))
    return found


def train_meta(folder: str) -> tuple[dict, str | None]:
    """verl's lora_train_meta.json beside the rank files or one folder up, and its path."""
    for place in (folder, os.path.dirname(os.path.abspath(folder))):
        path = os.path.join(place, META_NAME)
        if os.path.isfile(path):
            return load_config(path), path
    return {}, None


def _architecture(config_dir: str | None) -> str | None:
    path = os.path.join(config_dir, "config.json") if config_dir else None
    if not path or not os.path.isfile(path):
        return None
    names = load_config(path).get("architectures") or []
    return names[0] if isinstance(names, list) and names and isinstance(names[0], str) else None


_SHOWN = (
    "r",
    "lora_alpha",
    "task_type",
    "target_modules",
    "rank_pattern",
    "use_dora",
    "use_rslora",
    "fan_in_fan_out",
    "lora_bias",
    "modules_to_save",
)


def _origins(config: dict, origin: dict) -> str:
    """`r 8, lora_alpha 16 (lora_train_meta.json); target_modules [...] (from the tensors)`: values grouped by source."""
    groups: dict[str, list[str]] = {}
    for key in _SHOWN:
        if key in origin and (config.get(key) not in (None, {}, False) or not origin[key].endswith(".json")):
            groups.setdefault(origin[key], []).append(f"{key} {_shown(config.get(key))}")
    return "; ".join(f"{', '.join(values)} ({how})" for how, values in groups.items())


def _shown(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else value
