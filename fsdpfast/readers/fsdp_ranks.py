"""`model_world_size_{W}_rank_{r}.pt`: each rank's `model.state_dict()` saved by torch.save (verl's FSDP layout)."""

from __future__ import annotations

import json
import os
import re

from ..errors import BadInput
from ..plan.model import MergePlan
from .discover import complete_ranks, find_rank_files
from .rank_files import load_rank_states, plan_from_ranks, whole_state_dict
from .reader import Reader
from .saved_steps import check_same_step

NAME = "fsdp-ranks"
DESCRIPTION = "model_world_size_{W}_rank_{r}.pt: per-rank FSDP/FSDP2 state dicts (verl)"
_PATTERN = re.compile(r"model_world_size_(\d+)_rank_(\d+)\.pt")


def matches(folder: str) -> bool:
    return bool(find_rank_files(folder, _PATTERN))


def read(folder: str, config: str | None = None) -> MergePlan:
    """`config`: the folder of the model's config.json (--config); default: huggingface/ in the checkpoint."""
    by_world = find_rank_files(folder, _PATTERN)
    if len(by_world) > 1:
        sizes = ", ".join(f"{w} ({len(r)} files)" for w, r in sorted(by_world.items()))
        raise BadInput(f"{folder}: rank files of two world sizes in one folder: {sizes}; move one checkpoint elsewhere")
    ((world, ranks),) = by_world.items()
    _check_fsdp_config(folder, world)
    ordered = complete_ranks(folder, ranks, world, lambda r: f"model_world_size_{world}_rank_{r}.pt")
    steps_note = check_same_step(folder, world)
    hf = os.path.join(folder, "huggingface")
    states = load_rank_states(ordered, whole_state_dict, keep_whole=False)
    plan = plan_from_ranks(states, NAME, config or (hf if os.path.isdir(hf) else None))
    others = sorted(f for f in os.listdir(folder) if f.startswith(("optim_world_size_", "extra_state_world_size_")))
    if others:
        plan = plan.noted(f"not merged: {len(others)} optimizer / extra-state files ({others[0]}, ...)")
    if steps_note:
        plan = plan.noted(steps_note)
    plan = plan.but(config_dir=hf if os.path.isdir(hf) else None)
    return plan


def _check_fsdp_config(folder: str, world: int) -> None:
    path = os.path.join(folder, "fsdp_config.json")
    if not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            recorded = json.load(f).get("world_size")
    except (OSError, ValueError, AttributeError) as exc:
        raise BadInput(f"{path}: unreadable ({exc}); fix or remove it (it is optional)") from None
    if recorded is None:
        return
    if not isinstance(recorded, int) or isinstance(recorded, bool):
        raise BadInput(
            f"{path}: world_size {recorded!r} is not a whole number; fix or remove the file (it is optional)"
        )
    if recorded != world:
        raise BadInput(f"{path}: says world_size {recorded} but the rank files are for {world}")


READER = Reader(NAME, DESCRIPTION, sniff=matches, read=read, reads_config=True)
