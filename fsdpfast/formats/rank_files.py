"""Plan a merge from one torch.save file per rank, each holding that rank's state dict.

Shared by the per-rank layouts: a reader finds the files and says where the model's state
dict sits in each file's object; this module checks the ranks agree and turns every
tensor's pieces into extents. DTensors say where their piece goes; plain tensors are either
whole on every rank (buffers next to DTensors, or a world of one) or, in files with no
DTensor at all, torch.chunk pieces along dim 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any, Callable

from ..errors import BadInput, option
from ..plan import Extent, MergePlan, TensorPlan
from .boxes import box_extents
from .placements import chunk_span, read_layout
from .safe_load import DTensorRef, ShardedTensorRef, TensorRef, safe_unpickle
from .storage_sources import StorageSources
from .torch_zip import TorchZip


@dataclass
class RankState:
    rank: int
    path: str
    archive: TorchZip
    tensors: dict[str, TensorRef | DTensorRef]
    skipped: list[str]  # non-tensor entries of the state dict
    whole: Any  # the whole unpickled object, for readers that report what else it holds


def load_rank_states(rank_paths: list[tuple[int, str]], model_part: Callable[[Any, str], dict],
                     sharded_tensors: bool = False, unpickled: dict[str, Any] | None = None) -> list[RankState]:
    """Each rank's file; ShardedTensors (FSDP1) are refused unless the reader handles them itself.

    `unpickled`: {path: object} of files the reader already unpickled (detection reads rank 0 once).
    """
    states = []
    for rank, path in rank_paths:
        archive = TorchZip(path)
        whole = unpickled[path] if unpickled and path in unpickled else safe_unpickle(archive.pickle_bytes, path)
        state_dict = model_part(whole, path)
        tensors, skipped = {}, []
        for name, value in state_dict.items():
            if isinstance(value, (TensorRef, DTensorRef)):
                tensors[str(name)] = value
            elif isinstance(value, ShardedTensorRef) and not sharded_tensors:
                archive.close()
                hint = (f"FSDP1 flat parameters: read them with {option('layout', 'fsdp1-flat')}" if str(name).endswith("_flat_param")
                        else "FSDP1 SHARDED_STATE_DICT rank files are not supported yet")
                raise BadInput(f"{path}: {name} is a ShardedTensor; {hint}")
            else:
                skipped.append(str(name))
        states.append(RankState(rank, path, archive, tensors, skipped, whole))
    return states


def plan_from_ranks(states: list[RankState], layout: str) -> MergePlan:
    """The plan for these ranks; their archives are closed once it is made (the plan holds paths)."""
    try:
        return _plan(states, layout)
    finally:
        for state in states:
            state.archive.close()


def _plan(states: list[RankState], layout: str) -> MergePlan:
    world = len(states)
    _check_same_names(states)
    any_dtensor = any(isinstance(v, DTensorRef) for s in states for v in s.tensors.values())
    sources = StorageSources()
    tensors = []
    for name in states[0].tensors:
        pieces = [(s, s.tensors[name]) for s in states]
        kinds = {type(v) for _, v in pieces}
        if len(kinds) > 1:
            raise BadInput(f"{states[0].path}: {name} is a DTensor in some rank files and a plain tensor in others")
        if kinds == {DTensorRef}:
            tensors.append(_plan_dtensor(name, pieces, world, sources))
        elif world == 1 or any_dtensor:
            tensors.append(plan_replicated(name, pieces, sources))
        else:
            tensors.append(_plan_dim0_pieces(name, pieces, sources))
    notes = []
    skipped = sorted({k for s in states for k in s.skipped})
    if skipped:
        notes.append(f"skipped {len(skipped)} non-tensor entries: {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}")
    return MergePlan(layout, world, sources.buffers, tensors, notes)


def _check_same_names(states: list[RankState]) -> None:
    first = states[0]
    names = set(first.tensors)
    for state in states[1:]:
        other = set(state.tensors)
        if other != names:
            missing = sorted(names - other)
            extra = sorted(other - names)
            what = f"lacks {missing[0]}" if missing else f"has {extra[0]} which {first.path} lacks"
            raise BadInput(f"{state.path}: its state dict differs from rank {first.rank}'s: it {what}")


def _local_source(state: RankState, name: str, local: TensorRef, sources: StorageSources) -> tuple[int, int]:
    if not local.is_contiguous():
        raise BadInput(f"{state.path}: the local piece of {name} is not contiguous (strides {local.stride}); not supported yet")
    if local.offset + prod(local.shape) > local.storage.numel:
        raise BadInput(f"{state.path}: {name} reaches past the end of its storage; the file is corrupt")
    return sources.index(state.path, local, state.archive), local.offset


def _plan_dtensor(name: str, pieces, world: int, sources: StorageSources) -> TensorPlan:
    first_state, first = pieces[0]
    where0 = f"{first_state.path}: {name}"
    reference = read_layout(first.spec, where0)
    if prod(reference.mesh_shape) != world:
        raise BadInput(
            f"{where0}: its DeviceMesh has {prod(reference.mesh_shape)} ranks but the folder holds {world} rank files; "
            "all rank files of one checkpoint are needed"
        )
    extents: list[Extent] = []
    seen_coordinates = {}
    for state, value in pieces:
        where = f"{state.path}: {name}"
        layout = read_layout(value.spec, where)
        for field, mine, theirs in (
            ("global shape", layout.global_shape, reference.global_shape),
            ("dtype", value.local.dtype, first.local.dtype),
            ("placements", layout.describe(), reference.describe()),
            ("mesh shape", layout.mesh_shape, reference.mesh_shape),
        ):
            if mine != theirs:
                raise BadInput(f"{where}: {field} {mine} disagrees with {theirs} in {first_state.path}")
        if layout.coordinate in seen_coordinates:
            raise BadInput(f"{where}: same mesh coordinate {layout.coordinate} as {seen_coordinates[layout.coordinate]}; are two files copies of one rank?")
        seen_coordinates[layout.coordinate] = state.path
        offsets, sizes = layout.local_box()
        if tuple(value.local.shape) != sizes:
            raise BadInput(
                f"{where}: local shape {tuple(value.local.shape)} but {layout.describe()} of {layout.global_shape} "
                f"over mesh {layout.mesh_shape} gives {sizes} at coordinate {layout.coordinate}"
            )
        if not layout.is_primary_replica():
            continue
        source, offset = _local_source(state, name, value.local, sources)
        extents += box_extents(source, offset, layout.global_shape, offsets, sizes)
    _check_coverage(name, reference.global_shape, extents, first_state.path)
    return TensorPlan(name, reference.global_shape, first.local.dtype, first.local.dtype, extents)


def plan_replicated(name: str, pieces, sources: StorageSources) -> TensorPlan:
    """A plain tensor every rank holds whole: the ranks must agree on it; rank 0's copy is read."""
    first_state, first = pieces[0]
    for state, value in pieces[1:]:
        if value.shape != first.shape or value.dtype != first.dtype:
            raise BadInput(
                f"{state.path}: plain tensor {name} is {value.dtype}{list(value.shape)} but {first.dtype}{list(first.shape)} "
                f"in {first_state.path}; a tensor held whole by every rank must agree"
            )
    source, offset = _local_source(first_state, name, first, sources)
    numel = prod(first.shape)
    extents = [Extent(source, offset, numel, 0)] if numel else []
    return TensorPlan(name, tuple(first.shape), first.dtype, first.dtype, extents)


def _plan_dim0_pieces(name: str, pieces, sources: StorageSources) -> TensorPlan:
    first_state, first = pieces[0]
    if len(first.shape) == 0:
        return plan_replicated(name, pieces, sources)
    rows = sum(v.shape[0] for _, v in pieces)
    shape = (rows, *first.shape[1:])
    extents = []
    for index, (state, value) in enumerate(pieces):
        if value.dtype != first.dtype or tuple(value.shape[1:]) != tuple(first.shape[1:]):
            raise BadInput(f"{state.path}: piece of {name} is {value.dtype}{list(value.shape)}, rank {first_state.rank} has {first.dtype}{list(first.shape)}")
        start, length = chunk_span(rows, len(pieces), index)
        if value.shape[0] != length:
            raise BadInput(
                f"{state.path}: piece of {name} has {value.shape[0]} rows; torch.chunk of {rows} rows over "
                f"{len(pieces)} ranks gives rank {state.rank} {length}"
            )
        source, offset = _local_source(state, name, value, sources)
        extents += box_extents(source, offset, shape, (start, *[0] * (len(shape) - 1)), tuple(value.shape))
    return TensorPlan(name, shape, first.dtype, first.dtype, extents)


def _check_coverage(name: str, shape, extents: list[Extent], where: str) -> None:
    # Distinct coordinates of a full mesh tile the tensor exactly; this catches anything else.
    if sum(e.numel for e in extents) != prod(shape):
        raise BadInput(f"{where}: the pieces of {name} cover {sum(e.numel for e in extents)} of its {prod(shape)} elements")
