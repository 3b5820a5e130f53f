"""Find and read the files of one DeepSpeed ZeRO checkpoint: the tag folder, its rank files, their pickles.

`engine.save_checkpoint(root)` writes `root/latest` (the tag just saved) and `root/<tag>/` with
- `mp_rank_00_model_states.pt` (stage 1/2) or `zero_pp_rank_{r}_mp_rank_00_model_states.pt` (stage 3, one
  per rank): the module's state dict (stage 3: empty placeholders), buffer names, `param_shapes`,
  frozen parameters' shapes and fragments, `shared_params`;
- `[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`: this rank's flat fp32 partitions, next to the
  Adam moments (which are never read: only the pickle and the zip directory are).
The optimizer pickles name a few DeepSpeed classes (the loss scaler, the ZeRO stage enum, fragment
addresses); they become inert records, so DeepSpeed is never imported.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from .._parsing.safe_load import Record, TensorRef, is_count, safe_unpickle
from .._parsing.torch_zip import TorchZip
from ..errors import BadInput, option
from .deepspeed_experts import EXPERT_FILE, autoep_layers, check_expert_files
from .deepspeed_moe import native_moe_layers
from .discover import complete_ranks
from .saved_steps import scalar_value

DEEPSPEED_RECORDS = frozenset(
    {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)
_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_MODEL = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")


def is_tag_folder(folder: str) -> bool:
    try:
        entries = os.listdir(folder)
    except OSError:
        return False
    return holds_tag_files(entries)


def holds_tag_files(names) -> bool:
    """Whether a folder of these names is a tag's: DeepSpeed's model or optimizer state files among them."""
    return any(_OPTIM.fullmatch(e) or _MODEL.fullmatch(e) for e in names)


def tags_in(root: str) -> list[str]:
    return sorted(
        e for e in os.listdir(root) if os.path.isdir(os.path.join(root, e)) and is_tag_folder(os.path.join(root, e))
    )


def resolve_tag(folder: str, tag: str | None) -> tuple[str, str, str]:
    """(tag folder, tag, how it was chosen) for a checkpoint root (with `latest`) or a tag folder itself."""
    if is_tag_folder(folder):
        name = os.path.basename(os.path.normpath(folder))
        if tag is not None and tag != name:
            raise BadInput(
                f"{folder} is the checkpoint of tag {name!r}; {option('tag', tag)} picks a tag in a checkpoint root "
                f"(the folder holding `latest`): give {os.path.dirname(os.path.normpath(folder)) or '.'}"
            )
        return folder, name, "the folder given"
    tags = tags_in(folder)
    present = f"tags present: {', '.join(tags)}" if tags else "no tag folder holds DeepSpeed files"
    if tag is not None:
        if tag not in tags:
            raise BadInput(f"{option('tag', tag)}: no such checkpoint in {folder} ({present})")
        return os.path.join(folder, tag), tag, option("tag")
    latest = os.path.join(folder, "latest")
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8", errors="replace") as f:
            named = f.read().strip()
        if named not in tags:
            what = "holds no DeepSpeed files" if os.path.isdir(os.path.join(folder, named)) else "is missing"
            raise BadInput(
                f"{latest} names tag {named!r} but {os.path.join(folder, named)} {what} ({present}); choose one with {option('tag')}"
            )
        return os.path.join(folder, named), named, "named by `latest`"
    if len(tags) == 1:
        return os.path.join(folder, tags[0]), tags[0], "the only tag; there is no `latest` file"
    if not tags:
        raise BadInput(
            f"{folder}: no DeepSpeed checkpoint here (no `latest` file and no folder with *_model_states.pt files)"
        )
    raise BadInput(f"{folder}: no `latest` file and several tags ({', '.join(tags)}); choose one with {option('tag')}")


@dataclass(frozen=True)
class OptimizerFile:
    """What an optimizer file says about the save it belongs to, beside its optimizer_state_dict."""

    ds_version: object  # None where the file records none
    step: int | float | None  # the wrapped torch optimizer's step count (Adam's `step`); None if it keeps none


@dataclass
class RankFiles:
    world: int
    stage: int
    bf16: bool
    optim: list[tuple[str, dict]]  # per rank: (path, optimizer_state_dict)
    model: list[tuple[str, dict]]  # stage 1/2: one file; stage 3: one per rank
    optim_files: list[OptimizerFile]  # per rank, as `optim`
    autoep: list[dict] | None = None  # DeepSpeed AutoEP's layers (readers.deepspeed_experts), None without
    native_moe: tuple[int, ...] | None = None  # experts per deepspeed.moe layer (readers.deepspeed_moe), None without


def read_rank_files(tag_dir: str) -> RankFiles:
    entries = sorted(os.listdir(tag_dir))
    unsupported = [
        e for e in entries if e.endswith(".pt") and (e.startswith(("expp_rank_", "layer_")) or "expert" in e)
    ]
    autoep, native = _experts(tag_dir, entries) if unsupported else (None, None)
    if autoep is not None or native is not None:  # MoE: per-expert files expected (readers.deepspeed_experts, _moe)
        unsupported = [e for e in unsupported if not EXPERT_FILE.fullmatch(e)]
    if unsupported:
        raise BadInput(
            f"{os.path.join(tag_dir, unsupported[0])}: pipeline-parallel DeepSpeed checkpoints, and MoE ones "
            "without ZeRO (expp_rank_* optimizer files), are not supported"
        )
    optim, prefixes, mp_ranks = {}, set(), set()
    for entry in entries:
        if match := _OPTIM.fullmatch(entry):
            prefixes.add(match.group(1) or "")
            mp_ranks.add(int(match.group(3)))
            optim[int(match.group(2))] = os.path.join(tag_dir, entry)
        elif match := _MODEL.fullmatch(entry):
            mp_ranks.add(int(match.group(2)))
    if mp_ranks - {0}:
        raise BadInput(
            f"{tag_dir}: holds model-parallel ranks (mp_rank_{max(mp_ranks):02d}); only data-parallel ZeRO checkpoints (mp_rank_00) are supported"
        )
    if len(prefixes) > 1:
        raise BadInput(
            f"{tag_dir}: holds both bf16_zero_pp_rank_* and zero_pp_rank_* optimizer files; remove the stale ones"
        )
    if not optim:
        raise BadInput(
            f"{tag_dir}: no *_optim_states.pt files; fsdpfast reads ZeRO stage 1-3 checkpoints, whose fp32 master weights live there"
        )
    prefix = prefixes.pop()
    first = min(optim)
    if first != 0:
        raise BadInput(
            f"{os.path.join(tag_dir, _optim_name(prefix, 0))} is missing: every rank's optimizer file is needed"
        )
    first_file = _optimizer_file(optim[0])
    state0 = first_file[0]
    experts = autoep is not None or native is not None
    stage, world = _stage(state0, optim[0]), _partition_count(state0, optim[0], experts)
    ordered = complete_ranks(tag_dir, optim, world, lambda r: _optim_name(prefix, r))
    read = [first_file] + [_optimizer_file(path) for _, path in ordered[1:]]
    states = [(path, state) for (_, path), (state, _) in zip(ordered, read)]
    for path, state in states[1:]:
        if _stage(state, path) != stage or _partition_count(state, path, experts) != world:
            raise BadInput(
                f"{path}: ZeRO stage {_stage(state, path)} over {_partition_count(state, path, True)} ranks, but "
                f"{optim[0]} says stage {stage} over {world}; the files come from different runs"
            )
    if stage == 3:
        names = {r: os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(world)}
        present = {r: p for r, p in names.items() if os.path.isfile(p)}
        model_paths = [p for _, p in complete_ranks(tag_dir, present, world, lambda r: os.path.basename(names[r]))]
    else:
        model_paths = [os.path.join(tag_dir, "mp_rank_00_model_states.pt")]
        if not os.path.isfile(model_paths[0]):
            raise BadInput(
                f"{model_paths[0]} is missing: a ZeRO stage {stage} checkpoint keeps the model's shapes and buffers there"
            )
    model = [(path, _model_state(path)) for path in model_paths]
    if experts and stage == 3:
        what = "an AutoEP" if autoep is not None else "a DeepSpeed MoE"
        raise BadInput(f"{tag_dir}: {what} checkpoint of ZeRO stage 3; fsdpfast reads MoE under stages 1 and 2")
    return RankFiles(world, stage, prefix == "bf16_", states, model, [facts for _, facts in read], autoep, native)


def _experts(tag_dir: str, entries: list[str]) -> tuple[list[dict] | None, tuple[int, ...] | None]:
    """(the AutoEP layers mp_rank_00_model_states.pt records, or None; else the experts per native
    deepspeed.moe layer, or None), their per-expert files checked."""
    path = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    if not os.path.isfile(path):
        return None, None
    model = _model_state(path)
    layers = autoep_layers(model)
    if layers is not None:
        check_expert_files(tag_dir, entries, layers)
        return layers, None
    return None, native_moe_layers(model, tag_dir, entries)


def _optim_name(prefix: str, rank: int) -> str:
    return f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def load_pickle(path: str) -> Any:
    with TorchZip(path) as archive:
        return safe_unpickle(archive.pickle_bytes, path, DEEPSPEED_RECORDS)


def _optimizer_file(path: str) -> tuple[dict, OptimizerFile]:
    with TorchZip(path) as archive:
        whole = safe_unpickle(archive.pickle_bytes, path, DEEPSPEED_RECORDS)
        state = whole.get("optimizer_state_dict") if isinstance(whole, dict) else None
        if not isinstance(state, dict) or "zero_stage" not in state:
            raise BadInput(f"{path}: not a DeepSpeed ZeRO optimizer file (no optimizer_state_dict with a zero_stage)")
        step = scalar_value(_torch_optimizer_step(state), archive, path)
    return state, OptimizerFile(whole.get("ds_version"), step)


def _torch_optimizer_step(state: dict):
    """The step count of the torch optimizer ZeRO wraps, as pickled (a 0-d tensor or a number), or None.

    Stage 1/2 (and bf16) keep its state_dict() under base_optimizer_state (an elastic checkpoint: one
    state per group, the groups' step beside them), stage 3 under optimizer_state_dict; torch's Adam
    counts in each parameter's state, DeepSpeed's FusedAdam in its param groups."""
    inner = state.get("base_optimizer_state", state.get("optimizer_state_dict"))
    if isinstance(inner, (list, tuple)):  # elastic
        first = inner[0] if inner else None
        step = first.get("step") if isinstance(first, dict) else None
        return state.get("base_optimizer_state_step") if step is None else step
    if not isinstance(inner, dict):
        return None
    per_param = inner.get("state")
    if isinstance(per_param, dict) and per_param:
        first = per_param[min(per_param, key=repr)]
        if isinstance(first, dict) and "step" in first:
            return first["step"]
    groups = inner.get("param_groups")
    return (
        groups[0].get("step") if isinstance(groups, (list, tuple)) and groups and isinstance(groups[0], dict) else None
    )


def _model_state(path: str) -> dict:
    whole = load_pickle(path)
    if (
        not isinstance(whole, dict)
        or not isinstance(whole.get("module"), dict)
        or not isinstance(whole.get("param_shapes"), list)
    ):
        raise BadInput(f"{path}: not a DeepSpeed ZeRO model-states file (no module state dict and param_shapes)")
    return whole


def _stage(state: dict, path: str) -> int:
    stage = state["zero_stage"]
    if isinstance(stage, Record):  # ZeroStageEnum(n)
        stage = stage.args[0] if stage.args else stage.state_value
    if stage not in (1, 2, 3):
        raise BadInput(f"{path}: ZeRO stage {stage!r}; fsdpfast reads stages 1, 2 and 3")
    return int(stage)


def _partition_count(state: dict, path: str, experts: bool = False) -> int:
    """The ranks the parameter groups are partitioned over; `experts` (AutoEP): the dense groups' count, the
    largest (each rank's own experts are a group of their own, over the expert-data-parallel ranks)."""
    count = state.get("partition_count")
    counts = list(count) if isinstance(count, (list, tuple)) else [count]
    if not counts or not all(is_count(c) and c >= 1 for c in counts):
        raise BadInput(f"{path}: partition_count {count!r} is not a rank count; the file is corrupt")
    if experts:
        return max(counts)
    if len(set(counts)) != 1:
        raise BadInput(
            f"{path}: parameter groups partitioned over different rank counts {sorted(set(counts))} (MoE); not supported"
        )
    return counts[0]


def flat_partition(tensor: Any, path: str, what: str) -> TensorRef:
    """One rank's flat partition: a 1-D contiguous tensor inside its storage."""
    if not isinstance(tensor, TensorRef) or len(tensor.shape) != 1 or not tensor.is_contiguous():
        raise BadInput(f"{path}: {what} is not a flat 1-D tensor; the file is corrupt")
    if tensor.offset + tensor.shape[0] > tensor.storage.numel:
        raise BadInput(f"{path}: {what} reaches past the end of its storage; the file is corrupt")
    return tensor
