"""Plan a merge from one torch.save file per rank, each holding that rank's state dict.

Shared by the per-rank layouts: a reader finds the files and says where the model's state
dict sits in each file's object; this module checks the ranks agree and turns every
tensor's pieces into extents. DTensors say where their piece goes (HSDP replicas of a piece
are compared with the one read); plain tensors next to DTensors are whole on every rank
(buffers; the copies are compared); in files with no DTensor at all, plain_pieces decides
per tensor between whole copies and torch.chunk pieces.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from typing import Any

from .._parsing.pickle_twins import Twins
from .._parsing.safe_load import DTensorRef, ShardedTensorRef, TensorRef
from .._parsing.torch_zip import TorchZip
from ..errors import BadInput, option
from ..geometry.local_pieces import local_source as _local_source
from ..geometry.local_pieces import replica_copies, whole_copies
from ..geometry.placements import DTensorLayout, choose_reading, read_layout
from ..plan.columns import RecordsBuilder
from ..plan.model import Extent, MergePlan, TensorPlan
from .plain_pieces import plan_plain_tensors
from .storage_sources import StorageSources

UNORDERED_MESH_NOTE = (
    "the DeviceMesh does not list its ranks in increasing order: each piece is placed at its rank's place in "
    "the mesh dim's process group (torch sorts a group's ranks; FSDP2 shards and full_tensor() gathers by them), "
    "not at the mesh coordinate the DTensor records"
)


@dataclass(frozen=True, slots=True)
class DTensorPiece:
    """A rank's DTensor once its file is read: what planning needs, and no more. One object per
    (layout, local shape, dtype): a rank's tensors of one shape share it. Where its bytes lie is
    kept apart, in RankState.located (two numbers a piece, not a TensorRef and its storage record)."""

    layout: DTensorLayout
    shape: tuple[int, ...]  # the local piece's
    dtype: str


@dataclass
class RankState:
    rank: int
    path: str
    archive: TorchZip  # read and closed: it answers where each storage record lies
    tensors: dict[str, TensorRef | DTensorPiece]
    skipped: list[str]  # non-tensor entries of the state dict
    whole: Any  # the whole unpickled object, for readers that report what else it holds (None if not kept)
    sources: StorageSources  # the plan's source buffers, one for all ranks
    # (source buffer, element offset) of each DTensorPiece in `tensors`, in their order; source -1
    # for an empty piece (nothing to read nor to check). Given up once planning has gathered them.
    located: tuple[array, array] | None = None


def whole_state_dict(whole, path: str) -> dict:
    """The model part of a file that holds a state dict and nothing else (verl's and accelerate's rank files)."""
    if not isinstance(whole, dict):
        raise BadInput(f"{path}: holds a {type(whole).__name__}, not a state dict of tensors")
    return whole


def load_rank_states(
    rank_paths: list[tuple[int, str]],
    model_part: Callable[[Any, str], dict],
    sharded_tensors: bool = False,
    unpickled: dict[str, Any] | None = None,
    keep_whole: bool = True,
) -> list[RankState]:
    """Each rank's file; ShardedTensors (FSDP1) are refused unless the reader handles them itself.

    `unpickled`: {path: object} of files the reader already unpickled (detection reads rank 0 once).
    Each file is read whole and closed before the next is opened, and what planning does not need
    is let go at once: the pickle's bytes, and (without `keep_whole`) the unpickled object. A
    DTensor becomes a DTensorPiece: its spec record (a DeviceMesh lists every rank) gives way to
    its layout, its local TensorRef to the source buffer and offset where its bytes lie.
    """
    states = []
    names: dict[str, str] = {}  # one string per tensor name, whatever the number of ranks
    layouts = SpecLayouts()
    pieces: dict[tuple, DTensorPiece] = {}
    sources = StorageSources()
    twins = Twins()  # the files pickle one program: read the first, the others as their changes
    for rank, path in rank_paths:
        archive = TorchZip(path)  # read and closed: the storage spans stay, no file stays open
        whole = unpickled[path] if unpickled and path in unpickled else twins.load(archive.pickle_bytes, path)
        archive.close()
        state_dict = model_part(whole, path)
        state = RankState(rank, path, archive, {}, [], whole if keep_whole else None, sources, (array("q"), array("q")))
        tensors, skipped, (where_source, where_offset) = state.tensors, state.skipped, state.located
        for name, value in state_dict.items():
            if isinstance(value, (TensorRef, DTensorRef)):
                key = names.setdefault(str(name), str(name))
                if isinstance(value, DTensorRef):
                    layout = layouts.of(value.spec, lambda path=path, key=key: f"{path}: {key}", rank)
                    if value.shape != layout.global_shape or value.stride != layout.global_stride:
                        _outer_disagrees(f"{path}: {key}", value, layout)
                    local = value.local
                    source, offset = _local_source(state, key, local, sources) if prod(local.shape) else (-1, 0)
                    where_source.append(source)
                    where_offset.append(offset)
                    kind = (id(layout), local.shape, local.dtype)  # layouts are interned: their ids stay theirs
                    value = pieces.get(kind)
                    if value is None:
                        value = pieces[kind] = DTensorPiece(layout, local.shape, local.dtype)
                tensors[key] = value
            elif isinstance(value, ShardedTensorRef) and not sharded_tensors:
                archive.close()
                hint = (
                    f"FSDP1 flat parameters: read them with {option('layout', 'fsdp1-flat')}"
                    if str(name).endswith("_flat_param")
                    else "FSDP1 SHARDED_STATE_DICT rank files are not supported yet"
                )
                raise BadInput(f"{path}: {name} is a ShardedTensor; {hint}")
            else:
                skipped.append(str(name))
        states.append(state)
        # Its DTensors' storages have their buffers; one a plain tensor shares would get a second one.
        sources.forget(path)
        layouts.forget_specs()  # the next file's records are others: let this file's go
    return states


def plan_from_ranks(states: list[RankState], layout: str, config_dir: str | None = None) -> MergePlan:
    """The plan for these ranks; their archives are closed once it is made (the plan holds paths).
    `config_dir`: the folder of the model's config.json, which places plain pieces (plain_pieces)."""
    try:
        return _plan(states, layout, config_dir)
    finally:
        for state in states:
            state.archive.close()


def _plan(states: list[RankState], layout: str, config_dir: str | None) -> MergePlan:
    world = len(states)
    _check_same_names(states)
    any_dtensor = any(type(v) is DTensorPiece for s in states for v in s.tensors.values())
    sources = states[0].sources
    tensors, copies, notes = [], [], []
    columns: dict[str, list] = {name: [] for name in states[0].tensors}
    located: dict[str, tuple[array, array]] = {name: (array("q"), array("q")) for name in states[0].tensors}
    # Each tensor's pieces, and where each DTensor's local piece lies (source buffer, element
    # offset; -1 for an empty piece, which has nothing to read nor to check), gathered file by
    # file: one file's records at a time is what stays in the processor's cache.
    for state in states:
        at = iter(zip(*state.located))
        for name, value in state.tensors.items():
            columns[name].append(value)
            if type(value) is DTensorPiece:
                source, offset = next(at)
                located[name][0].append(source)
                located[name][1].append(offset)
        state.located = None
    placed: dict[tuple[int, ...], _Placement] = {}
    for name, values in columns.items():
        pieces = list(zip(states, values))
        kinds = {type(v) for v in values}
        if len(kinds) > 1:
            raise BadInput(f"{states[0].path}: {name} is a DTensor in some rank files and a plain tensor in others")
        if kinds == {DTensorPiece}:
            tensor, piece_layouts = _plan_dtensor(name, pieces, world, located[name], placed)
            tensors.append(tensor)
            copies += replica_copies(name, pieces, piece_layouts, located[name])
        elif world == 1 or any_dtensor:
            tensors.append(plan_replicated(name, pieces, sources))
            copies += whole_copies(name, pieces, sources)
    if world > 1 and not any_dtensor:
        tensors, copies, notes = plan_plain_tensors(list(states[0].tensors), states, config_dir, sources)
    if any(layout.mesh_coordinate is not None for p in placed.values() for layout in p.layouts):
        notes.append(UNORDERED_MESH_NOTE)
    skipped = sorted({k for s in states for k in s.skipped})
    if skipped:
        notes.append(
            f"skipped {len(skipped)} non-tensor entries: {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}"
        )
    return MergePlan(layout, world, sources.buffers, tensors, notes, copies=copies)


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


class SpecLayouts:
    """Each DTensor spec read once. A rank file's tensors of one shape share one spec record (the
    pickle memo), so a file of hundreds of tensors holds a handful; and equal layouts (the same
    shape and placements at the same mesh coordinate) are one object, with its runs worked out once."""

    def __init__(self):
        self._by_spec: dict[int, tuple[object, DTensorLayout]] = {}
        self._interned: dict[DTensorLayout, DTensorLayout] = {}

    def of(self, spec, where: Callable[[], str], rank: int | None = None) -> DTensorLayout:
        """The layout of `spec` (a spec record) in the file of `rank`; `where()` names it in a message."""
        known = self._by_spec.get(id(spec))
        if known is not None and known[0] is spec:
            return known[1]
        layout = read_layout(spec, where(), rank)
        layout = self._interned.setdefault(layout, layout)
        self._by_spec[id(spec)] = (spec, layout)  # the spec kept alive, so its id is not reused
        return layout

    def forget_specs(self) -> None:
        self._by_spec.clear()


class _Wheres:
    """ "path: name" of each piece, made only when a message needs one."""

    def __init__(self, pieces, name: str):
        self.pieces, self.name = pieces, name

    def __len__(self) -> int:
        return len(self.pieces)

    def __getitem__(self, i: int) -> str:
        return f"{self.pieces[i][0].path}: {self.name}"


@dataclass(frozen=True)
class _Placement:
    """Where a tensor's pieces go, checked: the same for every tensor whose rank files hold the same
    sequence of DTensorPieces (rank by rank the same layout, local shape and dtype), as the tensors
    of one shape do."""

    layouts: tuple[DTensorLayout, ...]  # each piece's
    read: tuple[tuple[int, tuple], ...]  # (piece, its extents relative to the piece) of the pieces read
    global_shape: tuple[int, ...]
    dtype: str


def _plan_dtensor(
    name: str, pieces, world: int, located: tuple[array, array], placed: dict[tuple[int, ...], _Placement]
) -> tuple[TensorPlan, tuple[DTensorLayout, ...]]:
    """The tensor's plan, and each piece's layout. `placed`: the placements worked out so far, by
    the ids of the pieces' DTensorPieces (alive while planning, so their ids stay theirs)."""
    key = tuple([id(value) for _, value in pieces])
    placement = placed.get(key)
    if placement is None:
        placement = placed[key] = _place(name, pieces, world)
    sources, offsets = located
    rows = [
        (sources[i], offsets[i] + src, count, dst, n, src_stride, dst_stride)
        for i, runs in placement.read
        for src, count, dst, n, src_stride, dst_stride in runs
    ]
    extents = RecordsBuilder(Extent)  # a thousand a tensor at 1,024 ranks: in columns
    extents.extend(rows)
    dtype = placement.dtype
    return TensorPlan(name, placement.global_shape, dtype, dtype, extents.done()), placement.layouts


def _place(name: str, pieces, world: int) -> _Placement:
    """Check that the pieces make one tensor and choose the copy of each piece to read. (The loops
    run once per rank for each distinct placement, so the checks are direct and messages are made
    only when needed.)"""
    first_state, first = pieces[0]
    wheres = _Wheres(pieces, name)
    reference = first.layout
    copies = _copies_per_coordinate(reference, world, wheres[0])
    dtype = first.dtype
    layouts = []
    holders: dict[tuple[int, ...], list[str]] = {}
    for i, (state, value) in enumerate(pieces):
        layout = value.layout
        if value.dtype != dtype or (
            layout is not reference
            and (
                layout.global_shape != reference.global_shape
                or layout.placements != reference.placements
                or layout.mesh_shape != reference.mesh_shape
            )
        ):
            _disagreement(wheres[i], layout, value, reference, first, first_state)
        if layout.mesh_rank is not None and layout.mesh_rank != state.rank:
            raise BadInput(
                f"{wheres[i]}: its DeviceMesh says rank {layout.mesh_rank} saved it, not rank {state.rank}; "
                "are two files copies of one rank?"
            )
        same = holders.get(layout.coordinate)
        if same is None:
            holders[layout.coordinate] = [state.path]
        else:
            same.append(state.path)
            if len(same) > copies:
                raise BadInput(
                    f"{wheres[i]}: same mesh coordinate {layout.coordinate} as {same[0]}; are two files copies of one rank?"
                )
        layouts.append(layout)
    reading = choose_reading(layouts, [value.shape for _, value in pieces], wheres)
    read = []
    covered = 0
    for i, ((state, _), layout) in enumerate(zip(pieces, layouts)):
        # One copy of each piece is read: coordinate 0 on Replicate mesh dims, and of the files
        # holding one coordinate of a sub-mesh (copies across the other mesh dims), the first.
        runs = layout.local_extents(reading)
        if not runs or not layout.primary or (copies > 1 and holders[layout.coordinate][0] != state.path):
            continue
        read.append((i, runs))
        covered += sum(n * count for _, count, _, n, _, _ in runs)
    if covered != prod(reference.global_shape):  # distinct coordinates of a full mesh tile the tensor exactly
        raise BadInput(
            f"{first_state.path}: the pieces of {name} cover {covered} of its {prod(reference.global_shape)} elements"
        )
    return _Placement(tuple(layouts), tuple(read), reference.global_shape, dtype)


def _outer_disagrees(where: str, value: DTensorRef, layout: DTensorLayout) -> None:
    """The error for a DTensor whose own size or stride is not its spec's (torch.load would take
    both; the DTensor's shape would then say one thing and its sharding another)."""
    if value.shape != layout.global_shape:
        mine, spec, what = value.shape, layout.global_shape, "size"
    else:
        mine, spec, what = value.stride, layout.global_stride, "stride"
    raise BadInput(
        f"{where}: the DTensor's {what} {mine} disagrees with {spec} in its spec's tensor_meta; "
        "the file was altered or is damaged"
    )


def _disagreement(where: str, layout, value, reference, first, first_state) -> None:
    """The error for a piece whose layout or dtype is not the first rank's."""
    for field, mine, theirs in (
        ("global shape", layout.global_shape, reference.global_shape),
        ("dtype", value.dtype, first.dtype),
        ("placements", layout.describe(), reference.describe()),
        ("mesh shape", layout.mesh_shape, reference.mesh_shape),
    ):
        if mine != theirs:
            raise BadInput(f"{where}: {field} {mine} disagrees with {theirs} in {first_state.path}")


def _copies_per_coordinate(layout, world: int, where: str) -> int:
    """How many rank files hold each mesh coordinate: 1 on a mesh of all ranks; world / mesh size
    on a sub-mesh (mesh["dp"] of a dp x tp mesh), whose pieces repeat across the other dims."""
    ranks = prod(layout.mesh_shape)
    if layout.mesh_world is not None and layout.mesh_world != world:
        raise BadInput(
            f"{where}: its DeviceMesh belongs to a mesh of {layout.mesh_world} ranks but the folder holds "
            f"{world} rank files; all rank files of one checkpoint are needed"
        )
    if ranks == world:
        return 1
    if ranks > world or world % ranks:
        raise BadInput(
            f"{where}: its DeviceMesh has {ranks} ranks but the folder holds {world} rank files; "
            "all rank files of one checkpoint are needed"
        )
    return world // ranks


def plan_replicated(name: str, pieces, sources: StorageSources) -> TensorPlan:
    """A plain tensor every rank holds whole: the ranks must agree on its shape and dtype (and bytes:
    whole_copies); rank 0's copy is read."""
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
