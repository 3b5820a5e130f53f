"""A rank's local piece of a tensor, and the pieces that ranks hold twice (plan.copies compares them)."""

from __future__ import annotations

from math import prod

from .._parsing.safe_load import TensorRef
from ..errors import BadInput
from ..plan.model import Copy, Extent, TensorPlan
from .placements import read_layout
from .storage_sources import StorageSources

WHOLE_COPIES_DIFFER = (
    "every rank holds this tensor whole, so the copies must agree: the rank files come from "
    "different saves (steps) or one is damaged; merge the files of one complete save"
)
REPLICAS_DIFFER = (
    "the replica groups of an HSDP checkpoint hold the same shards, and these do not: the rank files "
    "come from different saves (steps) or one is damaged; merge the files of one complete save"
)


def local_source(state, name: str, local: TensorRef, sources: StorageSources) -> tuple[int, int]:
    """(source buffer, element offset) of a rank's contiguous local piece."""
    known = _ROW_MAJOR.get(local.shape)
    if known != local.stride:
        if not local.is_contiguous():
            raise BadInput(
                f"{state.path}: the local piece of {name} is not contiguous (strides {local.stride}); not supported yet"
            )
        if known is None and len(_ROW_MAJOR) < 1 << 16:
            _ROW_MAJOR[local.shape] = local.stride  # contiguous: the next piece of this shape and stride is too
    if local.offset + prod(local.shape) > local.storage.numel:
        raise BadInput(f"{state.path}: {name} reaches past the end of its storage; the file is corrupt")
    return sources.index(state.path, local, state.archive), local.offset


_ROW_MAJOR: dict[tuple[int, ...], tuple[int, ...]] = {}  # shape -> a stride seen contiguous with it


def local_piece(state, name: str, local: TensorRef, sources: StorageSources) -> TensorPlan:
    """The local piece as a tensor of its own (its local shape), for comparing copies."""
    source, offset = local_source(state, name, local, sources)
    numel = prod(local.shape)
    return TensorPlan(
        name, tuple(local.shape), local.dtype, local.dtype, [Extent(source, offset, numel, 0)] if numel else []
    )


def whole_copies(name: str, pieces, sources: StorageSources, problem: str = WHOLE_COPIES_DIFFER) -> list[Copy]:
    """Every other rank's copy of a tensor each rank holds whole, against the first rank's (the one read)."""
    first_state, first = pieces[0]
    kept = local_piece(first_state, name, first, sources)
    return [
        Copy(name, kept, local_piece(state, name, value, sources), _at(first_state), _at(state), problem)
        for state, value in pieces[1:]
    ]


def replica_copies(name: str, pieces, sources: StorageSources, layouts=None) -> list[Copy]:
    """HSDP: each replica's local piece against the primary replica's piece of the same shard (the one read).
    The pieces' layouts were checked when the DTensor was planned (`layouts`: theirs, if at hand)."""
    if layouts is None:
        layouts = [read_layout(value.spec, f"{state.path}: {name}") for state, value in pieces]
    if not any(kind == "replicate" for kind, _, _ in layouts[0].placements):
        return []  # no replica groups (the pieces' placements agree): nothing is held twice
    primary, replicas = {}, []
    for (state, value), layout in zip(pieces, layouts):
        shard = tuple(c for c, (kind, _, _) in zip(layout.coordinate, layout.placements) if kind != "replicate")
        if layout.is_primary_replica():
            primary[shard] = (state, value)
        else:
            replicas.append((shard, state, value, layout.coordinate))
    copies = []
    for shard, state, value, coordinate in replicas:
        if shard not in primary:
            continue  # coverage of the primary replica is checked with the tensor's plan
        kept_state, kept = primary[shard]
        copies.append(
            Copy(
                name,
                local_piece(kept_state, name, kept.local, sources),
                local_piece(state, name, value.local, sources),
                f"the primary replica's piece ({kept_state.path})",
                f"the piece at mesh coordinate {list(coordinate)} ({state.path})",
                REPLICAS_DIFFER,
            )
        )
    return copies


def _at(state) -> str:
    return f"rank {state.rank}'s copy ({state.path})"
