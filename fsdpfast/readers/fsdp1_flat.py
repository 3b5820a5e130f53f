"""FSDP1 LOCAL_STATE_DICT rank files: one flat parameter per FSDP unit per rank.

Each rank's `torch.save(model.state_dict())` under `StateDictType.LOCAL_STATE_DICT` holds, per
unit, `<unit path>._flat_param`: a ShardedTensor whose global size is the unit's flat
parameter (all its parameters, flattened and concatenated) and whose one local shard is this
rank's `torch.chunk` piece without the padding to the world size. With `use_orig_params=True`
FSDP1 also pads every parameter to a 16-byte boundary (of the compute dtype) and the whole
flat parameter to a multiple of the world size, and saves the original parameters' sharded
views beside it. Buffers are plain tensors every rank holds whole.

What is not saved is which parameters a flat parameter holds: readers.fsdp1_units rebuilds
that from config.json, the wrap classes and the locally installed transformers' model class.
The units and every size are checked against what the files record; the order of same-shaped
parameters cannot be (it is the model class's registration order), so it is reported (plan
notes, `inspect`, the manifest's layout_options) with the transformers version it came from.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from math import prod
from typing import Any

from .._parsing.safe_load import Record, ShardedTensorRef, TensorRef, as_dims, safe_unpickle
from .._parsing.torch_zip import TorchZip
from ..dtypes import DTYPES, itemsize
from ..errors import BadInput, option
from ..geometry.flat_runs import FlatRuns
from ..geometry.placements import chunk_span
from ..plan.model import MergePlan, TensorPlan
from .discover import complete_ranks
from .rank_files import RankState, load_rank_states, plan_replicated
from .reader import Reader, ReaderOption
from .storage_sources import StorageSources

NAME = "fsdp1-flat"
DESCRIPTION = (
    "pytorch_model_fsdp_rank{r}.bin (or other *rank{r}.pt/.bin files holding *_flat_param): FSDP1 LOCAL_STATE_DICT"
)
FLAT_PARAM = "_flat_param"
_ACCELERATE = (
    "pytorch_model_fsdp_rank",
    "bin",
)  # accelerate's LOCAL_STATE_DICT file names: pytorch_model_fsdp_rank{r}.bin
_RANK_FILE = re.compile(r"(.*?rank_?)(\d+)\.(bin|pt|pth)")
_WRAPPERS = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}
_ALIGNMENT_BYTES = 16  # FSDP1 aligns each parameter of a use_orig_params flat parameter to 16 bytes
# Modules that rebuild a model FSDP1 flattened as another library wrapped it for training (peft's
# PeftModel), each with matches(unit_paths, names), rebuild(...) and leaf_units(model, unit_paths).
# Named, not imported, so that the readers name no feature (as pipeline.plan.TRANSFORMS).
WRAPPED_MODELS = ("fsdpfast.lora.fsdp1_model",)


def matches(folder: str) -> bool:
    return bool(_families(folder))


def read(
    folder: str,
    wrap=None,
    use_orig_params: bool | None = None,
    config: str | None = None,
    order_from: str | None = None,
    lora_r: int | None = None,
) -> MergePlan:
    """`order_from`: the transformers version and class a merge took the parameter order from
    (recorded in its manifest; verify --against passes it back, and the plan notes a difference).
    `lora_r` (--lora-r): a PEFT model's LoRA rank where the files do not show it (lora.fsdp1_model)."""
    families = _families(folder)
    if len(families) > 1:
        shown = ", ".join(f"{stem}*.{ext}" for stem, ext in families)
        raise BadInput(f"{folder}: rank files of several FSDP1 checkpoints ({shown}); move all but one elsewhere")
    (stem, ext), ranks = next(iter(families.items()))
    first = ranks[min(ranks)]
    whole = _unpickled(first)
    world = _recorded_world(whole, first)
    states = load_rank_states(
        complete_ranks(folder, ranks, world, lambda r: f"{stem}{r}.{ext}"),
        _model_part,
        sharded_tensors=True,
        unpickled={first: whole},
    )
    try:
        return _plan(folder, states, world, wrap, use_orig_params, config, order_from, lora_r)
    finally:
        for state in states:
            state.archive.close()


# ---- finding the files --------------------------------------------------------------------


def _families(folder: str) -> dict[tuple[str, str], dict[int, str]]:
    """{(stem, extension): {rank: path}} of the rank-file families that hold flat parameters.

    accelerate's names are taken by name alone; any other `*rank{r}` family counts only when
    its lowest rank's pickle holds `_flat_param` entries (so a truncated accelerate file still
    reaches the reader and its clear error, and other layouts' files are not claimed). Only a
    pickle whose bytes name `_flat_param` at all is unpickled, and that once per process.
    """
    found: dict[tuple[str, str], dict[int, str]] = {}
    for entry in sorted(os.listdir(folder)):
        match = _RANK_FILE.fullmatch(entry)
        if match and os.path.isfile(os.path.join(folder, entry)):
            found.setdefault((match.group(1), match.group(3)), {})[int(match.group(2))] = os.path.join(folder, entry)
    return {key: ranks for key, ranks in found.items() if key == _ACCELERATE or _holds_flat_params(ranks[min(ranks)])}


def _holds_flat_params(path: str) -> bool:
    try:
        return bool(_flat_entries(_model_part(_unpickled(path), path)))
    except Exception:  # unreadable files are some other layout's business
        return False


_UNPICKLED: dict[str, tuple[bytes, Any]] = {}  # the last rank file unpickled: path -> (its pickle, the object)


def _unpickled(path: str) -> Any:
    """A rank file's unpickled object; detection and reading share it, so rank 0 is unpickled once.

    The pickle bytes are read each time (cheap) and must equal the cached ones, so a file
    rewritten in between is unpickled again. A pickle that never names _flat_param is answered
    with an empty dict unread (other layouts' rank files, e.g. verl's, pass through detection).
    """
    with TorchZip(path) as archive:
        data = archive.pickle_bytes
    cached = _UNPICKLED.get(path)
    if cached is not None and cached[0] == data:
        return cached[1]
    whole = safe_unpickle(data, path) if FLAT_PARAM.encode() in data else {}
    _UNPICKLED.clear()  # keep one: plans of many checkpoints in one process must not pile up
    _UNPICKLED[path] = (data, whole)
    return whole


def _model_part(whole, path: str) -> dict:
    if isinstance(whole, dict) and not _flat_entries(whole):
        for key in ("model", "state_dict", "module"):
            if isinstance(whole.get(key), dict) and _flat_entries(whole[key]):
                return whole[key]
    if not isinstance(whole, dict):
        raise BadInput(f"{path}: holds a {type(whole).__name__}, not a state dict")
    return whole


def _flat_entries(state_dict: dict) -> dict[str, str]:
    """{key: unit path} of the flat parameters in a state dict (wrapper names removed)."""
    out = {}
    for key in state_dict:
        key = str(key)
        if key == FLAT_PARAM or key.endswith("." + FLAT_PARAM):
            out[key] = ".".join(p for p in key.split(".")[:-1] if p not in _WRAPPERS)
    return out


def _recorded_world(whole, path: str) -> int:
    """The world size the lowest rank's ShardedTensors record (their process group's size)."""
    state_dict = _model_part(whole, path)
    for key in _flat_entries(state_dict):
        value = state_dict[key]
        if isinstance(value, ShardedTensorRef):
            group = _process_group(value, path, key)
            return group["local_world_size"]
    raise BadInput(f"{path}: holds no flat parameters saved by FSDP1 (ShardedTensors named *{FLAT_PARAM})")


def _process_group(value: ShardedTensorRef, path: str, key: str) -> dict:
    group = value.state[2] if len(value.state) > 2 else None
    fields = ("local_rank", "global_rank", "local_world_size", "global_world_size")
    if not isinstance(group, Record) or not all(isinstance(group.get(f), int) for f in fields):
        raise BadInput(f"{path}: {key} does not record its process group; not a ShardedTensor saved by FSDP1")
    info = {f: group.get(f) for f in fields}
    if info["local_world_size"] != info["global_world_size"]:
        raise BadInput(
            f"{path}: {key} was saved by a shard group of {info['local_world_size']} ranks in a world of "
            f"{info['global_world_size']} (HYBRID_SHARD); not supported yet"
        )
    return info


# ---- the plan -----------------------------------------------------------------------------


@dataclass
class _FlatParam:
    key: str  # the state-dict key in rank 0's file
    path: str  # the unit's module path
    size: int  # the ShardedTensor's global numel
    dtype: str
    shards: list[tuple[RankState, TensorRef | None]]  # per rank, its local piece (None: holds none)


def _plan(
    folder: str, states: list[RankState], world: int, wrap, use_orig_params, config, order_from, lora_r
) -> MergePlan:
    flats = _read_flat_params(states, world)
    config_dir = _config_dir(folder, config)
    from . import fsdp1_units  # torch and transformers, for this layout only

    model, arch = fsdp1_units.meta_model(config_dir)
    wrap_names = _wrap_list(wrap)
    wrap_given = wrap_names is not None
    wrap_names = fsdp1_units.default_wrap(model) if wrap_names is None else wrap_names
    model, leaves, peft_notes, peft_assumed = _as_trained(model, folder, config_dir, flats, states, lora_r)
    units = {u.path: u for u in fsdp1_units.units(model, wrap_names, leaves)}
    _check_units(folder, flats, units, model, arch, wrap_names, fsdp1_units)
    flats = {path: flats[path] for path in units}  # in the order FSDP1 built the units
    views = _original_views(states, units)
    if views and use_orig_params is False:
        raise BadInput(
            f"{states[0].path}: holds the original parameters' views ({next(iter(views))}, ...), which FSDP1 saves "
            f"only with use_orig_params=True; drop {option('use_orig_params', False)}"
        )
    if views:
        use_orig_params = True
    lora_hint = (
        (
            f"; or, the model being a PEFT model, its LoRA config ({'; '.join(a['source'] for a in peft_assumed)}; "
            f"the rank: {option('lora_r', meta='R')})"
        )
        if peft_assumed
        else ""
    )
    align, how = _alignment(flats, units, world, use_orig_params, arch, wrap_names, views, lora_hint)
    layouts = {path: flat_layout(units[path], align, world)[0] for path in flats}
    _check_views(views, flats, layouts, world)
    sources = StorageSources()
    tensors: list[TensorPlan] = []
    for path, flat in flats.items():
        runs = _flat_runs(flat, sources)
        for param, offset in layouts[path]:
            extents = runs.extents(offset, prod(param.shape), 0)
            for name in (param.name, *param.aliases):
                tensors.append(TensorPlan(name, param.shape, flat.dtype, flat.dtype, list(extents)))
    tensors += _buffers(states, views, sources)
    order = {name: i for i, name in enumerate(model.state_dict())}  # write in the model's own order
    tensors.sort(key=lambda t: order.get(t.name, len(order)))
    plan = MergePlan(NAME, world, sources.buffers, tensors, config_dir=config_dir)
    unit_word = "unit" if len(flats) == 1 else "units"
    source = option("wrap") if wrap_given else "default: the model's _no_split_modules"
    leaf_note = (
        f" and {len(leaves)} trainable leaf modules (peft's fsdp_auto_wrap_policy; the files' units)" if leaves else ""
    )
    plan = plan.noted(
        f"FSDP1 flat parameters: {len(flats)} {unit_word} of {'a PEFT model over ' if peft_notes else ''}{arch} "
        f"(built on the meta device from {os.path.join(config_dir, 'config.json')}), wrapped by "
        f"{', '.join(wrap_names) or 'nothing'} ({source}){leaf_note}",
        *peft_notes,
    )
    plan = plan.noted(
        f"use_orig_params={align > 0}" + (f", parameters aligned to {align} elements" if align else "") + f" ({how})"
    )
    if views:
        plan = plan.noted(
            f"skipped {len(views)} sharded views of the original parameters (use_orig_params=True saves them beside the flat parameters)"
        )
    plan = plan.noted(*_tied_notes(units))
    origin = fsdp1_units.order_source(model)
    plan = plan.noted(
        f"parameter order within each unit: the registration order of {origin} (FSDP1 saves none); "
        "if training ran another transformers version or the model's remote code, same-shaped parameters "
        "could be swapped unnoticed: compare the merged model's outputs with a reference (docs/formats.md: FSDP1)"
    )
    if order_from and order_from != origin:
        plan = plan.noted(f"the merge took that order from {order_from}; this plan rebuilt it from {origin}")
    assumed = _assumed(arch, config_dir, wrap_names, source, align, how, flats, units, layouts)
    plan = plan.but(assumed={**assumed, "order_from": origin, **({"peft": peft_assumed} if peft_assumed else {})})
    # Recorded in the manifest (layout_options): which transformers gave the order this merge assumed.
    plan = plan.but(
        options={"wrap": ",".join(wrap_names) or "none", "use_orig_params": align > 0, "order_from": origin}
    )
    return plan


def _as_trained(model, folder, config_dir, flats, states, lora_r):
    """(the trained model over `model` when the files name a wrapper of it (WRAPPED_MODELS), else
    `model`; the saved units that are the wrapper's trainable leaves; notes; its configs for `inspect`)."""
    sizes: dict[str, int] = {}  # plain tensors (views, buffers) by name, in rank 0's order, elements summed over ranks
    for state in states:
        for key, value in state.tensors.items():
            if isinstance(value, TensorRef):
                name = ".".join(p for p in key.split(".") if p not in _WRAPPERS)
                sizes[name] = sizes.get(name, 0) + prod(value.shape)
    wrapper = next((w for w in map(importlib.import_module, WRAPPED_MODELS) if w.matches(flats, sizes)), None)
    if wrapper is None:
        return model, frozenset(), [], []
    built, notes, assumed = wrapper.rebuild(model, folder, config_dir, list(flats), sizes, lora_r)
    return built, frozenset(wrapper.leaf_units(built, flats)), notes, assumed


def _tied_notes(units) -> list[str]:
    """Tied names whose parameter another (earlier) unit holds: merged as copies of it, said so."""
    notes = []
    for unit in units.values():
        for param in unit.params:
            elsewhere = [a for a in param.aliases if not _inside(a, unit.path)]
            if elsewhere:
                notes.append(
                    f"{', '.join(elsewhere)} tied to {param.name}, which unit {unit.path or '(root)'} holds: "
                    "written from its bytes"
                )
    return notes


def _inside(name: str, unit_path: str) -> bool:
    return not unit_path or name.startswith(unit_path + ".")


def _config_dir(folder: str, config: str | None) -> str:
    candidates = [config] if config else [os.path.join(folder, "huggingface"), folder]
    for candidate in candidates:
        if os.path.isfile(os.path.join(candidate, "config.json")):
            return candidate
    if config:
        raise BadInput(f"{config}: the {option('config')} folder has no config.json")
    raise BadInput(
        f"{folder}: FSDP1 flat parameters do not say which weights they hold; fsdpfast rebuilds that from the "
        f"model's config.json, found in neither huggingface/ nor the checkpoint folder: pass {option('config', meta='DIR')}"
    )


def _wrap_list(wrap) -> list[str] | None:
    """The class names of --wrap; None: not given (the default); "none": the root is the only unit."""
    items = wrap.split(",") if isinstance(wrap, str) else list(wrap or ())
    names = [str(item).strip() for item in items if str(item).strip()]
    if [n.lower() for n in names] == ["none"]:
        return []
    return names or None


def _read_flat_params(states: list[RankState], world: int) -> dict[str, _FlatParam]:
    first = states[0]
    first_part = _model_part(first.whole, first.path)
    keys = _flat_entries(first_part)
    flats: dict[str, _FlatParam] = {}
    for key, path in keys.items():
        value = first_part[key]
        if not isinstance(value, ShardedTensorRef) or len(as_dims(value.shape) or ()) != 1 or value.dtype not in DTYPES:
            raise BadInput(
                f"{first.path}: {key} is not a 1-D ShardedTensor of a known dtype; not a flat parameter saved by FSDP1"
            )
        flats[path] = _FlatParam(key, path, value.shape[0], value.dtype, [])
    for state in states:
        part = _model_part(state.whole, state.path)
        mine = _flat_entries(part)
        if set(mine.values()) != set(keys.values()):
            missing = sorted(set(keys.values()) - set(mine.values()))
            what = (
                f"lacks the flat parameter of unit {missing[0] or '(root)'}"
                if missing
                else "has flat parameters rank 0 lacks"
            )
            raise BadInput(f"{state.path}: {what}; all rank files must come from one checkpoint")
        for key, path in mine.items():
            flat = flats[path]
            flat.shards.append((state, _local_shard(state, key, part[key], flat, world)))
    return flats


def _local_shard(state: RankState, key: str, value, flat: _FlatParam, world: int) -> TensorRef | None:
    """This rank's piece of a flat parameter, checked against FSDP1's chunking."""
    where = f"{state.path}: {key}"
    if not isinstance(value, ShardedTensorRef) or tuple(value.shape) != (flat.size,) or value.dtype != flat.dtype:
        got = f"{value.dtype}{list(value.shape)}" if isinstance(value, ShardedTensorRef) else type(value).__name__
        raise BadInput(
            f"{where}: is {got} but {flat.dtype}[{flat.size}] in rank 0's file; all rank files must come from one checkpoint"
        )
    group = _process_group(value, state.path, key)
    if group["local_world_size"] != world or group["local_rank"] != state.rank:
        raise BadInput(
            f"{where}: saved by rank {group['local_rank']} of {group['local_world_size']}, "
            f"but the file name says rank {state.rank} of {world}; are two files copies of one rank?"
        )
    _, length = chunk_span(flat.size, world, state.rank)
    start = state.rank * -(-flat.size // world)  # FSDP1's shard offset: rank * ceil(size / world)
    shards = value.state[0] if isinstance(value.state[0], list) else None
    expected = f"FSDP1's chunking of {flat.size:,} elements over {world} ranks gives rank {state.rank} {length:,} at offset {start:,}"
    if shards is None or len(shards) != (1 if length else 0):
        raise BadInput(f"{where}: holds {len(shards or [])} local shards; {expected}")
    if not length:
        return None
    shard = shards[0]
    tensor, meta = (shard.get("tensor"), shard.get("metadata")) if isinstance(shard, Record) else (None, None)
    if not isinstance(tensor, TensorRef) or not isinstance(meta, Record):
        raise BadInput(f"{where}: its local shard lacks its tensor or metadata; the file is corrupt")
    offsets, sizes = as_dims(meta.get("shard_offsets")), as_dims(meta.get("shard_sizes"))
    if offsets != (start,) or sizes != (length,) or tuple(tensor.shape) != (length,):
        raise BadInput(
            f"{where}: its shard holds {list(sizes or tensor.shape)} elements at offset {list(offsets or ())}; {expected}"
        )
    if tensor.dtype != flat.dtype or not tensor.is_contiguous() or tensor.offset + length > tensor.storage.numel:
        raise BadInput(
            f"{where}: its shard's tensor does not fit its storage ({tensor.dtype}, {tensor.storage.numel} elements); the file is corrupt"
        )
    return tensor


def _check_units(folder, flats, units, model, arch, wrap_names, fsdp1_units) -> None:
    saved, expected = set(flats), set(units)
    if saved == expected:
        return
    show = lambda paths: ", ".join((p or "(root)") for p in sorted(paths)[:4]) + (" ..." if len(paths) > 4 else "")
    only_saved, only_expected = saved - expected, expected - saved
    modules = dict(model.named_modules())
    strangers = [p for p in only_saved if p not in modules]
    if strangers:
        raise BadInput(
            f"{folder}: the files hold flat parameters of units at {show(strangers)}, which are not modules of {arch} "
            f"(config.json); pass {option('config')} with the config of the model that was trained"
        )
    suggestion = fsdp1_units.module_classes(model, sorted(saved))
    detail = (
        f"the files hold units {show(only_saved)} that it does not"
        if only_saved
        else f"it expects units {show(only_expected)} the files lack"
    )
    raise BadInput(
        f"{folder}: {arch} wrapped by {', '.join(wrap_names) or 'nothing'} does not give FSDP1's units here ({detail}); "
        f"pass the classes FSDP1 wrapped with {option('wrap')} (the files' units are {', '.join(suggestion) or 'the root only: ' + option('wrap', 'none')})"
    )


def flat_layout(unit, align: int, world: int) -> tuple[list[tuple], int]:
    """([(param, offset)], flat parameter size) as FSDP1 lays out a unit.

    `align` > 0 (use_orig_params=True): each parameter starts at a multiple of `align`
    elements and the whole is padded to a multiple of `world`; both paddings are part of the
    saved size. `align` = 0: parameters end to end; the padding to the world size is not saved.
    """
    offset, placed = 0, []
    for param in unit.params:
        if align and offset % align:
            offset += align - offset % align
        placed.append((param, offset))
        offset += prod(param.shape)
    if align and offset % world:
        offset += world - offset % world
    return placed, offset


def _alignment(flats, units, world, use_orig_params, arch, wrap_names, views, lora_hint="") -> tuple[int, str]:
    """The alignment (0: use_orig_params=False) whose layout gives every unit its saved size."""
    aligned = []
    for flat in flats.values():
        for size in (_ALIGNMENT_BYTES // itemsize(flat.dtype), 8, 4):  # compute dtype = saved, 16-bit or 32-bit
            if size not in aligned:
                aligned.append(size)
    candidates = {None: [0] + aligned, False: [0], True: aligned}[use_orig_params]
    fitting = [a for a in candidates if all(flat_layout(units[p], a, world)[1] == f.size for p, f in flats.items())]
    if not fitting:
        path, flat = next((p, f) for p, f in flats.items() if flat_layout(units[p], candidates[0], world)[1] != f.size)
        sizes = " or ".join(
            f"{flat_layout(units[path], a, world)[1]:,} (use_orig_params={a > 0}"
            + (f", {a}-element alignment)" if a else ")")
            for a in candidates[:2]
        )
        flag = "" if use_orig_params is None else f", or drop {option('use_orig_params', use_orig_params)}"
        raise BadInput(
            f"{flat.shards[0][0].path}: {flat.key} holds {flat.size:,} elements, but unit {path or '(root)'} of {arch} "
            f"wrapped by {', '.join(wrap_names) or 'nothing'} flattens to {sizes}; the model or the wrapping differs from "
            f"training: pass the wrapped classes with {option('wrap')} (and the model's config with {option('config')}){flag}"
            f"{lora_hint}"
        )
    layouts = {tuple(tuple(o for _, o in flat_layout(units[p], a, world)[0]) for p in flats) for a in fitting}
    if len({a > 0 for a in fitting}) > 1 and len(layouts) > 1:
        raise BadInput(
            "the flat parameters' sizes fit both use_orig_params=True and False with different layouts; "
            f"say which with {option('use_orig_params', True)} or {option('use_orig_params', False)}"
        )
    if len(layouts) > 1:
        raise BadInput(
            f"the flat parameters' sizes fit alignments of {' and '.join(map(str, fitting))} elements "
            "(mixed precision compute dtypes) with different layouts; not supported yet"
        )
    chosen = fitting[0]
    if views:
        how = "the files hold the original parameters' views"
    elif use_orig_params is not None:
        how = option("use_orig_params", bool(use_orig_params))
    elif len(fitting) == 1:
        how = "the only assumption under which the flat sizes add up"
    else:
        how = "the flat sizes fit either setting with the same layout"
    return chosen, how


def _original_views(states: list[RankState], units) -> dict[str, list]:
    """{parameter name: [(rank state, view)]}: use_orig_params=True saves each parameter's sharded view."""
    names = {n for u in units.values() for p in u.params for n in (p.name, *p.aliases)}
    views: dict[str, list] = {}
    for state in states:
        for key, value in state.tensors.items():
            name = ".".join(p for p in key.split(".") if p not in _WRAPPERS)
            if name in names and isinstance(value, TensorRef) and len(value.shape) <= 1:
                views.setdefault(name, []).append((state, value))
    return views


def _check_views(views, flats, layouts, world) -> None:
    """Each saved view must sit where the assumed layout puts that parameter's piece of the rank's shard."""
    where = {}
    for path, flat in flats.items():
        chunk = -(-flat.size // world)
        for param, offset in layouts[path]:
            for name in (param.name, *param.aliases):
                where[name] = (flat, offset, prod(param.shape), chunk)
    for name, pieces in views.items():
        flat, offset, numel, chunk = where[name]
        shards = {state.rank: shard for state, shard in flat.shards}
        for state, view in pieces:
            shard = shards[state.rank]
            lo, hi = max(offset, state.rank * chunk), min(offset + numel, (state.rank + 1) * chunk)
            want = (lo - state.rank * chunk, hi - lo) if hi > lo else (None, 0)
            got = (view.offset - (shard.offset if shard else 0), prod(view.shape))
            if got[1] != want[1] or (
                want[1] and (shard is None or view.storage.key != shard.storage.key or got[0] != want[0])
            ):
                raise BadInput(
                    f"{state.path}: the saved view of {name} holds {got[1]} elements at {got[0]} of the shard, "
                    f"the assumed layout gives {want[1]} at {want[0]}; pass the wrapped classes with {option('wrap')}"
                )


def _flat_runs(flat: _FlatParam, sources: StorageSources) -> FlatRuns:
    """The flat parameter as its ranks' shards end to end: torch.chunk pieces, checked to start at rank * ceil(size / world)."""
    runs = FlatRuns(
        [
            (sources.index(state.path, shard, state.archive), shard.offset, prod(shard.shape))
            for state, shard in flat.shards
            if shard is not None
        ]
    )
    if runs.numel != flat.size:
        raise BadInput(
            f"{flat.shards[0][0].path}: the shards of {flat.key} hold {runs.numel} of its {flat.size} elements; "
            "the files are incomplete"
        )
    return runs


def _buffers(states: list[RankState], views, sources: StorageSources) -> list[TensorPlan]:
    """Plain tensors that are not parameter views: buffers, held whole by every rank."""
    view_keys = {
        key for pieces in views.values() for state, view in pieces for key, v in state.tensors.items() if v is view
    }
    out = []
    for name in states[0].tensors:
        if name in view_keys:
            continue
        missing = [s.path for s in states if name not in s.tensors]
        if missing:
            raise BadInput(
                f"{missing[0]}: lacks {name}, which rank 0's file holds; all rank files must come from one checkpoint"
            )
        out.append(plan_replicated(name, [(s, s.tensors[name]) for s in states], sources))
    return out


def _assumed(arch, config_dir, wrap_names, source, align, how, flats, units, layouts) -> dict:
    """What the merge assumed, for `inspect`: the model, the wrapping and every unit's order."""
    return {
        "model": arch,
        "config": os.path.join(config_dir, "config.json"),
        "wrap": list(wrap_names),
        "wrap_source": source,
        "use_orig_params": align > 0,
        "alignment_elements": align,
        "alignment_source": how,
        "units": [
            {
                "key": flat.key,
                "module": path or "(root)",
                "class": units[path].cls,
                "numel": flat.size,
                "padding": flat.size - sum(prod(p.shape) for p in units[path].params),
                "params": [
                    {"name": p.name, "offset": o, "shape": list(p.shape), "tied": list(p.aliases)}
                    for p, o in layouts[path]
                ],
            }
            for path, flat in flats.items()
        ],
    }


READER = Reader(
    NAME,
    DESCRIPTION,
    sniff=matches,
    read=read,
    reads_config=True,
    takes_lora_r=True,
    options=(
        ReaderOption(
            "wrap",
            "module classes FSDP1 wrapped, comma-separated (default: the model's decoder-layer class, its "
            "_no_split_modules; 'none': the root only)",
        ),
        ReaderOption(
            "use_orig_params",
            "whether FSDP1 ran with use_orig_params=True (default: detected from the flat sizes)",
            kind="switch",
        ),
        ReaderOption(
            "order_from", "the transformers version and class the merge took the parameter order from", internal=True
        ),
    ),
)
