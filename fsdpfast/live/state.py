"""A live model's state dict as the plan of the folder it becomes, and this rank's runs of its bytes.

Every rank computes the same plan from metadata alone (names, global shapes, dtypes), through
the same normalisation and layout as an offline merge, so the files, headers and offsets are
the ones a merge of the same model's checkpoint writes. What each rank then writes of a tensor
is one contiguous run of its elements in row-major order:
* a DTensor sharded on dim 0 (FSDP2's default): the rank's rows, in place;
* sharded on another dim (FSDP2 with shard_placement_fn): redistributed to Shard(0) on the same
  mesh first, one tensor at a time, so the rows are contiguous (one collective per tensor, in
  the plan's order on every rank);
* under HSDP only the replica group at coordinate 0 of each Replicate mesh dim writes;
* a plain tensor (a buffer every rank holds) is written by rank 0 alone.
Meshes that shard one tensor over several mesh dims (FSDP2 + tensor parallel) are refused for now.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ..dtypes import target_dtype
from ..errors import BadInput
from ..plan.model import MergePlan, TensorPlan
from ..plan.normalise import clean_name, parse_dtype, tied_pairs
from ..readers.placements import chunk_span
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


def plan_live(state: dict, dtype: str | None, config: dict | None) -> tuple[MergePlan, list[LiveTensor]]:
    """The plan (tensors without extents: a live plan is written by `local_run`, not by engines)
    and the tensors to write in plan order; tied names are written once as the offline merge does."""
    wanted = parse_dtype(dtype)
    tensors, live, seen = [], [], {}
    for key, value in state.items():
        name = clean_name(key)
        if name in seen:
            raise BadInput(f"{seen[name]} and {key} both become {name} once wrapper prefixes are removed")
        seen[name] = key
        source = dtype_name(value.dtype)
        tensors.append(TensorPlan(name, tuple(value.shape), source, target_dtype(source, wanted), ()))
        live.append(LiveTensor(name, key, value))
    dropped = {}
    for kept, other in tied_pairs(tensors, None, config or {}):
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


def local_run(value, rank: int) -> tuple[int, object] | None:
    """(first element, contiguous local data) of what this rank writes of `value`, or None.

    May run a collective (redistribution to Shard(0)): every rank must call it for every tensor,
    in the same order."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(value, FlatRun):  # FSDP1: the rank's run of the flat parameter (live.fsdp1)
        return value.run()
    if not isinstance(value, DTensor):
        return (0, value.detach().contiguous()) if rank == 0 else None
    placements = value.placements
    sharding = [(mesh_dim, p) for mesh_dim, p in enumerate(placements) if not isinstance(p, Replicate)]
    if len(sharding) > 1 or any(type(p) is not Shard for _, p in sharding):
        raise BadInput(
            f"save_pretrained: a tensor placed as {tuple(placements)} (sharded over several mesh dims, or "
            "strided): only FSDP2's Shard(d) on one mesh dim, with HSDP replicas, is written live for now; "
            "save a checkpoint and merge it instead"
        )
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # not part of this tensor's mesh
        return None
    if sharding and sharding[0][1].dim != 0:
        target = list(placements)
        target[sharding[0][0]] = Shard(0)
        value = value.redistribute(mesh, target)
    if any(c != 0 for c, p in zip(coordinate, placements) if isinstance(p, Replicate)):
        return None  # another replica group writes it
    local = value.to_local().detach().contiguous()
    if not sharding:
        return (0, local) if all(c == 0 for c in coordinate) else None
    mesh_dim = sharding[0][0]
    rows, _ = chunk_span(value.shape[0], mesh.size(mesh_dim), coordinate[mesh_dim])  # FSDP2 splits as torch.chunk
    if local.shape[1:] != value.shape[1:] or rows + local.shape[0] > value.shape[0]:
        raise BadInput(
            f"save_pretrained: a local shard of shape {tuple(local.shape)} does not fit rows from {rows} of "
            f"{tuple(value.shape)}: not torch.chunk's split; save a checkpoint and merge it instead"
        )
    return rows * prod(value.shape[1:]), local


def _same_values(a, b) -> bool:
    """Tied names hold one parameter (the same object) in a model that ties them; else compare every rank's piece."""
    if a is b:
        return True
    if isinstance(a, FlatRun) or isinstance(b, FlatRun):
        return False  # FSDP1 keeps tied names on one parameter; two parameters' runs lie apart: not compared live
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if a.shape != b.shape or a.dtype != b.dtype or type(a) is not type(b):
        return False
    if not isinstance(a, DTensor):
        return bool(torch.equal(a, b))
    if a.placements != b.placements:
        return False
    same = torch.tensor([int(torch.equal(a.to_local(), b.to_local()))])
    for mesh_dim in range(a.device_mesh.ndim):  # the tensor's own mesh, which need not be the whole world
        dist.all_reduce(same, op=dist.ReduceOp.MIN, group=a.device_mesh.get_group(mesh_dim))
    return bool(same.item())


def _world(state: dict) -> int:
    from torch.distributed.tensor import DTensor

    for value in state.values():
        if isinstance(value, DTensor):
            return value.device_mesh.size()
    return 1
