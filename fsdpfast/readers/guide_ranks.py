"""`model_pt_rank_{r}.pt`: per-rank dicts {"state_dict", "optimizer_state", "metadata"}.

The layout of a popular merging guide. Only the model is merged; the report says what
else the files hold.
"""

from __future__ import annotations

import os
import re

from .._parsing.safe_load import DTensorRef, TensorRef, each_object, safe_unpickle
from .._parsing.torch_zip import TorchZip
from ..errors import BadInput
from ..plan.model import MergePlan
from .discover import complete_ranks, find_rank_files
from .rank_files import load_rank_states, plan_from_ranks
from .reader import Reader

NAME = "guide-ranks"
DESCRIPTION = "model_pt_rank_{r}.pt: per-rank {state_dict, optimizer_state, metadata} dicts"
_PATTERN = re.compile(r"model_pt_rank_(\d+)\.pt")


def matches(folder: str) -> bool:
    return bool(find_rank_files(folder, _PATTERN))


def read(folder: str, config: str | None = None) -> MergePlan:
    """`config`: the folder of the model's config.json (--config); default: huggingface/ in the checkpoint."""
    ((_, ranks),) = find_rank_files(folder, _PATTERN).items()
    world = _recorded_world_size(ranks[min(ranks)]) or max(ranks) + 1
    ordered = complete_ranks(folder, ranks, world, lambda r: f"model_pt_rank_{r}.pt")
    states = load_rank_states(ordered, _model_part)
    for state in states:
        recorded = _metadata(state.whole).get("world_size")
        if isinstance(recorded, int) and recorded != world:
            raise BadInput(
                f"{state.path}: its metadata says world_size {recorded} but the folder holds {world} rank files"
            )
    _check_one_step(states)
    states, renumbered = _by_recorded_rank(states, world)
    hf = os.path.join(folder, "huggingface")
    plan = plan_from_ranks(states, NAME, config or (hf if os.path.isdir(hf) else None))
    if renumbered:
        plan = plan.noted(renumbered)
    plan = plan.noted(*_other_contents(states[0].whole))
    plan = plan.but(config_dir=hf if os.path.isdir(hf) else None)
    return plan


def _check_one_step(states) -> None:
    """Files of two training steps (a save that crashed part way) would merge into a model that never existed."""
    steps = [(state.path, _metadata(state.whole).get("step")) for state in states]
    first_path, first = steps[0]
    for path, step in steps[1:]:
        if repr(step) != repr(first):
            raise BadInput(
                f"{path}: its metadata records step {step!r} but {first_path} records step {first!r}: the rank "
                "files come from two saves (a save that crashed part way?); merge the files of one complete save"
            )


def _by_recorded_rank(states, world: int):
    """(states in the order of the rank each file's metadata records, a note if that is not the names' order).

    The file names are just names: a file renamed or copied over another still records its rank,
    and plain to_local() pieces are placed in rank order. Files that record no rank keep their names'.
    """
    recorded = [_metadata(state.whole).get("rank") for state in states]
    if not all(isinstance(r, int) and not isinstance(r, bool) for r in recorded):
        for state, rank in zip(states, recorded):
            if rank is not None and rank != state.rank:
                raise BadInput(
                    f"{state.path}: its metadata records rank {rank!r} but not every rank file records one; "
                    "rename the files by the ranks they hold"
                )
        return states, None
    by_rank = {}
    for state, rank in zip(states, recorded):
        if not 0 <= rank < world:
            raise BadInput(f"{state.path}: its metadata records rank {rank}, outside a world of {world} ranks")
        if rank in by_rank:
            raise BadInput(
                f"{by_rank[rank].path} and {state.path} both record rank {rank} in their metadata: "
                "one is a copy of another rank's file; find the missing rank's file"
            )
        by_rank[rank] = state
    moved = [
        f"{os.path.basename(state.path)} holds rank {rank}"
        for state, rank in zip(states, recorded)
        if rank != state.rank
    ]
    for rank, state in by_rank.items():
        state.rank = rank
    ordered = [by_rank[rank] for rank in range(world)]
    if not moved:
        return ordered, None
    return ordered, (
        f"the files' metadata records other ranks than their names ({', '.join(moved[:4])}"
        f"{', ...' if len(moved) > 4 else ''}); each file is placed as the rank it records"
    )


def _recorded_world_size(path: str) -> int | None:
    """The world size a rank file's metadata records, so a missing last rank is named."""
    with TorchZip(path) as archive:
        whole = safe_unpickle(archive.pickle_bytes, path)
    recorded = _metadata(whole).get("world_size") if isinstance(whole, dict) else None
    return recorded if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0 else None


def _model_part(whole, path: str) -> dict:
    if not isinstance(whole, dict) or not isinstance(whole.get("state_dict"), dict):
        raise BadInput(f"{path}: expected a dict with a 'state_dict' entry (the model), found {type(whole).__name__}")
    return whole["state_dict"]


def _metadata(whole) -> dict:
    meta = whole.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _other_contents(whole: dict) -> list[str]:
    notes = []
    for key, value in whole.items():
        if key == "state_dict":
            continue
        count, nbytes = _tensor_totals(value)
        if count:
            notes.append(f"not merged: '{key}' holds {count} tensors ({nbytes / 1e6:.1f} MB per rank)")
        elif isinstance(value, dict):
            shown = ", ".join(
                f"{k}={v!r}" for k, v in list(value.items())[:6] if isinstance(v, (int, float, str, bool))
            )
            notes.append(f"not merged: '{key}' {{{shown}}}")
        else:
            notes.append(f"not merged: '{key}' ({type(value).__name__})")
    return notes


def _tensor_totals(value) -> tuple[int, int]:
    """(tensors, bytes) under `value`, each object counted once: a pickle may share containers
    (a crafted one could nest shared lists so that walking them as a tree never ends)."""
    from ..dtypes import DTYPES

    count = nbytes = 0
    for item in each_object(value):
        if isinstance(item, DTensorRef):
            item = item.local
        if isinstance(item, TensorRef):
            numel = 1
            for size in item.shape:
                numel *= size
            count, nbytes = count + 1, nbytes + numel * DTYPES.get(item.dtype, (0,))[0]
    return count, nbytes


READER = Reader(NAME, DESCRIPTION, sniff=matches, read=read, reads_config=True)
