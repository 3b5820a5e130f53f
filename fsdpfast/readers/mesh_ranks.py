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
    at = _index_of(ranks, rank, where)
    coordinate, groups = [], []
    for sub_dims in dims:
        digits = [(at // stride) % size for size, stride in sub_dims]
        base = at - sum(d * stride for d, (_, stride) in zip(digits, sub_dims))
        members = _group(ranks, base, sub_dims, where)
        coordinate.append(_row_major(digits, sub_dims))
        groups.append(sum(1 for member in members if member < rank))
    coordinate = tuple(coordinate)
    if coordinate != tuple(recorded):
        raise BadInput(
            f"{where}: rank {rank}'s DeviceMesh (ranks {_shown(ranks)}) puts rank {rank} at coordinate "
            f"{coordinate}, but the DTensor records coordinate {tuple(recorded)}; the file was altered or is "
            "damaged, so where its pieces go cannot be told"
        )
    return MeshPlace(coordinate, tuple(groups))


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
        dims = tuple(((size, prod(shape[i + 1 :])),) for i, size in enumerate(shape))
    if not isinstance(ranks, (tuple, list)) or not all(is_count(r) for r in ranks) or len(set(ranks)) != len(ranks):
        raise BadInput(f"{where}: the DeviceMesh's ranks {_shown(ranks)} are not distinct whole numbers")
    return tuple(ranks), dims


def _sub_dims(axis, where: str) -> SubDims:
    """A layout axis's (size, stride) parts: one for a plain mesh dim, more for a flattened one."""
    shape, stride = (axis.get("shape"), axis.get("stride")) if isinstance(axis, Record) else (None, None)
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    stride = tuple(stride) if isinstance(stride, (tuple, list)) else (stride,)
    if len(shape) != len(stride) or not all(is_count(n) for n in shape + stride):
        raise BadInput(f"{where}: the DeviceMesh's layout is not one torch writes (axis {axis!r:.80})")
    return tuple(zip(shape, stride))


def _index_of(ranks: tuple[int, ...], rank: int, where: str) -> int:
    try:
        return ranks.index(rank)
    except ValueError:
        raise BadInput(
            f"{where}: saved by rank {rank}, which its DeviceMesh (ranks {_shown(ranks)}) does not hold"
        ) from None


def _group(ranks: tuple[int, ...], base: int, sub_dims: SubDims, where: str) -> list[int]:
    """The ranks of one mesh dim's group: every position along the dim from `base`."""
    positions = [base]
    for size, stride in sub_dims:
        positions = [p + k * stride for p in positions for k in range(size)]
    if positions and (min(positions) < 0 or max(positions) >= len(ranks)):
        raise BadInput(f"{where}: the DeviceMesh's layout reaches past its {len(ranks)} ranks")
    return [ranks[p] for p in positions]


def _row_major(digits: list[int], sub_dims: SubDims) -> int:
    index = 0
    for digit, (size, _) in zip(digits, sub_dims):
        index = index * size + digit
    return index


def _shown(ranks) -> str:
    text = repr(list(ranks)) if isinstance(ranks, (tuple, list)) else repr(ranks)
    return text if len(text) <= 40 else text[:36] + " ...]"
