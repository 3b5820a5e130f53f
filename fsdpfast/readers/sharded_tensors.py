"""FSDP1 SHARDED_STATE_DICT tensors in per-rank files: one ShardedTensor per parameter.

Each rank's ShardedTensor records the parameter's global size and this rank's local shards,
each a tensor with the box it fills (`shard_offsets`, `shard_sizes`) and the process group it
was saved by. The pieces are placed where their boxes say, read in place from the rank files;
the plan check then proves every element is written exactly once. (FSDP1's LOCAL_STATE_DICT
flat parameters are another thing: readers.fsdp1_flat.)
"""

from __future__ import annotations

from math import prod

from .._parsing.safe_load import Record, ShardedTensorRef, TensorRef, as_dims
from ..dtypes import DTYPES
from ..errors import BadInput
from ..geometry.boxes import box_extents
from ..plan.model import Extent, TensorPlan
from .storage_sources import StorageSources


def recorded_world(value: ShardedTensorRef, where: str) -> int:
    """The world size a ShardedTensor's process group records."""
    return _group(value, where)["local_world_size"]


def plan_sharded(name: str, pieces, world: int, sources: StorageSources) -> TensorPlan:
    """`pieces`: (RankState, ShardedTensorRef) of every rank, in rank order."""
    first_state, first = pieces[0]
    shape = as_dims(first.shape)
    if shape is None or first.dtype not in DTYPES:
        raise BadInput(
            f"{first_state.path}: {name} is a ShardedTensor of shape {first.shape} and dtype {first.dtype}; not supported"
        )
    extents: list[Extent] = []
    for state, value in pieces:
        where = f"{state.path}: {name}"
        if not isinstance(value, ShardedTensorRef) or tuple(value.shape) != shape or value.dtype != first.dtype:
            got = f"{value.dtype}{list(value.shape)}" if isinstance(value, ShardedTensorRef) else type(value).__name__
            raise BadInput(
                f"{where}: is {got} but a ShardedTensor {first.dtype}{list(shape)} in {first_state.path}; "
                "all rank files must come from one checkpoint"
            )
        group = _group(value, where)
        if group["local_world_size"] != world or group["local_rank"] != state.rank:
            raise BadInput(
                f"{where}: saved by rank {group['local_rank']} of {group['local_world_size']}, but the file "
                f"name says rank {state.rank} of {world}; are two files copies of one rank?"
            )
        shards = value.state[0] if value.state and isinstance(value.state[0], list) else None
        if shards is None:
            raise BadInput(f"{where}: its ShardedTensor holds no list of local shards; the file is corrupt")
        for shard in shards:
            extents += _shard_extents(state, where, shard, shape, first.dtype, sources)
    covered = sum(e.numel for e in extents)
    if covered != prod(shape):
        raise BadInput(
            f"{first_state.path}: the shards of {name} cover {covered} of its {prod(shape)} elements; "
            "all rank files of one checkpoint are needed"
        )
    return TensorPlan(name, shape, first.dtype, first.dtype, extents)


def _shard_extents(state, where: str, shard, shape, dtype: str, sources: StorageSources) -> list[Extent]:
    tensor, meta = (shard.get("tensor"), shard.get("metadata")) if isinstance(shard, Record) else (None, None)
    if not isinstance(tensor, TensorRef) or not isinstance(meta, Record):
        raise BadInput(f"{where}: a local shard lacks its tensor or metadata; the file is corrupt")
    offsets, sizes = as_dims(meta.get("shard_offsets")), as_dims(meta.get("shard_sizes"))
    if (
        offsets is None
        or sizes is None
        or not len(offsets) == len(sizes) == len(shape)
        or any(o + s > d for o, s, d in zip(offsets, sizes, shape))
    ):
        raise BadInput(
            f"{where}: a local shard's box (offsets {meta.get('shard_offsets')}, sizes {meta.get('shard_sizes')}) "
            f"does not fit its shape {list(shape)}"
        )
    if tuple(tensor.shape) != sizes or tensor.dtype != dtype:
        raise BadInput(
            f"{where}: a local shard is {tensor.dtype}{list(tensor.shape)}, its metadata says {dtype}{list(sizes)}"
        )
    if not tensor.is_contiguous():
        raise BadInput(f"{where}: a local shard is not contiguous (strides {tensor.stride}); not supported yet")
    if tensor.offset + prod(sizes) > tensor.storage.numel:
        raise BadInput(f"{where}: a local shard reaches past the end of its storage; the file is corrupt")
    source = sources.index(state.path, tensor, state.archive)
    return box_extents(source, tensor.offset, shape, offsets, sizes)


def _group(value: ShardedTensorRef, where: str) -> dict:
    group = value.state[2] if len(value.state) > 2 else None
    fields = ("local_rank", "local_world_size")
    info = {f: group.get(f) for f in fields} if isinstance(group, Record) else {}
    if (
        not all(isinstance(info.get(f), int) and not isinstance(info.get(f), bool) for f in fields)
        or info["local_world_size"] < 1
    ):
        raise BadInput(
            f"{where}: its ShardedTensor does not record the process group it was saved by; the file is corrupt"
        )
    return info
