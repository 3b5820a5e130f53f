"""`pytorch_model_fsdp_{i}_rank{r}.bin`: accelerate's `save_fsdp_model(..., use_dcp=False)` with SHARDED_STATE_DICT.

Each rank torch.saves its own sharded `model.state_dict()` for model `i`: FSDP2 DTensors, or
FSDP1 ShardedTensors (one per parameter), buffers whole. The file names record no world size:
it is read from rank 0's DTensor mesh or ShardedTensor process group, so a missing last rank
is named. FSDP1 LOCAL_STATE_DICT files of a model other than the first have the same names;
those hold flat parameters and are readers.fsdp1_flat's.
"""

from __future__ import annotations

import os
import re
from math import prod

from .._parsing.safe_load import DTensorRef, ShardedTensorRef, TensorRef, safe_unpickle
from .._parsing.torch_zip import TorchZip
from ..errors import BadInput
from ..geometry.placements import read_layout
from ..plan.model import MergePlan
from .discover import complete_ranks, find_rank_files
from .rank_files import RankState, load_rank_states, plan_from_ranks, plan_replicated, whole_state_dict
from .reader import Reader
from .sharded_tensors import plan_sharded, recorded_world
from .storage_sources import StorageSources

NAME = "accelerate-ranks"
DESCRIPTION = (
    "pytorch_model_fsdp_{i}_rank{r}.bin: accelerate save_fsdp_model(use_dcp=False) SHARDED_STATE_DICT rank files"
)
_PATTERN = re.compile(r"pytorch_model_fsdp_(\d+)_rank(\d+)\.bin")


def matches(folder: str) -> bool:
    return bool(_models(folder))


def _models(folder: str) -> dict[int, dict[int, str]]:
    """{model index: {rank: path}}, leaving out FSDP1 flat-parameter files (fsdp1-flat reads those)."""
    found = find_rank_files(folder, _PATTERN)  # its first group is the model index here, not a world size
    return {index: ranks for index, ranks in found.items() if not _holds_flat_params(ranks[min(ranks)])}


def _holds_flat_params(path: str) -> bool:
    try:
        with TorchZip(path) as archive:
            return b"_flat_param" in archive.pickle_bytes
    except BadInput:  # damaged: read() names the problem
        return False


def read(folder: str) -> MergePlan:
    models = _models(folder)
    if len(models) > 1:
        shown = ", ".join(f"pytorch_model_fsdp_{i}_rank*.bin" for i in sorted(models))
        raise BadInput(
            f"{folder}: rank files of {len(models)} accelerate models ({shown}); "
            "move one model's files into a folder of their own and merge that"
        )
    ((index, ranks),) = models.items()
    first = ranks[min(ranks)]
    with TorchZip(first) as archive:
        whole = safe_unpickle(archive.pickle_bytes, first)
    world = _recorded_world(whole_state_dict(whole, first), first) or max(ranks) + 1
    ordered = complete_ranks(folder, ranks, world, lambda r: f"pytorch_model_fsdp_{index}_rank{r}.bin")
    states = load_rank_states(ordered, whole_state_dict, sharded_tensors=True, unpickled={first: whole})
    if any(isinstance(v, ShardedTensorRef) for v in states[0].whole.values()):
        plan, kind = _plan_fsdp1(states, world), "FSDP1 ShardedTensors"
    else:
        plan, kind = plan_from_ranks(states, NAME), "FSDP2 DTensors"
    plan = plan.noted(f"accelerate SHARDED_STATE_DICT rank files of model {index} ({kind}, {world} ranks)", first=True)
    others = sorted(f for f in os.listdir(folder) if f.startswith("optimizer_") and f.endswith(".bin"))
    if others:
        plan = plan.noted(f"not merged: {len(others)} optimizer files ({others[0]}, ...)")
    hf = os.path.join(folder, "huggingface")
    plan = plan.but(config_dir=hf if os.path.isdir(hf) else None)
    return plan


def _recorded_world(state_dict: dict, path: str) -> int | None:
    for name, value in state_dict.items():
        if isinstance(value, DTensorRef):
            return prod(read_layout(value.spec, f"{path}: {name}").mesh_shape)
        if isinstance(value, ShardedTensorRef):
            return recorded_world(value, f"{path}: {name}")
    return None


def _plan_fsdp1(states: list[RankState], world: int) -> MergePlan:
    """Parameters as ShardedTensors, buffers as plain tensors every rank holds whole."""
    sources = StorageSources()
    try:
        first = states[0]
        names = [str(k) for k, v in first.whole.items() if isinstance(v, (ShardedTensorRef, TensorRef, DTensorRef))]
        skipped = [str(k) for k in first.whole if str(k) not in names]
        tensors = []
        for name in names:
            for state in states[1:]:
                if name not in state.whole:
                    raise BadInput(
                        f"{state.path}: lacks {name}, which {first.path} holds; all rank files must come from one checkpoint"
                    )
            pieces = [(s, s.whole[name]) for s in states]
            value = pieces[0][1]
            if isinstance(value, ShardedTensorRef):
                tensors.append(plan_sharded(name, pieces, world, sources))
            elif all(isinstance(v, TensorRef) for _, v in pieces):
                tensors.append(plan_replicated(name, pieces, sources))
            else:
                raise BadInput(
                    f"{first.path}: {name} is a {type(value).__name__} beside FSDP1 ShardedTensors; not a file "
                    "accelerate writes"
                )
        extra = sorted({str(k) for s in states[1:] for k in s.whole} - set(names) - set(skipped))
        if extra:
            raise BadInput(
                f"{states[0].path}: lacks {extra[0]}, which another rank's file holds; all rank files must come from one checkpoint"
            )
    finally:
        for state in states:
            state.archive.close()
    plan = MergePlan(NAME, world, sources.buffers, tensors)
    if skipped:
        plan = plan.noted(
            f"skipped {len(skipped)} non-tensor entries: {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}"
        )
    return plan


READER = Reader(NAME, DESCRIPTION, sniff=matches, read=read)
