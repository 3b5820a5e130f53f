"""What a DTensor's spec says about where its local piece sits in the global tensor.

Sharding follows torch.chunk: a dimension of size n split over k ranks gives pieces of
ceil(n / k), the trailing ranks holding fewer or none. Several mesh dimensions sharding one
tensor dimension nest, in mesh-dimension order unless the spec records another shard order.

`_StridedShard(dim, split_factor=f)` (FSDP2 over a tensor-parallel mesh: the tensor was split
over the mesh dimensions to its right first) has two readings in torch, which agree whenever the
sizes divide evenly:
* "shard order": torch decodes the split factors into the order the mesh dimensions sharded the
  tensor dimension, and the pieces nest in that order (tp first, then dp). This is what FSDP2
  holds and what `full_tensor()` gathers.
* "left to right": the placements are applied in mesh order, a `_StridedShard` cutting the rows
  held so far into f torch.chunk pieces, each of those into k, a rank keeping its k-piece of every
  one of the f in order (`distribute_tensor`, and the chunk DCP records). A rank's rows are then an
  ordered list of ranges, not one range: its local piece is one or more boxes of the tensor.
Where they differ (uneven sizes), the local shapes in the files say which one the writer used.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from math import prod

from .._parsing.safe_load import Record, TensorRef, as_dims, is_count
from ..errors import BadInput
from .boxes import box_extents
from .mesh_ranks import mesh_place

Runs = tuple[tuple[int, int], ...]  # (global start, length) ranges, in the order the local piece holds them


@dataclass(frozen=True)
class Box:
    """A block of the local piece: `sizes` elements at `local_offsets` in it, at `offsets` in the global tensor."""

    offsets: tuple[int, ...]
    local_offsets: tuple[int, ...]
    sizes: tuple[int, ...]


SHARD_ORDER, LEFT_TO_RIGHT = "shard order", "left to right"  # the readings of _StridedShard (above)


@dataclass(frozen=True)
class DTensorLayout:
    global_shape: tuple[int, ...]
    dtype: str
    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...]  # where this rank's piece sits: its rank in each mesh dim's process group
    # ("shard", dim, 1) | ("strided", dim, split_factor) | ("replicate", None, 1)
    placements: tuple[tuple[str, int | None, int], ...]
    # (tensor dim, mesh dims in sharding order): recorded, decoded from _StridedShard split
    # factors, or mesh order; None where the split factors decode to no order
    shard_order: tuple[tuple[int, tuple[int, ...]], ...] | None
    mesh_rank: int | None = None  # the global rank that saved it, where the DeviceMesh records it
    mesh_world: int | None = None  # ranks in the whole mesh this one is part of (a sub-mesh's root), if recorded
    global_stride: tuple[int, ...] | None = None  # the spec's, where recorded as whole numbers
    # the rank's coordinate in the mesh tensor, where it is not `coordinate` (a mesh whose ranks do not
    # increase along a dim: geometry.mesh_ranks)
    mesh_coordinate: tuple[int, ...] | None = None

    def describe(self) -> str:
        names = {"shard": "Shard({})", "strided": "_StridedShard({}, split_factor={})", "replicate": "Replicate()"}
        return "(" + ", ".join(names[kind].format(dim, factor) for kind, dim, factor in self.placements) + ")"

    def coordinate_note(self) -> str:
        """What a message adds where the piece's coordinate is not the rank's place in the mesh tensor."""
        if self.mesh_coordinate is None:
            return ""
        return (
            f" (its process-group ranks, as FSDP2 shards; its DeviceMesh coordinate is {self.mesh_coordinate}, "
            "the mesh not listing its ranks in increasing order)"
        )

    def is_primary_replica(self) -> bool:
        """True on the one replica group that is read (coordinate 0 on every Replicate mesh dim)."""
        return all(c == 0 for c, (kind, _, _) in zip(self.coordinate, self.placements) if kind == "replicate")

    @property
    def primary(self) -> bool:
        """is_primary_replica(), worked out once."""
        known = self.__dict__.get("_primary")
        if known is None:
            known = self.__dict__["_primary"] = self.is_primary_replica()
        return known

    def readings(self) -> tuple[str, ...]:
        """The ways torch places this spec's pieces: one without _StridedShard, else those that apply."""
        if not any(kind == "strided" for kind, _, _ in self.placements):
            return (SHARD_ORDER,)
        return (SHARD_ORDER, LEFT_TO_RIGHT) if self.shard_order is not None else (LEFT_TO_RIGHT,)

    def local_runs(self, reading: str = SHARD_ORDER) -> tuple[Runs, ...]:
        """For each tensor dimension, the global ranges this rank holds, in local order (worked out
        once per reading: a layout is shared by every tensor of its shape in a file)."""
        known = self.__dict__.setdefault("_runs", {})  # beside the fields: not part of eq or hash
        if reading not in known:
            known[reading] = self._local_runs(reading)
        return known[reading]

    def _local_runs(self, reading: str) -> tuple[Runs, ...]:
        runs: list[Runs] = [((0, size),) if size else () for size in self.global_shape]
        if reading == SHARD_ORDER:
            steps = [(dim, mesh_dim, 1) for dim, mesh_dims in self.shard_order for mesh_dim in mesh_dims]
        else:
            steps = [
                (dim, mesh_dim, factor)
                for mesh_dim, (kind, dim, factor) in enumerate(self.placements)
                if kind != "replicate"
            ]
        for tensor_dim, mesh_dim, factor in steps:
            runs[tensor_dim] = strided_pick(
                runs[tensor_dim], factor, self.mesh_shape[mesh_dim], self.coordinate[mesh_dim]
            )
        return tuple(runs)

    def local_shape(self, reading: str = SHARD_ORDER) -> tuple[int, ...]:
        known = self.__dict__.setdefault("_shapes", {})
        if reading not in known:
            known[reading] = tuple(sum(length for _, length in dim_runs) for dim_runs in self.local_runs(reading))
        return known[reading]

    def local_extents(self, reading: str = SHARD_ORDER) -> tuple[tuple[int, ...], ...]:
        """The extents that place this rank's local piece (of the shape this reading gives it), as
        (source offset, count, destination offset, runs, source stride, destination stride) with
        the source offset relative to the piece: the same for every tensor of this layout."""
        known = self.__dict__.setdefault("_extents", {})
        if reading not in known:
            shape = self.local_shape(reading)
            known[reading] = tuple(
                (e.src_offset, e.count, e.dst_offset, e.runs, e.src_stride, e.dst_stride)
                for box in self.local_boxes(reading)
                for e in box_extents(0, 0, self.global_shape, box.offsets, box.sizes, shape, box.local_offsets)
            )
        return known[reading]

    def local_boxes(self, reading: str = SHARD_ORDER) -> list[Box]:
        """The boxes of the global tensor that make up this rank's local piece (none if it is empty)."""
        known = self.__dict__.setdefault("_boxes", {})
        if reading not in known:
            known[reading] = self._local_boxes(reading)
        return known[reading]

    def _local_boxes(self, reading: str) -> list[Box]:
        per_dim = []
        for dim_runs in self.local_runs(reading):
            local, placed = 0, []
            for start, length in dim_runs:
                placed.append((start, local, length))
                local += length
            per_dim.append(placed)
        return [
            Box(tuple(s for s, _, _ in combo), tuple(lo for _, lo, _ in combo), tuple(n for _, _, n in combo))
            for combo in product(*per_dim)
        ]


def choose_reading(layouts: list[DTensorLayout], local_shapes: list[tuple[int, ...]], wheres: list[str]) -> str:
    """The reading under which every rank's local piece has the shape its file holds; refused when
    none fits, or when two fit and would place some piece differently."""
    readings = layouts[0].readings()
    fits = [r for r in readings if all(layout.local_shape(r) == shape for layout, shape in zip(layouts, local_shapes))]
    if not fits:
        reading = readings[0]
        i = next(i for i, layout in enumerate(layouts) if layout.local_shape(reading) != local_shapes[i])
        layout = layouts[i]
        raise BadInput(
            f"{wheres[i]}: local shape {local_shapes[i]} but {layout.describe()} of {layout.global_shape} "
            f"over mesh {layout.mesh_shape} gives {layout.local_shape(reading)} at coordinate {layout.coordinate}"
            + layout.coordinate_note()
        )
    for other in fits[1:]:
        for layout, where in zip(layouts, wheres):
            if layout.local_runs(other) != layout.local_runs(fits[0]):
                raise BadInput(
                    f"{where}: {layout.describe()} of {layout.global_shape} over mesh {layout.mesh_shape} "
                    f"fits the files read {fits[0]} and read {other}, which place coordinate "
                    f"{layout.coordinate}'s piece differently; which one the writer used cannot be told"
                )
    return fits[0]


def chunk_span(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of piece `index` when torch.chunk splits `size` into `parts`."""
    piece = -(-size // parts) if size else 0
    start = min(index * piece, size)
    return start, max(0, min(piece, size - start))


def strided_pick(runs: Runs, factor: int, parts: int, index: int) -> Runs:
    """The ranges rank `index` of `parts` keeps of `runs` under _StridedShard(split_factor=factor);
    factor 1 is a plain Shard (one torch.chunk piece)."""
    total = sum(length for _, length in runs)
    picked: list[tuple[int, int]] = []
    for block in range(factor):
        block_start, block_length = chunk_span(total, factor, block)
        start, length = chunk_span(block_length, parts, index)
        for run in _slice_runs(runs, block_start + start, length):
            if picked and picked[-1][0] + picked[-1][1] == run[0]:
                picked[-1] = (picked[-1][0], picked[-1][1] + run[1])
            else:
                picked.append(run)
    return tuple(picked)


def _slice_runs(runs: Runs, start: int, length: int) -> list[tuple[int, int]]:
    """Elements [start, start + length) of the list the runs spell out, as runs."""
    out, skipped = [], 0
    for run_start, run_length in runs:
        if length <= 0:
            break
        if start < skipped + run_length:
            offset = max(0, start - skipped)
            taken = min(run_length - offset, length)
            out.append((run_start + offset, taken))
            start, length = start + taken, length - taken
        skipped += run_length
    return out


def read_layout(spec: Record, where: str, rank: int | None = None) -> DTensorLayout:
    """What a DTensor's spec says; `rank`: the saving rank, where its DeviceMesh does not record it
    (the file's name or metadata says it)."""
    mesh = spec.get("mesh")
    meta = spec.get("tensor_meta")
    raw_placements = spec.get("placements")
    if not isinstance(mesh, Record) or not isinstance(meta, Record) or raw_placements is None:
        raise BadInput(f"{where}: DTensor spec lacks its mesh, placements or tensor metadata")
    recorded_shape, recorded_stride, dtype = _tensor_meta(meta, where)
    global_shape = as_dims(recorded_shape)
    if global_shape is None:
        raise BadInput(f"{where}: DTensor global shape {recorded_shape!r} is not a list of whole numbers")
    mesh_shape = _mesh_shape(mesh, where)
    coordinate = mesh.get("_coordinate_on_dim")
    if coordinate is None or len(coordinate) != len(mesh_shape):
        raise BadInput(
            f"{where}: DTensor mesh does not record this rank's coordinate (was it saved by a rank outside the mesh?)"
        )
    if not all(is_count(c) and c < n for c, n in zip(coordinate, mesh_shape)):
        raise BadInput(f"{where}: mesh coordinate {tuple(coordinate)} lies outside its {mesh_shape} DeviceMesh")
    placements = tuple(_placement(p, where) for p in raw_placements)
    if len(placements) != len(mesh_shape):
        raise BadInput(f"{where}: {len(placements)} placements for a {len(mesh_shape)}-D mesh")
    for kind, dim, factor in placements:
        if kind != "replicate" and not dim < len(global_shape):
            raise BadInput(f"{where}: a placement shards dim {dim} of a tensor of {len(global_shape)} dims")
        if factor > prod(mesh_shape):  # torch's is the product of the mesh dims sharding first
            raise BadInput(
                f"{where}: _StridedShard split factor {factor} exceeds the {prod(mesh_shape)} ranks of its "
                "DeviceMesh; no layout of torch's makes that"
            )
    coordinate = tuple(coordinate)
    place = mesh_place(mesh, rank, coordinate, where)
    piece_at = place.group_coordinate if place is not None else coordinate
    saved_by = mesh.get("_rank")
    return DTensorLayout(
        tuple(global_shape),
        str(dtype),
        mesh_shape,
        piece_at,
        placements,
        _shard_order(spec, placements, mesh_shape, where),
        saved_by if is_count(saved_by) else None,
        _mesh_world(mesh),
        as_dims(recorded_stride),
        coordinate if piece_at != coordinate else None,
    )


def _tensor_meta(meta: Record, where: str):
    values = meta.args if len(meta.args) == 3 else (meta.get("shape"), meta.get("stride"), meta.get("dtype"))
    if values[0] is None:
        raise BadInput(f"{where}: DTensor spec has no global shape")
    return values


def _mesh_shape(mesh: Record, where: str) -> tuple[int, ...]:
    layout = mesh.get("_layout")
    if isinstance(layout, Record) and layout.get("axes") is not None:
        axes = layout.get("axes")
        sizes = [_axis_size(axis) for axis in axes] if isinstance(axes, (tuple, list)) else [None]
        if None in sizes:
            raise BadInput(f"{where}: the DeviceMesh's layout is not one torch writes (axes {axes!r:.80})")
        return tuple(sizes)
    tensor = mesh.get("mesh")  # DeviceMesh of older releases pickles its rank tensor
    if isinstance(tensor, TensorRef):
        return tensor.shape
    raise BadInput(f"{where}: cannot read the DeviceMesh shape from this checkpoint")


def _mesh_world(mesh: Record) -> int | None:
    """How many ranks the mesh's root spans: a sub-mesh (mesh["dp"] of a dp x tp mesh) records the
    root's rank map, so its files are a fraction of the folder's."""
    ranks = mesh.get("_flatten_rank_map")
    return len(ranks) if isinstance(ranks, (tuple, list)) and ranks else None


def _axis_size(axis) -> int | None:
    """How many ranks a mesh layout's axis spans (its shape: a number or a tuple of them); None if
    the axis is not one torch writes."""
    shape = axis.get("shape") if isinstance(axis, Record) else None
    sizes = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    return prod(sizes) if all(is_count(size) for size in sizes) else None


def _placement(record: Record, where: str) -> tuple[str, int | None, int]:
    name = record.qualname.rsplit(".", 1)[-1]
    if name in ("Shard", "_StridedShard"):
        dim = record.get("dim", record.args[0] if record.args else None)
        factor = record.get("split_factor", 1) if name == "_StridedShard" else 1
        if not is_count(dim) or not is_count(factor) or factor < 1:
            raise BadInput(
                f"{where}: a {name} placement with dim {dim!r} and split factor {factor!r}; expected whole numbers"
            )
        return ("strided" if name == "_StridedShard" else "shard"), dim, factor
    if name == "Replicate":
        return "replicate", None, 1
    if "Partial" in name:
        raise BadInput(
            f"{where}: a Partial placement holds unreduced partial sums, not pieces of a tensor; "
            "save the model after the reduction (Shard or Replicate placements)"
        )
    raise BadInput(f"{where}: unknown DTensor placement {record.qualname}")


def _shard_order(spec: Record, placements, mesh_shape, where: str) -> tuple[tuple[int, tuple[int, ...]], ...] | None:
    if any(kind == "strided" for kind, _, _ in placements):
        if spec.get("shard_order"):  # torch keeps the order in the _StridedShard placements, shard_order empty
            raise BadInput(
                f"{where}: _StridedShard placements together with a recorded shard_order; "
                "torch writes one or the other, so which one holds cannot be told"
            )
        return _decode_split_factors(placements, mesh_shape)
    by_dim: dict[int, list[int]] = {}
    for mesh_dim, (kind, dim, _) in enumerate(placements):
        if kind != "replicate":
            by_dim.setdefault(dim, []).append(mesh_dim)
    recorded = spec.get("shard_order")
    if recorded:
        for entry in recorded:
            tensor_dim, mesh_dims = (
                entry.args
                if isinstance(entry, Record) and len(entry.args) == 2
                else (entry.get("tensor_dim"), entry.get("mesh_dims"))
            )
            if tensor_dim in by_dim and sorted(mesh_dims) == sorted(by_dim[tensor_dim]):
                by_dim[tensor_dim] = list(mesh_dims)
    return tuple((dim, tuple(mesh_dims)) for dim, mesh_dims in sorted(by_dim.items()))


def _decode_split_factors(placements, mesh_shape) -> tuple[tuple[int, tuple[int, ...]], ...] | None:
    """The sharding order the split factors stand for, as torch decodes it: from the last mesh dim
    to the first, each goes where the mesh dims ordered before it multiply to its split factor
    (1 for Shard); None if some factor fits nowhere."""
    by_dim: dict[int, list[int]] = {}
    for mesh_dim in reversed(range(len(placements))):
        kind, dim, factor = placements[mesh_dim]
        if kind == "replicate":
            continue
        order, before = by_dim.setdefault(dim, []), 1
        for i in range(len(order) + 1):
            if before == factor:
                order.insert(i, mesh_dim)
                break
            if i < len(order):
                before *= mesh_shape[order[i]]
        else:
            return None
    return tuple((dim, tuple(mesh_dims)) for dim, mesh_dims in sorted(by_dim.items()))


def live_layout(global_shape, dtype: str, mesh_shape, coordinate, placements, recorded_order=()) -> DTensorLayout:
    """The layout of a DTensor held in memory (fsdpfast.save_pretrained): `placements` as
    (kind, dim, split factor), `recorded_order` its spec's shard order as (tensor dim, mesh dims) pairs
    (torch records none beside _StridedShard placements, whose split factors say the order)."""
    placements, mesh_shape = tuple(placements), tuple(mesh_shape)
    strided = any(kind == "strided" for kind, _, _ in placements)
    spec = {} if strided else {"shard_order": [{"tensor_dim": d, "mesh_dims": tuple(m)} for d, m in recorded_order]}
    order = _shard_order(spec, placements, mesh_shape, "a DTensor in memory")
    return DTensorLayout(tuple(global_shape), dtype, mesh_shape, tuple(coordinate), placements, order)
