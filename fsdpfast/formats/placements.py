"""What a DTensor's spec says about where its local piece sits in the global tensor.

Sharding follows torch.chunk: a dimension of size n split over k ranks gives pieces of
ceil(n / k), the trailing ranks holding fewer or none. Several mesh dimensions sharding one
tensor dimension nest, in mesh-dimension order unless the spec records another shard order.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ..errors import BadInput
from .safe_load import Record, TensorRef


@dataclass(frozen=True)
class DTensorLayout:
    global_shape: tuple[int, ...]
    dtype: str
    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...]  # this rank's position in the mesh
    placements: tuple[tuple[str, int | None], ...]  # ("shard", dim) | ("replicate", None) | (other, None)
    shard_order: tuple[tuple[int, tuple[int, ...]], ...]  # (tensor dim, mesh dims in sharding order)

    def describe(self) -> str:
        parts = [f"Shard({d})" if kind == "shard" else kind.capitalize() + "()" for kind, d in self.placements]
        return "(" + ", ".join(parts) + ")"

    def is_primary_replica(self) -> bool:
        """True on the one replica group that is read (coordinate 0 on every Replicate mesh dim)."""
        return all(c == 0 for c, (kind, _) in zip(self.coordinate, self.placements) if kind == "replicate")

    def local_box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) of this rank's piece in the global tensor."""
        offsets = [0] * len(self.global_shape)
        sizes = list(self.global_shape)
        for tensor_dim, mesh_dims in self.shard_order:
            for mesh_dim in mesh_dims:
                start, length = chunk_span(sizes[tensor_dim], self.mesh_shape[mesh_dim], self.coordinate[mesh_dim])
                offsets[tensor_dim] += start
                sizes[tensor_dim] = length
        return tuple(offsets), tuple(sizes)


def chunk_span(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of piece `index` when torch.chunk splits `size` into `parts`."""
    piece = -(-size // parts) if size else 0
    start = min(index * piece, size)
    return start, max(0, min(piece, size - start))


def read_layout(spec: Record, where: str) -> DTensorLayout:
    mesh = spec.get("mesh")
    meta = spec.get("tensor_meta")
    raw_placements = spec.get("placements")
    if not isinstance(mesh, Record) or not isinstance(meta, Record) or raw_placements is None:
        raise BadInput(f"{where}: DTensor spec lacks its mesh, placements or tensor metadata")
    global_shape, _stride, dtype = _tensor_meta(meta, where)
    mesh_shape = _mesh_shape(mesh, where)
    coordinate = mesh.get("_coordinate_on_dim")
    if coordinate is None or len(coordinate) != len(mesh_shape):
        raise BadInput(f"{where}: DTensor mesh does not record this rank's coordinate (was it saved by a rank outside the mesh?)")
    placements = tuple(_placement(p, where) for p in raw_placements)
    if len(placements) != len(mesh_shape):
        raise BadInput(f"{where}: {len(placements)} placements for a {len(mesh_shape)}-D mesh")
    for kind, dim in placements:
        if kind == "shard" and not 0 <= dim < len(global_shape):
            raise BadInput(f"{where}: Shard({dim}) on a tensor of {len(global_shape)} dims")
    return DTensorLayout(
        tuple(global_shape), str(dtype), mesh_shape, tuple(int(c) for c in coordinate), placements,
        _shard_order(spec, placements),
    )


def _tensor_meta(meta: Record, where: str):
    values = meta.args if len(meta.args) == 3 else (meta.get("shape"), meta.get("stride"), meta.get("dtype"))
    if values[0] is None:
        raise BadInput(f"{where}: DTensor spec has no global shape")
    return values


def _mesh_shape(mesh: Record, where: str) -> tuple[int, ...]:
    layout = mesh.get("_layout")
    if isinstance(layout, Record) and layout.get("axes") is not None:
        return tuple(prod(_as_tuple(axis.get("shape"))) for axis in layout.get("axes"))
    tensor = mesh.get("mesh")  # DeviceMesh of older releases pickles its rank tensor
    if isinstance(tensor, TensorRef):
        return tensor.shape
    raise BadInput(f"{where}: cannot read the DeviceMesh shape from this checkpoint")


def _as_tuple(value) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (int(value),)


def _placement(record: Record, where: str) -> tuple[str, int | None]:
    name = record.qualname.rsplit(".", 1)[-1]
    if name == "Shard":
        return "shard", int(record.get("dim", record.args[0] if record.args else 0))
    if name == "Replicate":
        return "replicate", None
    if name == "_StridedShard":
        raise BadInput(f"{where}: _StridedShard placements (FSDP combined with tensor parallel) are not supported yet")
    if "Partial" in name:
        raise BadInput(
            f"{where}: a Partial placement holds unreduced partial sums, not pieces of a tensor; "
            "save the model after the reduction (Shard or Replicate placements)"
        )
    raise BadInput(f"{where}: unknown DTensor placement {record.qualname}")


def _shard_order(spec: Record, placements) -> tuple[tuple[int, tuple[int, ...]], ...]:
    by_dim: dict[int, list[int]] = {}
    for mesh_dim, (kind, dim) in enumerate(placements):
        if kind == "shard":
            by_dim.setdefault(dim, []).append(mesh_dim)
    recorded = spec.get("shard_order")
    if recorded:
        for entry in recorded:
            tensor_dim, mesh_dims = (entry.args if isinstance(entry, Record) and len(entry.args) == 2
                                     else (entry.get("tensor_dim"), entry.get("mesh_dims")))
            if tensor_dim in by_dim and sorted(mesh_dims) == sorted(by_dim[tensor_dim]):
                by_dim[tensor_dim] = list(mesh_dims)
    return tuple((dim, tuple(mesh_dims)) for dim, mesh_dims in sorted(by_dim.items()))
