"""A live model's state dict as the plan of the folder it becomes, and this rank's piece of each tensor.

Every rank computes the same plan from metadata alone (names, global shapes, dtypes), through
the same normalisation and layout as an offline merge, so the files, headers and offsets are
the ones a merge of the same model's checkpoint writes. What each rank then writes of a tensor
is its local piece, placed as geometry.placements places a rank file's DTensor:
* sharded on dim 0 (FSDP2's default): the rank's rows, one contiguous run;
* sharded on another dim (FSDP2 with shard_placement_fn), or on two (FSDP2 + tensor parallel on a
  dp x tp mesh: `(_StridedShard(0), Shard(0))`, `(Shard(0), Shard(1))`): strided runs, written in
  place (measured faster than redistributing to Shard(0) first: docs/performance.md);
* under HSDP only the replica group at coordinate 0 of each Replicate mesh dim writes, and a
  tensor on a sub-mesh (the dp mesh under TP) is written by one of its copies;
* a plain tensor (a buffer every rank holds) is written by rank 0 alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import target_dtype
from ..errors import BadInput, FsdpfastError
from ..families.live_layout import HubTensor, hub_tensors
from ..geometry.placements import choose_reading, live_layout
from ..plan.model import Extent, MergePlan, TensorPlan
from ..plan.normalise import clean_name, parse_dtype, tied_pairs
from ..plan.windows import Window, Windows
from .fsdp1 import FlatRun

LAYOUT = "live"  # the plan's layout name: a model in memory, not a checkpoint folder


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class LiveTensor:
    """One tensor of the state dict: its name in the output, and where its value is."""

    name: str  # in the output (wrapper prefixes removed)
    key: str  # in the state dict
    value: object  # a DTensor or a plain tensor
    # The part of `value` written under `name` in the Hub layout (an expert's rows, a transposed
    # tensor: families.live_layout); None: all of it, as it is.
    hub: HubTensor | None = None
    # save_pretrained(dtype="fp8") (live.fp8): a quantized weight's plan before quantizing (its shape and
    # the dtype it is quantized from) and, once the ranks agree on them, its blocks' scales; a scale_inv
    # tensor names the weight it scales
    fp8: TensorPlan | None = None
    fp8_scale: object = None
    fp8_scale_of: str | None = None


def plan_live(
    state: dict,
    dtype: str | None,
    config: dict | None,
    kept_in_fp32=None,
    expert_layout: str = "hub",
    model_ties: dict[str, str] | None = None,
) -> tuple[MergePlan, list[LiveTensor]]:
    """The plan (tensors without extents: a live plan is written by `local_piece`, not by engines)
    and the tensors to write in plan order; tied names are written once as the offline merge does.
    `kept_in_fp32` (name -> bool): the floating tensors a cast leaves in float32 (families.keep_fp32).
    `model_ties` (tied name -> the name it shares, the model's `all_tied_weights_keys`): the ties transformers
    makes on load, where config.json's names do not tell them (ModernBERT's `decoder.weight`).
    The names are the Hub layout's of the model's family (families.live_layout: experts per expert or
    transposed, a VLM's prefixes); `expert_layout="packed"` keeps transformers' packed experts."""
    wanted = parse_dtype(dtype)
    tensors, live, seen, taken, written_as = [], [], {}, {}, {}
    for key, value in state.items():
        name = clean_name(key)
        if name in taken:
            raise BadInput(f"{taken[name]} and {key} both become {name} once wrapper prefixes are removed")
        taken[name] = key
        if hasattr(value, "placements"):  # refused here, on every rank alike, before anything is made
            placement_kinds(value, key)
        source = dtype_name(value.dtype)
        kept = wanted is not None and kept_in_fp32 is not None and kept_in_fp32(name)
        outputs = hub_tensors(name, tuple(value.shape), config or {}, expert_layout)
        if len(outputs) == 1:
            written_as[name] = outputs[0].name
        for out in outputs:
            if out.name in seen:
                raise BadInput(f"{seen[out.name]} and {key} are both written as {out.name}")
            if out.transposed:
                _refuse_untransposable(value, key)
            seen[out.name] = key
            tensors.append(
                TensorPlan(out.name, out.shape, source, target_dtype(source, "float32" if kept else wanted), ())
            )
            live.append(LiveTensor(out.name, key, value, None if out.offsets is None else out))
    dropped = {}
    for kept, other in _tied(tensors, config or {}, model_ties or {}, written_as):
        if not _same_values(state[seen[kept]], state[seen[other]]):
            raise BadInput(
                f"config.json ties {other} to {kept}, but the model holds different values (or, under FSDP1, two "
                "separate parameters) under the two names; "
                "if they were trained untied, set tie_word_embeddings to false in the config"
            )
        dropped[other] = kept
    aliases: dict[str, list[str]] = {}
    for other, kept in dropped.items():
        aliases.setdefault(kept, []).append(other)
    tensors = [
        TensorPlan(t.name, t.shape, t.source_dtype, t.target_dtype, (), tuple(aliases.get(t.name, ())))
        for t in tensors
        if t.name not in dropped
    ]
    live = [t for t in live if t.name not in dropped]
    return MergePlan(LAYOUT, _world(state), (), tensors), live


def _tied(tensors: list[TensorPlan], config: dict, model_ties: dict[str, str], written_as: dict[str, str]) -> list:
    """(kept, dropped) output names: the ties config.json's names tell (plan.normalise.tied_pairs, as offline
    without a model), and those the model makes on load, by their names in the output."""
    pairs = tied_pairs(tensors, None, config)
    paired = {name for pair in pairs for name in pair}
    for other, kept in model_ties.items():
        kept, other = written_as.get(clean_name(str(kept))), written_as.get(clean_name(str(other)))
        if kept is not None and other is not None and kept != other and not {kept, other} & paired:
            pairs.append((kept, other))
            paired |= {kept, other}
    return pairs


@dataclass(frozen=True)
class LocalPiece:
    """What this rank writes of a tensor: `data` (contiguous, row-major) and where its elements go in
    the tensor, as extents in elements: (source offset, count, destination offset, runs, source
    stride, destination stride), each run `count` contiguous elements of the tensor."""

    data: object
    extents: tuple[tuple[int, int, int, int, int, int], ...]

    @classmethod
    def rows(cls, start: int, data) -> LocalPiece:
        """`data` is the tensor's elements from `start` on, in one contiguous run."""
        return cls(data, ((0, data.numel(), start, 1, 0, 0),))


def extent_runs(extents):
    """(source element, count, tensor element) of every run, as an int64 tensor of 3 columns."""
    import torch

    blocks = []
    for src, count, dst, repeats, src_stride, dst_stride in extents:
        i = torch.arange(repeats, dtype=torch.int64)
        blocks.append(torch.stack([src + i * src_stride, torch.full_like(i, count), dst + i * dst_stride], 1))
    return torch.cat(blocks) if blocks else torch.zeros((0, 3), dtype=torch.int64)


def _refuse_untransposable(value, key: str) -> None:
    """A tensor written transposed needs each matrix whole on one rank: FSDP2's dim-0 pieces (whole experts)."""
    kinds = placement_kinds(value, key) if hasattr(value, "placements") else ()
    if isinstance(value, FlatRun) or any(kind != "replicate" and dim != 0 for kind, dim, _ in kinds):
        raise BadInput(
            f"save_pretrained: {key} is written transposed in the Hub layout, which needs whole experts on each rank "
            f"(FSDP2 sharding on dim 0), but it is {'an FSDP1 flat shard' if isinstance(value, FlatRun) else f'placed as {tuple(value.placements)}'}; "
            "pass expert_layout='packed' to write transformers' own layout"
        )


def hub_piece(tensor: LiveTensor, piece: LocalPiece | None) -> LocalPiece | None:
    """What this rank writes of tensor.name, from its piece of the state-dict tensor: the runs inside the
    window (the data narrowed to them), or its whole matrices transposed (contiguous, on their device)."""
    hub = tensor.hub
    if hub is None or piece is None:
        return piece
    shape = tuple(tensor.value.shape)
    whole = TensorPlan("piece", shape, "x", "x", tuple(Extent(0, *e) for e in piece.extents))
    made = Windows([whole]).tensor(
        hub.name, hub.sizes, [Window("piece", hub.offsets, hub.sizes, (0,) * len(hub.sizes))]
    )
    if not made.extents:
        return None
    if hub.transposed:
        return _transposed_piece(hub, piece.data, made.extents)
    low = min(e.src_offset for e in made.extents)
    high = max(e.src_offset + (e.runs - 1) * e.src_stride + e.count for e in made.extents)
    extents = tuple(
        (e.src_offset - low, e.count, e.dst_offset, e.runs, e.src_stride, e.dst_stride) for e in made.extents
    )
    return LocalPiece(piece.data.reshape(-1)[low:high], extents)


def _transposed_piece(hub: HubTensor, data, extents) -> LocalPiece:
    import torch

    rows, cols = hub.sizes[-2:]
    matrix = rows * cols
    blocks, out, at = [], [], 0
    flat = data.reshape(-1)
    for e in extents:
        for run in range(e.runs):
            src, dst = e.src_offset + run * e.src_stride, e.dst_offset + run * e.dst_stride
            if e.count % matrix or dst % matrix:
                raise FsdpfastError(
                    f"save_pretrained: this rank holds part of a matrix of {hub.source}, which is written transposed"
                )
            block = flat[src : src + e.count].view(-1, rows, cols)
            blocks.append(_transpose(block).reshape(-1))
            out.append((at, e.count, dst, 1, 0, 0))
            at += e.count
    return LocalPiece(torch.cat(blocks) if len(blocks) > 1 else blocks[0], tuple(out))


def _transpose(block):
    """[n, rows, cols] -> [n, cols, rows], contiguous: the extension's transposed copy where it is built."""
    from .. import _ops

    if _ops.torch_ops() and (not block.is_cuda or _ops.native_cuda_built()):
        import torch

        return torch.ops.fsdpfast.transposed(block.contiguous())
    return block.transpose(-2, -1).contiguous()


def placement_kinds(value, name: str) -> tuple[tuple[str, int | None, int], ...]:
    """A DTensor's placements as (kind, dim, split factor), as geometry.placements reads them; refused
    when one is not a piece of the tensor (Partial: unreduced sums) or is unknown."""
    kinds = []
    for p in value.placements:
        kind = type(p).__name__
        if kind == "Shard":
            kinds.append(("shard", p.dim, 1))
        elif kind == "_StridedShard":
            kinds.append(("strided", p.dim, int(p.split_factor)))
        elif kind == "Replicate":
            kinds.append(("replicate", None, 1))
        else:
            raise BadInput(
                f"save_pretrained: {name} is placed as {tuple(value.placements)}: a {kind} placement does not hold "
                "pieces of the tensor (Partial: unreduced sums); reduce it (redistribute to Shard or Replicate) first"
            )
    return tuple(kinds)


def local_piece(value, rank: int, name: str = "a tensor", redistribute: bool = False) -> LocalPiece | None:
    """What this rank writes of `value`, or None (another rank writes it, or it holds none).

    A DTensor's piece is placed by its placements as geometry.placements reads rank files (nested
    torch.chunk pieces, _StridedShard in torch's shard order): rows of a tensor sharded on dim 0,
    strided runs of one sharded on another dim (or on two dims, FSDP2 + tensor parallel). Copies
    are written once: by the replica at coordinate 0 of each Replicate mesh dim, and, for a tensor
    on a sub-mesh (FSDP2's dp mesh under TP), by the sub-mesh holding the root mesh's first rank.
    With `redistribute`, pieces that are not whole rows are first redistributed to Shard(0) (one
    collective per tensor, instead of strided runs; kept to measure the two: live.write.WriteWays):
    every rank must then call this for every tensor, in the same order."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(value, FlatRun):  # FSDP1: the rank's run of the flat parameter (live.fsdp1)
        run = value.run()
        return None if run is None else LocalPiece.rows(*run)
    if not isinstance(value, DTensor):
        return LocalPiece.rows(0, value.detach().contiguous()) if rank == 0 else None
    kinds = placement_kinds(value, name)
    mesh = value.device_mesh
    if redistribute and any(kind != "replicate" and dim != 0 for kind, dim, _ in kinds):
        target = [Replicate() if kind == "replicate" else Shard(0) for kind, _, _ in kinds]
        value = value.redistribute(mesh, target)
        kinds = placement_kinds(value, name)
    coordinate = _piece_coordinate(mesh)
    if coordinate is None or not _writes_copy(mesh, coordinate, kinds):
        return None
    recorded = tuple((e.tensor_dim, tuple(e.mesh_dims)) for e in (getattr(value._spec, "shard_order", None) or ()))
    layout = live_layout(value.shape, dtype_name(value.dtype), mesh.shape, coordinate, kinds, recorded)
    local = value.to_local().detach()
    reading = choose_reading([layout], [tuple(local.shape)], [f"save_pretrained: {name}"])
    return LocalPiece(local.contiguous(), layout.local_extents(reading))


def _piece_coordinate(mesh) -> tuple[int, ...] | None:
    """Where this rank's pieces sit: its rank in each mesh dim's process group (FSDP2 shards by it and
    full_tensor() gathers by it), which is its mesh coordinate only where the mesh lists the group's
    ranks in increasing order (geometry.mesh_ranks); None if this rank is not in the mesh."""
    if mesh.get_coordinate() is None:
        return None
    return tuple(mesh.get_local_rank(dim) for dim in range(mesh.ndim))


def _writes_copy(mesh, coordinate, kinds) -> bool:
    """Whether this rank's copy of its piece is the one written (see local_piece)."""
    if any(c != 0 for c, (kind, _, _) in zip(coordinate, kinds) if kind == "replicate"):
        return False
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    return root is mesh or int(mesh.mesh.min()) == int(root.mesh.min())


def _same_values(a, b) -> bool:
    """Tied names hold one parameter (the same object) in a model that ties them; else compare this
    rank's pieces. No collective: planning runs before the ranks have agreed on anything, and a rank
    that refuses here stops every rank through the plan exchange (save.py)."""
    if a is b:
        return True
    if isinstance(a, FlatRun) or isinstance(b, FlatRun):
        return False  # FSDP1 keeps tied names on one parameter; two parameters' runs lie apart: not compared live
    import torch
    from torch.distributed.tensor import DTensor

    if a.shape != b.shape or a.dtype != b.dtype or type(a) is not type(b):
        return False
    if not isinstance(a, DTensor):
        return bool(torch.equal(a, b))
    return (
        a.placements == b.placements
        and a.device_mesh == b.device_mesh
        and bool(torch.equal(a.to_local(), b.to_local()))
    )


def _world(state: dict) -> int:
    from torch.distributed.tensor import DTensor

    for value in state.values():
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            return (mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh).size()
    return 1
