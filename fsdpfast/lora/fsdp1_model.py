"""A PEFT LoRA model inside FSDP1 flat parameters: the peft model, rebuilt on the meta device.

FSDP1 flattened the PeftModel, not the plain model: every adapted module holds `base_layer`
and, per adapter, lora_A / lora_B (DoRA's magnitude, lora_B's bias), and modules_to_save keeps
a trained copy beside the original. fsdp1_units needs that model's registration order, so it
is built as training built it: peft's own `get_peft_model` (then `add_adapter`) over the
meta-device transformers model, with one LoraConfig per adapter made from

- the names the rank files hold: the original parameters' views (use_orig_params=True, the
  setting peft's mix of frozen and trainable parameters needs in a decoder-layer unit) or the
  units of peft's `fsdp_auto_wrap_policy` (each trainable leaf, `...q_proj.lora_A.default`):
  the adapters in the order met, their modules (exact paths), DoRA, lora_B biases, copies;
- the ranks read off the views' sizes (numel(lora_A) * numel(lora_B) = r² * numel(weight), for
  Linear, Embedding and Conv alike); without views, recorded: --lora-r, a saved
  adapter_config.json, verl's lora_train_meta.json (lora.config looks in the same places);
- what else a saved adapter_config.json records that shapes the model (task_type,
  layers_to_transform, layer_replication...); where the files name no LoRA module, its
  target_modules.

No weight exists (meta device) and no initialisation runs; only peft's code runs, never the
checkpoint's. The units, sizes and every view's place are then checked against the files as
for a plain model, so a config that does not fit is refused, not merged.

The FSDP1 reader finds this module through its registry of trained-model wrappers
(readers.fsdp1_flat.WRAPPED_MODELS): matches, rebuild, leaf_units.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field

from ..errors import BadInput, ModelMismatch, option
from .config import CONFIG_NAME, META_NAME, config_folders, recorded_values, saved_config, source, train_meta
from .split import PREFIX, lora_role

# LoraConfig fields a saved adapter_config.json contributes: those that decide which modules get
# which LoRA parameters. Initialisation (loftq, eva, pissa...) is left out: it needs the weights.
_SHAPING = (
    "task_type",
    "r",
    "target_modules",
    "exclude_modules",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "use_dora",
    "lora_bias",
    "bias",
    "fan_in_fan_out",
    "modules_to_save",
    "layer_replication",
    "trainable_token_indices",
    "target_parameters",
    "ensure_weight_tying",
)
_SHAPES_RANKS = ("r", "rank_pattern")  # the recorded values the rebuilt model's shapes depend on
_FOUND_BY_NAME = ("exclude_modules", "layers_to_transform", "layers_pattern")  # exact module paths replace them


@dataclass
class _Named:
    """One adapter as the files' names show it."""

    modules: dict[str, dict[str, int | None]] = field(default_factory=dict)  # module -> {part: numel in the views}
    copies: list[str] = field(default_factory=list)  # modules_to_save


def matches(unit_paths, names) -> bool:
    """The files name a peft model: units or tensors under `base_model.model.` (PeftModel -> LoraModel -> the model)."""
    return any(str(name).startswith(PREFIX) for name in (*unit_paths, *names))


def leaf_units(model, unit_paths) -> set[str]:
    """Saved units that are leaf modules with a weight: those peft's fsdp_auto_wrap_policy made (it wraps every
    leaf whose weight is trainable); the files say which, so no requires_grad is guessed."""
    modules = dict(model.named_modules())
    return {
        path
        for path in unit_paths
        if path in modules
        and not any(True for _ in modules[path].children())
        and getattr(modules[path], "weight", None) is not None
    }


def rebuild(
    model, folder: str, config_dir: str | None, unit_paths: list[str], sizes: dict[str, int], lora_r: int | None
) -> tuple[object, list[str], list[dict]]:
    """(the PeftModel over `model` on the meta device, notes, each adapter's shaping config for `inspect`).

    `sizes`: the rank files' plain tensors (views, buffers) by name, their elements summed over the ranks.
    """
    peft, torch = _imports()
    weights = {name: p.numel() for name, p in model.named_parameters(remove_duplicate=False)}
    named = _named(sizes, unit_paths)
    meta, meta_path = train_meta(folder)
    folders = config_folders(folder, config_dir)
    order = list(named) or ["default"]
    configs, notes, shown = {}, [], []
    modules = dict(model.named_modules())
    for adapter in order:
        saved, saved_path = saved_config(folders, adapter)
        mine = adapter == "default" or len(order) == 1  # verl's meta is the one adapter's (as lora.config reads it)
        _check_modules(named.get(adapter), modules, adapter, model)
        recorded, where = recorded_values(  # lora_alpha (not needed here) is checked by lora.config, after
            adapter, folders, (meta, meta_path) if mine else ({}, None), lora_r, None, [], _SHAPES_RANKS
        )
        fields, how = _fields(
            folder,
            adapter,
            named.get(adapter),
            weights,
            saved,
            saved_path,
            (recorded, where),
            meta if mine else {},
            meta_path if mine else None,
            folders,
        )
        configs[adapter] = _lora_config(peft, fields, folder, adapter)
        shown.append(
            {
                "adapter": adapter,
                **{
                    k: fields.get(k)
                    for k in ("r", "rank_pattern", "target_modules", "use_dora", "lora_bias", "modules_to_save")
                },
                "source": how,
            }
        )
        targets = fields["target_modules"]
        what = f"{len(targets)} modules" if isinstance(targets, list) else f"target_modules {targets!r}"
        notes.append(
            f"PEFT adapter {adapter} rebuilt with peft {peft.__version__}'s get_peft_model: r {fields['r']}"
            + (f" ({len(fields['rank_pattern'])} modules otherwise)" if fields.get("rank_pattern") else "")
            + f", {what}{', DoRA' if fields.get('use_dora') else ''} ({how})"
        )
    try:  # peft and transformers warn about training matters (gradient checkpointing...): not this build's business
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            first = order[0]
            built = peft.get_peft_model(
                model, configs[first], adapter_name=first, autocast_adapter_dtype=False, low_cpu_mem_usage=True
            )
            for adapter in order[1:]:
                built.add_adapter(adapter, configs[adapter], low_cpu_mem_usage=True)
    except Exception as exc:  # peft refuses configs that do not fit the model in many ways
        raise BadInput(
            f"{folder}: peft cannot rebuild the trained PEFT model over {type(model).__name__} "
            f"({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    return built, notes, shown


def _lora_config(peft, fields: dict, folder: str, adapter: str):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return peft.LoraConfig(**fields)
    except (TypeError, ValueError) as exc:  # a saved adapter_config.json this peft does not accept
        raise BadInput(
            f"{folder}: peft {peft.__version__} refuses adapter {adapter}'s LoraConfig "
            f"({type(exc).__name__}: {str(exc)[:200]})"
        ) from None


def _imports():
    try:
        import peft
        import torch
    except ImportError:
        raise BadInput(
            "FSDP1 flat parameters of a PEFT model: fsdpfast rebuilds the peft model to unflatten them, "
            "which needs peft: pip install peft"
        ) from None
    return peft, torch


def _named(sizes: dict[str, int], unit_paths: list[str]) -> dict[str, _Named]:
    """Each adapter's modules and copies, in the order the files name them (the order peft added the adapters)."""
    found: dict[str, _Named] = {}
    names = list(sizes.items()) + [(f"{path}.weight", None) for path in unit_paths]  # a leaf unit: its module's weight
    for name, numel in names:
        role, adapter, module, part = lora_role(name)
        if role == "base":
            continue
        entry = found.setdefault(adapter, _Named())
        if role == "copy":
            if module not in entry.copies:
                entry.copies.append(module)
            continue
        entry.modules.setdefault(module, {}).setdefault(part, numel)  # a view's size wins over a unit's None
    return found


def _check_modules(named: _Named | None, modules: dict, adapter: str, model) -> None:
    """An adapter the files name for a module the model lacks is refused here, naming it: peft's own refusal
    (target modules not found) would list the patterns, not the module."""
    lacking = [m for m in (*named.modules, *named.copies) if m not in modules] if named else []
    if lacking:
        more = f" (and {len(lacking) - 1} more)" if len(lacking) > 1 else ""
        raise ModelMismatch(
            f"adapter {adapter}: the rank files hold LoRA tensors for {lacking[0]}{more}, a module "
            f"{type(model).__name__} built from config.json does not have; the adapter is not this model's: check "
            f"that config.json describes the model it was trained on ({option('config', meta='DIR')})"
        )


def _fields(
    folder, adapter, named: _Named | None, weights, saved, saved_path, recorded, meta, meta_path, folders
) -> tuple[dict, str]:
    """The LoraConfig arguments of one adapter, and where they came from."""
    fields = {key: saved[key] for key in _SHAPING if key in saved}
    sources = []
    if meta and "task_type" not in fields and meta.get("task_type"):
        fields["task_type"] = meta["task_type"]
    if named and named.modules:
        for key in _FOUND_BY_NAME:
            fields.pop(key, None)
        fields["target_modules"] = sorted(named.modules)
        fields["use_dora"] = any("lora_magnitude_vector" in parts for parts in named.modules.values())
        if any(numel is not None for parts in named.modules.values() for numel in parts.values()):
            fields["lora_bias"] = any("lora_B_bias" in parts for parts in named.modules.values())  # views show biases
        fields["modules_to_save"] = named.copies or fields.get("modules_to_save")
        sources.append("modules named by the rank files")
    elif "target_modules" not in fields:
        raise BadInput(
            f"{folder}: FSDP1 flat parameters of a PEFT model, which fsdpfast rebuilds to unflatten them, but the "
            f"files name none of adapter {adapter}'s LoRA modules (no parameter views: use_orig_params=False) and "
            f"{_looked(folders, meta, meta_path)}: put the training's {CONFIG_NAME} (peft's save_pretrained) beside "
            "the rank files"
        )
    ranks = {m: _rank(parts, weights.get(f"{m}.weight")) for m, parts in (named.modules.items() if named else ())}
    if ranks and all(ranks.values()):
        r = Counter(ranks.values()).most_common(1)[0][0]
        fields["rank_pattern"] = {re.escape(m): k for m, k in ranks.items() if k != r}
        sources.append("ranks read off the parameter views' sizes")
    else:
        r, origin = _recorded_rank(*recorded)
        if r is None:
            raise BadInput(
                f"{folder}: FSDP1 flat parameters of a PEFT model, which fsdpfast rebuilds to unflatten them, but "
                f"the files do not hold adapter {adapter}'s LoRA rank (no parameter views: use_orig_params=False) "
                f"and {_looked(folders, meta, meta_path)}: pass {option('lora_r', meta='R')} (the training's "
                f"LoraConfig r), or put its {CONFIG_NAME} beside the rank files"
            )
        sources.append(f"r from {origin}")
    if saved_path:
        sources.append(f"{'the rest' if sources else 'all'} from {saved_path}")
    fields.update(r=r, init_lora_weights=False, inference_mode=False)
    return fields, "; ".join(sources)


def _rank(parts: dict[str, int | None], weight: int | None) -> int | None:
    """r from the views: lora_A holds r x fan-in, lora_B fan-out x r, the weight fan-out x fan-in."""
    a = parts.get("lora_A", parts.get("lora_embedding_A"))
    b = parts.get("lora_B", parts.get("lora_embedding_B"))
    if not a or not b or not weight or (a * b) % weight:
        return None
    r = math.isqrt(a * b // weight)
    return r if r * r * weight == a * b else None


def _recorded_rank(recorded: dict, where: dict) -> tuple[int | None, str | None]:
    """r as --lora-r, adapter_config.json or lora_train_meta.json records it (lora.config: files that disagree
    are refused), and where it came from."""
    r = recorded.get("r")
    if r is None:
        return None, None
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise BadInput(f"{source(where, 'r')}: r {r!r} is not a positive whole number")
    return r, os.path.basename(where["r"])


def _looked(folders: list[str], meta: dict, meta_path: str | None) -> str:
    """What was found of the adapter's config, for a refusal."""
    where = ", ".join(dict.fromkeys(folders))
    if not meta_path:
        return f"there is no {CONFIG_NAME} (looked in {where}) and no {META_NAME}"
    recorded = ", ".join(f"{k} {meta[k]}" for k in ("r", "lora_alpha", "task_type") if k in meta) or "nothing"
    return f"there is no {CONFIG_NAME} (looked in {where}); {meta_path} records only {recorded}"
