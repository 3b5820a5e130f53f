"""Where a rank sits in its DeviceMesh, and which piece it holds there.

A DeviceMesh records its ranks (the rank map: `_flatten_rank_map` with the mesh's `_layout`, or
in older releases the `mesh` tensor and `_flatten_mesh_list`), the saving rank (`_rank`) and that
rank's coordinate in it (`_coordinate_on_dim`, the rank's position in the mesh tensor). Two
numbers per mesh dim follow from the rank map and the rank, and they differ when the mesh does
not list a group's ranks in increasing order (`DeviceMesh("cpu", [3, 2, 1, 0])`):
* the mesh coordinate, which the file must record as its own (else the file contradicts itself);
* the rank's place in the process group of that mesh dim. torch builds every mesh dim's group
  from its ranks sorted (new_group and split_group both sort them), and FSDP2 shards by the
  group's rank, as every collective (full_tensor, the all-gathers of training) orders the
  pieces; so the piece a rank holds is the one at its group rank, whatever the coordinate says.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from .._parsing.safe_load import Record, TensorRef, is_count
from ..errors import BadInput

SubDims = tuple[tuple[int, int], ...]  # (size, stride) in the rank map of each part of a mesh dim, major first


@dataclass(frozen=True)
class MeshPlace:
    mesh_coordinate: tuple[int, ...]  # the rank's position in the mesh tensor
    group_coordinate: tuple[int, ...]  # its rank in each mesh dim's process group: where its pieces sit


def mesh_place(mesh: Record, rank: int | None, recorded: tuple[int, ...], where: str) -> MeshPlace | None:
    """Where `rank` (the mesh's own `_rank` if it records one) sits in `mesh`, checked against the
    coordinate the file records; None where the file records no rank map or no rank."""
    own = mesh.get("_rank")
    rank = own if is_count(own) else rank
    found = _rank_map(mesh, where)
    if found is None or rank is None:
        return None
    ranks, dims = found
    table = _table(ranks, dims, where)
    at = table.index.get(rank)
    if at is None:
        raise BadInput(f"{where}: saved by rank {rank}, which its DeviceMesh (ranks {_shown(ranks)}) does not hold")
    coordinate = tuple(_row_major([(at // stride) % size for size, stride in sub_dims], sub_dims) for sub_dims in dims)
    if coordinate != tuple(recorded):
        raise BadInput(
            f"{where}: rank {rank}'s DeviceMesh (ranks {_shown(ranks)}) puts rank {rank} at coordinate "
            f"{coordinate}, but the DTensor records coordinate {tuple(recorded)}; the file was altered or is "
            "damaged, so where its pieces go cannot be told"
        )
    return MeshPlace(coordinate, tuple(places[at] for places in table.group_places))


@dataclass(frozen=True)
class _MeshTable:
    """A rank map read once for all the files that hold it (each file holds the whole map)."""

    index: dict[int, int]  # rank -> its position in the rank map
    group_places: tuple[tuple[int, ...], ...]  # per mesh dim, per position: its rank's place in that dim's group


_TABLES: dict[tuple, _MeshTable] = {}
_TABLES_KEPT = 16


def _table(ranks: tuple[int, ...], dims: tuple[SubDims, ...], where: str) -> _MeshTable:
    key = (ranks, dims)
    try:
        table = _TABLES.get(key)
    except TypeError:  # something unhashable among the ranks
        table = None
    if table is None:
        if not all(is_count(r) for r in ranks) or len(set(ranks)) != len(ranks):
            raise BadInput(f"{where}: the DeviceMesh's ranks {_shown(ranks)} are not distinct whole numbers")
        if prod(size for sub_dims in dims for size, _ in sub_dims) > len(ranks):
            raise BadInput(f"{where}: the DeviceMesh's layout spans more than its {len(ranks)} ranks")
        if len(_TABLES) >= _TABLES_KEPT:
            _TABLES.clear()
        index = {r: i for i, r in enumerate(ranks)}
        table = _TABLES[key] = _MeshTable(index, tuple(_group_places(ranks, sub_dims, where) for sub_dims in dims))
    return table


def _group_places(ranks: tuple[int, ...], sub_dims: SubDims, where: str) -> tuple[int, ...]:
    """For each position of the rank map, its rank's place among the ranks of its group along this
    mesh dim, sorted as torch sorts a process group's ranks."""
    places = [0] * len(ranks)
    for base in range(len(ranks)):
        if any((base // stride) % size for size, stride in sub_dims):
            continue  # not the first position of a group
        members = [base]
        for size, stride in sub_dims:
            members = [p + k * stride for p in members for k in range(size)]
        if max(members) >= len(ranks):
            raise BadInput(f"{where}: the DeviceMesh's layout reaches past its {len(ranks)} ranks")
        for place, position in enumerate(sorted(members, key=ranks.__getitem__)):
            places[position] = place
    return tuple(places)


def _rank_map(mesh: Record, where: str) -> tuple[tuple[int, ...], tuple[SubDims, ...]] | None:
    """(the ranks, each mesh dim's parts) as the mesh records them, or None if it does not."""
    layout, ranks = mesh.get("_layout"), mesh.get("_flatten_rank_map")
    if isinstance(layout, Record) and layout.get("axes") is not None:
        if ranks is None:
            return None
        dims = tuple(_sub_dims(axis, where) for axis in layout.get("axes"))
    else:  # older releases: the mesh tensor itself, row-major, and its ranks flattened
        tensor, ranks = mesh.get("mesh"), mesh.get("_flatten_mesh_list")
        if not isinstance(tensor, TensorRef) or ranks is None:
            return None
        shape = tensor.shape
        if not all(shape):
            raise BadInput(f"{where}: the DeviceMesh's mesh tensor has shape {shape}")
        dims = tuple(((size, prod(shape[i + 1 :])),) for i, size in enumerate(shape))
    if not isinstance(ranks, (tuple, list)):
        raise BadInput(f"{where}: the DeviceMesh's ranks {_shown(ranks)} are not distinct whole numbers")
    return tuple(ranks), dims


def _sub_dims(axis, where: str) -> SubDims:
    """A layout axis's (size, stride) parts: one for a plain mesh dim, more for a flattened one."""
    shape, stride = (axis.get("shape"), axis.get("stride")) if isinstance(axis, Record) else (None, None)
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    stride = tuple(stride) if isinstance(stride, (tuple, list)) else (stride,)
    if len(shape) != len(stride) or not all(is_count(n) and n > 0 for n in shape + stride):
        raise BadInput(f"{where}: the DeviceMesh's layout is not one torch writes (axis {axis!r:.80})")
    return tuple(zip(shape, stride))


def _row_major(digits: list[int], sub_dims: SubDims) -> int:
    index = 0
    for digit, (size, _) in zip(digits, sub_dims):
        index = index * size + digit
    return index


def _shown(ranks) -> str:
    text = repr(list(ranks)) if isinstance(ranks, (tuple, list)) else repr(ranks)
    return text if len(text) <= 40 else text[:36] + " ...]"
