"""A rank's local piece of a tensor, and the pieces that ranks hold twice (checks.copies compares them)."""

from __future__ import annotations

from math import prod
from typing import Protocol

from .._parsing.safe_load import TensorRef
from .._parsing.torch_zip import TorchZip
from ..errors import BadInput
from ..plan.model import Copy, Extent, TensorPlan

WHOLE_COPIES_DIFFER = (
    "every rank holds this tensor whole, so the copies must agree: the rank files come from "
    "different saves (steps) or one is damaged; merge the files of one complete save"
)
REPLICAS_DIFFER = (
    "the replica groups of an HSDP checkpoint hold the same shards, and these do not: the rank files "
    "come from different saves (steps) or one is damaged; merge the files of one complete save"
)


class SourceIndex(Protocol):
    """Where a stored tensor's bytes are among the plan's source buffers (readers.storage_sources)."""

    def index(self, path: str, tensor: TensorRef, archive: TorchZip | None = None) -> int: ...


def local_source(state, name: str, local: TensorRef, sources: SourceIndex) -> tuple[int, int]:
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


def local_piece(state, name: str, local: TensorRef, sources: SourceIndex) -> TensorPlan:
    """The local piece as a tensor of its own (its local shape), for comparing copies."""
    return piece_plan(name, local.shape, local.dtype, *local_source(state, name, local, sources))


def piece_plan(name: str, shape: tuple[int, ...], dtype: str, source: int, offset: int) -> TensorPlan:
    """A contiguous piece at `offset` in source buffer `source`, as a tensor of its own."""
    numel = prod(shape)
    return TensorPlan(name, tuple(shape), dtype, dtype, [Extent(source, offset, numel, 0)] if numel else [])


def whole_copies(name: str, pieces, sources: SourceIndex, problem: str = WHOLE_COPIES_DIFFER) -> list[Copy]:
    """Every other rank's copy of a tensor each rank holds whole, against the first rank's (the one read)."""
    first_state, first = pieces[0]
    kept = local_piece(first_state, name, first, sources)
    return [
        Copy(name, kept, local_piece(state, name, value, sources), _at(first_state), _at(state), problem)
        for state, value in pieces[1:]
    ]


def replica_copies(name: str, pieces, layouts, located) -> list[Copy]:
    """HSDP: each replica's local piece against the primary replica's piece of the same shard (the one read).
    `pieces`: (rank state, rank_files.DTensorPiece); `layouts`: theirs, checked when the DTensor was
    planned; `located`: (source buffers, offsets) of the pieces."""
    if not any(kind == "replicate" for kind, _, _ in layouts[0].placements):
        return []  # no replica groups (the pieces' placements agree): nothing is held twice
    primary, replicas = {}, []
    for (state, value), layout, source, offset in zip(pieces, layouts, *located):
        shard = tuple(c for c, (kind, _, _) in zip(layout.coordinate, layout.placements) if kind != "replicate")
        piece = (value, source, offset)
        if layout.is_primary_replica():
            primary[shard] = (state, piece)
        else:
            replicas.append((shard, state, piece, layout.coordinate))
    copies = []
    for shard, state, piece, coordinate in replicas:
        if shard not in primary:
            continue  # coverage of the primary replica is checked with the tensor's plan
        kept_state, kept = primary[shard]
        copies.append(
            Copy(
                name,
                _piece_plan(name, *kept),
                _piece_plan(name, *piece),
                f"the primary replica's piece ({kept_state.path})",
                f"the piece at mesh coordinate {list(coordinate)} ({state.path})",
                REPLICAS_DIFFER,
            )
        )
    return copies


def _piece_plan(name: str, value, source: int, offset: int) -> TensorPlan:
    return piece_plan(name, value.shape, value.dtype, source, offset)


def _at(state) -> str:
    return f"rank {state.rank}'s copy ({state.path})"
