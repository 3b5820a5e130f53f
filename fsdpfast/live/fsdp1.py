"""A live FSDP1 model (`FullyShardedDataParallel`) as live state: what this rank holds of each original parameter.

FSDP1 flattens each unit's parameters into one 1-D flat parameter (each row-major, one after the
other; with use_orig_params=True each padded to 16 bytes), pads it at the end to a multiple of the
world size and keeps the rank's equal piece. So what a rank holds of an original parameter is one
contiguous run of its row-major elements, and FSDP1 records where (`_shard_param_infos`: offset
in the shard, first element, count): each rank writes its runs at their final offsets with no
collective and no copy, as the offline fsdp1-flat reader places them. (SHARDED_STATE_DICT would
all-gather every unit's flat parameter and re-chunk each parameter on dim 0: a collective and a
whole unit's memory per unit, for the same bytes.)

The names and their order are those of `nn.Module.state_dict()` on the model without FSDP1: the
module tree is walked as state_dict walks it (own parameters, persistent buffers, children), an
FSDP1-managed parameter standing for its run. With use_orig_params=False FSDP1 takes the original
parameters out of their modules; they come back from the flat parameter's records, in its order
(FSDP1's own FULL_STATE_DICT re-registers them in that order too). A parameter under two names
(tied) is one run under both, which plan_live writes once.
Plain tensors (buffers; parameters FSDP1 ignores) are whole on every rank: rank 0 writes them.
HYBRID_SHARD: the first replica group writes; NO_SHARD: each unit's rank 0.

The records are FSDP1's private attributes (torch 2.x's FlatParamHandle); a torch without them is
refused in one line rather than guessed at.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BadInput
from ..plan.normalise import clean_name

_REFUSE = "save a checkpoint and merge it instead"


@dataclass(frozen=True, eq=False)
class FlatRun:
    """What this rank writes of one original FSDP1 parameter; shape and dtype are the whole parameter's."""

    shape: tuple[int, ...]
    dtype: object  # torch.dtype
    start: int  # the first element (row-major) this rank holds
    local: object = None  # a 1-D tensor of the elements from `start`, or None: this rank writes none of it

    def run(self):
        return None if self.local is None else (self.start, self.local)


def is_fsdp1(model) -> bool:
    """Whether `model` holds FSDP1 units (FullyShardedDataParallel anywhere in it)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def live_state(model) -> tuple[dict, int]:
    """(the model's state dict, FlatRuns standing for FSDP1's parameters; FSDP1's world size)."""
    try:
        return _live_state(model)
    except AttributeError as exc:  # another torch's FSDP1 internals
        import torch

        raise BadInput(
            f"save_pretrained: torch {torch.__version__}'s FSDP1 does not record its flat parameters as expected "
            f"({exc}); {_REFUSE}"
        ) from None


def _live_state(model) -> tuple[dict, int]:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._flat_param import FlatParameter

    owners: dict[tuple[int, str], FlatRun] = {}  # (id(module), name) -> the run of the parameter it names
    names: dict[int, list[str]] = {}  # id(module) -> its FSDP1-managed parameter names, in the flat parameter's order
    managed: set[int] = set()  # ids of the original parameter objects (use_orig_params=True)
    world, cast_buffers = 1, False
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        cast_buffers |= unit._mixed_precision_enabled_for_buffers()
        handle = unit._handle
        if handle is None:  # a unit with no parameters of its own
            continue
        _check_unit(unit, handle)
        replica, replicas = _replica(unit, handle)
        world = max(world, handle.world_size * replicas)
        flat = handle.flat_param
        for info, run in zip(flat._param_infos, _unit_runs(handle, replica == 0)):
            owners[(id(info.module), info.param_name)] = run
            names.setdefault(id(info.module), []).append(info.param_name)
        for shared in flat._shared_param_infos:
            owners[(id(shared.module), shared.param_name)] = owners[(id(shared.prim_module), shared.prim_param_name)]
            names.setdefault(id(shared.module), []).append(shared.param_name)
        managed.update(id(p) for p in [*(flat._params or ()), *(flat._shared_params or ())])
    state: dict = {}
    _walk(model, "", owners, names, managed, FlatParameter, state, cast_buffers)
    return state, world


def _check_unit(unit, handle) -> None:
    flat = handle.flat_param
    if any(e is not None for e in flat._param_extensions):
        raise BadInput(f"save_pretrained: FSDP1 parameters with an FSDP extension (tensor parallel): {_REFUSE}")
    if not all(flat._contiguities):
        raise BadInput(
            f"save_pretrained: FSDP1 flattened a non-contiguous parameter ({flat._fqns[flat._contiguities.index(False)]}): "
            f"its bytes are not in row-major order; {_REFUSE}"
        )


def _replica(unit, handle) -> tuple[int, int]:
    """(this rank's replica group, how many): HYBRID_SHARD shards within a group and replicates across
    groups (the unit's inter-node group); the other strategies have one group."""
    import torch.distributed as dist
    from torch.distributed.fsdp._flat_param import HandleShardingStrategy

    if handle._sharding_strategy not in (
        HandleShardingStrategy.HYBRID_SHARD,
        HandleShardingStrategy._HYBRID_SHARD_ZERO2,
    ):
        return 0, 1
    across = unit._inter_node_pg
    return dist.get_rank(across), dist.get_world_size(across)


def _unit_runs(handle, first_replica: bool) -> list[FlatRun]:
    """Each of the unit's parameters' run in this rank's shard of its flat parameter (none outside
    the first replica group: the others hold the same bytes)."""
    flat = handle.flat_param
    # The sharded flat parameter, full precision (the optimizer's; mixed precision computes in a copy).
    local = getattr(flat, "_local_shard", None)
    if local is None:  # before FSDP1's lazy initialisation (no forward yet): the parameter is the shard
        if handle.uses_sharded_strategy and not handle.is_sharded(flat):
            raise BadInput(
                f"save_pretrained: an FSDP1 flat parameter is gathered (inside summon_full_params?); {_REFUSE}"
            )
        local = flat
    local = (
        local.detach()
    )  # its dtype is the parameters' (a flat parameter gathered for compute may be MixedPrecision's)
    # NO_SHARD: every rank holds the whole flat parameter (its records span all of it): the group's rank 0 writes
    writes = first_replica and (handle.uses_sharded_strategy or handle.rank == 0)
    runs = []
    for info, shape, numel in zip(flat._shard_param_infos, flat._shapes, flat._numels):
        shape = tuple(shape)
        if not (writes and info.in_shard and info.numel_in_shard):
            runs.append(FlatRun(shape, local.dtype, 0))
            continue
        first, count, at = info.intra_param_start_idx, info.numel_in_shard, info.offset_in_shard
        if first + count > numel or at + count > local.numel():
            raise BadInput(
                f"save_pretrained: an FSDP1 shard record ({count} elements from {first} at {at}) does not fit a "
                f"parameter of {numel} elements in a shard of {local.numel()}; {_REFUSE}"
            )
        runs.append(FlatRun(shape, local.dtype, first, local[at : at + count]))
    return runs


def _walk(module, prefix: str, owners, names, managed, flat_type, state: dict, cast_buffers: bool) -> None:
    """state_dict's walk (own parameters, persistent buffers, then children) with FSDP1's runs in place.
    `cast_buffers`: FSDP1 holds buffers in MixedPrecision's buffer_dtype (its state dicts cast them back)."""
    import torch

    cls = type(module)
    if getattr(cls, "get_extra_state", torch.nn.Module.get_extra_state) is not torch.nn.Module.get_extra_state:
        raise BadInput(
            f"save_pretrained: the module {clean_name(prefix.rstrip('.')) or '(the root)'} ({cls.__name__}) saves extra "
            f"state, which is not a tensor; {_REFUSE}"
        )
    own = [n for n, p in module._parameters.items() if p is not None and not isinstance(p, flat_type)]
    own += [n for n in names.get(id(module), ()) if n not in own]  # use_orig_params=False took them out
    for name in own:
        run = owners.get((id(module), name))
        if run is None:
            param = module._parameters[name]
            if id(param) in managed:
                raise BadInput(
                    f"save_pretrained: {clean_name(prefix + name)} is FSDP1's, but no unit records it here; {_REFUSE}"
                )
            run = param  # a parameter FSDP1 ignores: whole on every rank
        state[prefix + name] = run
    for name, buffer in module._buffers.items():
        if buffer is not None and name not in module._non_persistent_buffers_set:
            if cast_buffers:
                raise BadInput(
                    f"save_pretrained: FSDP1 holds the buffer {clean_name(prefix + name)} in MixedPrecision's buffer_dtype, "
                    f"not its own; {_REFUSE}"
                )
            state[prefix + name] = buffer
    for name, child in module._modules.items():
        if child is not None:
            _walk(child, f"{prefix}{name}.", owners, names, managed, flat_type, state, cast_buffers)
