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

from ..configs import load_config
from ..errors import BadInput
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
) -> None:
    """Fill every adapter's `config` (and `problems`); one note per adapter says where each value came from."""
    meta, meta_path = train_meta(folder)
    architecture = _architecture(config_dir)
    for adapter in adapters:
        saved, saved_path = saved_config(config_folders(folder, config_dir), adapter.name)
        recorded: dict = dict(saved)
        origin = {key: os.path.basename(saved_path) for key in saved}
        if meta and (adapter.name == "default" or len(adapters) == 1):
            for key in ("r", "lora_alpha", "task_type"):
                if key in meta and key not in recorded:
                    recorded[key], origin[key] = meta[key], META_NAME
        for key, flag, value in (("r", "--lora-r", lora_r), ("lora_alpha", "--lora-alpha", lora_alpha)):
            if value is not None:
                if key in recorded and recorded[key] != value:
                    notes.append(
                        f"adapter {adapter.name}: {flag} {value} replaces {key} {recorded[key]} of {origin[key]}"
                    )
                recorded[key], origin[key] = value, flag
        adapter.config = _config(adapter, recorded, origin, architecture, saved_path or meta_path)
        notes.append(f"LoRA adapter {adapter.name} -> {adapter.folder}: {_origins(adapter.config, origin)}")


def scaling(config: dict, module: LoraModule) -> float:
    """peft's scaling of one module: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (Python floats, as peft)."""
    alpha = pattern_value(config.get("alpha_pattern") or {}, module.module, config["lora_alpha"])
    return alpha / math.sqrt(module.rank) if config.get("use_rslora") else alpha / module.rank


def pattern_value(patterns: dict, module: str, default):
    """peft's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _config(adapter: AdapterPlan, recorded: dict, origin: dict, architecture: str | None, source: str | None) -> dict:
    config = dict(recorded)
    where = f"adapter {adapter.name}"
    modules = list(adapter.modules.values())
    ranks = {m.module: m.rank for m in modules}
    config["peft_type"] = "LORA"
    if recorded.get("peft_type", "LORA") != "LORA":
        raise BadInput(f"{source}: peft_type {recorded['peft_type']!r} for {where}, whose tensors are LoRA's")
    r = _whole(recorded.get("r"), "r", origin)
    if r is None:
        r = Counter(ranks.values()).most_common(1)[0][0] if ranks else 0
        origin["r"] = "from the lora_A shapes"
    pattern = dict(recorded.get("rank_pattern") or {})
    wrong = {name: rank for name, rank in ranks.items() if pattern_value(pattern, name, r) != rank}
    if wrong and len(set(ranks.values())) == 1:  # one rank everywhere: the record is wrong, the tensors are not
        origin["r"] = f"from the lora_A shapes; {origin['r']} said {r}"
        r, wrong = next(iter(ranks.values())), {}
    if wrong:
        pattern.update(wrong)
        origin["rank_pattern"] = f"{len(wrong)} modules' ranks from the lora_A shapes"
    config["r"], config["rank_pattern"] = r, pattern
    alpha = recorded.get("lora_alpha")
    if alpha is None or isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        said = (
            f"{origin['lora_alpha']} records lora_alpha {alpha!r}"
            if "lora_alpha" in origin
            else "no lora_alpha is recorded"
        )
        adapter.problems.append(
            f"{where}: {said} (verl records 0 when it was not set): give the training's --lora-alpha"
        )
        config["lora_alpha"] = None
        origin["lora_alpha"] = "missing"
    else:
        config["lora_alpha"] = alpha
    config["alpha_pattern"] = dict(recorded.get("alpha_pattern") or {})
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


def _whole(value, key: str, origin: dict) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadInput(f"{origin.get(key, key)}: {key} {value!r} is not a positive whole number")
    return value


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
    for folder in folders:
        path = os.path.join(folder, CONFIG_NAME) if adapter == "default" else os.path.join(folder, adapter, CONFIG_NAME)
        if os.path.isfile(path):
            return load_config(path), path
    return {}, None


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
