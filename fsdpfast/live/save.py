"""`fsdpfast.save_pretrained`: a Hugging Face folder written straight from a live FSDP2 or FSDP1 model, no gather.

Called on every rank of the job. The stages are an offline merge's, with the model in memory as
the source: every rank plans the same folder from metadata (the DTensors', live.plan; FSDP1's
flat-parameter records, live.fsdp1), rank 0 checks that all planned the same (live.agree) and
makes the output (the staging folder beside OUT_DIR) and writes the headers, every rank writes
its own pieces at their final offsets (live.write) and hands rank 0 their checksums, and rank 0
writes the index, config and manifest and publishes after all have succeeded: a failure on any
rank publishes nothing (group.MergeGroup). Host memory per rank is two tensors' shards at most.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

from ..errors import BadInput
from ..families import keep_fp32
from ..io.local_target import JoinedTarget, LocalTarget
from ..options import FP8_NAMES, fp8_patterns
from ..pipeline.finish import FolderFiles, Provenance, write_small_files
from ..pipeline.processes import MergeGroup
from ..plan.layout import DEFAULT_MAX_SHARD_SIZE, OutputFile, plan_files
from ..plan.normalise import parse_dtype
from ..rank_agreement import check_ranks_options, compared_options
from .agree import agree, holding
from .background import BackgroundSave, start_background, wait_for_previous
from .fp8 import exchange, plan_fp8
from .fsdp1 import is_fsdp1, live_state
from .plan import plan_live
from .write import WriteWays, settle, write_runs


@dataclass
class SaveReport:
    """What `save_pretrained` wrote (on rank 0; other ranks get the same report)."""

    out_dir: str
    tensors: int
    bytes_written: int
    files: list[str]
    seconds: float
    processes: int
    tied: dict[str, list[str]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # what --overwrite kept from the earlier folder, and where


def save_pretrained(
    model,
    out_dir: str,
    *,
    dtype: str | None = None,
    config=None,
    tokenizer=None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    group=None,
    overwrite: bool = False,
    ways: WriteWays | None = None,
    background: bool = False,
    expert_layout: str = "hub",
    fp8_skip=None,
) -> SaveReport | BackgroundSave:
    """Write `model` as a Hugging Face folder: FSDP2-sharded (DTensor parameters on a 1-D or HSDP mesh,
    or FSDP2 + tensor parallel), FSDP1-wrapped (FullyShardedDataParallel, use_orig_params True or False;
    FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, NO_SHARD), or plain (one process; or replicas on every
    rank: rank 0's copy).

    Call it on every rank of the process group, as the model's forward is called. The folder is
    the one an offline merge of the same model's checkpoint writes (same files, headers and
    bytes), with its manifest; it appears complete or not at all.
    dtype: None/"keep", "bf16", "fp16" or "fp32": floating tensors cast as the offline merge rounds (torch's `.to()`);
        "fp8" (or "fp8-block"): the offline `--dtype fp8` merge's block-scaled float8 linear weights, the rest
        bf16 (live.fp8: the blocks' amaxes agreed by one all-reduce, each rank quantizing its own elements);
        `fp8_skip="PATTERN,..."` leaves the names it matches unquantized.
    config: the model's config (default `model.config`), written as config.json with the dtype
        written; `tokenizer`: saved beside it if given (its save_pretrained).
    group: the process group (default: the default group when torch.distributed is initialised).
    ways: how each rank writes (live.write.WriteWays; None: the defaults), for measuring the slower ways.
    background: copy this rank's pieces to host memory (pinned for CUDA) and return a BackgroundSave at
        once; the files are written by a thread while training goes on, and `handle.wait()`, called on
        every rank as this was, publishes and returns the SaveReport (live.background). A background
        save waits for the one before it to finish.
    expert_layout: "hub" (the default) writes what transformers' save_pretrained writes of the model's family:
        MoE experts one tensor per expert (or transposed, Qwen3-VL-MoE), a VLM's Hub prefixes
        (families.live_layout); "packed" keeps transformers' packed expert tensors as the model holds them.
    """
    wait_for_previous()  # one save at a time: the one before publishes first, on every rank alike
    start = time.perf_counter()
    out_dir = os.fspath(out_dir)
    fp8 = str(dtype) in FP8_NAMES
    if fp8_skip and not fp8:
        raise BadInput(f"save_pretrained: fp8_skip applies to dtype='fp8' only, not {dtype!r}")
    skip = fp8_patterns(fp8_skip) if fp8_skip else ()
    dtype = "bf16" if fp8 else dtype  # what fp8 leaves unquantized is bf16, as the offline merge writes it
    wanted = parse_dtype(dtype)
    if expert_layout not in ("hub", "packed"):
        raise BadInput(f"save_pretrained: expert_layout={expert_layout!r} is not 'hub' or 'packed'")
    processes = MergeGroup(_default_group(group))
    config = config if config is not None else getattr(model, "config", None)
    config_dict = config.to_dict() if hasattr(config, "to_dict") else (dict(config) if config else None)
    config_dict = _with_architecture(config_dict, model)
    planned = []
    # what decides the folder's layout on every rank (rank 0's overwrite alone is used: it must agree too)
    asked = dict(
        dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite, expert_layout=expert_layout, fp8=fp8, skip=skip
    )

    def plan_here():
        plan, live = _plan(model, dtype, config_dict, expert_layout)
        planned.extend(plan_fp8(plan, live, skip, expert_layout == "packed") if fp8 else (plan, live))
        return holding(*planned), compared_options(asked)

    holdings = processes.gather(plan_here)  # a rank that cannot plan stops all; rank 0 gets every rank's holding
    plan, tensors = planned
    files = plan_files(plan, max_shard_size)
    output = processes.lead(
        lambda: _make_output(out_dir, overwrite, files, holdings), abandon=lambda made: made.target.discard()
    )
    target = output.target if processes.rank == 0 else None
    ways = ways or WriteWays()
    if fp8:  # a collective, after every rank has planned the same folder
        tensors = exchange(tensors, processes.rank, processes.group if processes.size > 1 else None, ways.redistribute)

    def publish(pieces):  # pieces: every rank's, on rank 0 (None elsewhere)
        return processes.lead(
            lambda: _finish(
                target,
                plan,
                files,
                [p for share in pieces for p in share],
                wanted,
                config_dict,
                model,
                tokenizer,
                start,
                processes.size,
                out_dir,
            )
        )

    if background:
        return start_background(processes, target, out_dir, output.token, files, tensors, ways, publish)
    try:
        if target is None:
            target = JoinedTarget(out_dir, output.token)
        return publish(processes.gather(lambda: write_runs(files, tensors, target.open, processes.rank, ways)))
    finally:
        if target is not None:
            target.discard()


def _with_architecture(config: dict | None, model) -> dict | None:
    """The config with `architectures` named, as transformers' save_pretrained names it (the model's class):
    the Hub layout of a vision-language model depends on its class (families.hub_prefixes), and a config
    made by from_config names none until a save_pretrained sets it (then on that rank alone)."""
    if config is None or config.get("architectures"):
        return config
    for cls in type(getattr(model, "module", model)).__mro__:  # FSDP2 subclasses the model's class as FSDP<name>
        if cls.__module__.startswith("transformers."):
            return {**config, "architectures": [cls.__name__]}
    return config


def _plan(model, dtype, config: dict | None, expert_layout: str = "hub"):
    keep = _kept_in_fp32(model, parse_dtype(dtype))
    ties = getattr(getattr(model, "module", model), "all_tied_weights_keys", None)  # transformers 5's, on load
    ties = {str(a): str(b) for a, b in ties.items()} if isinstance(ties, dict) else None
    if is_fsdp1(model):  # FSDP1's state dicts gather; its flat shards are read in place (live.fsdp1)
        state, world = live_state(model)
        plan, tensors = plan_live(state, dtype, config, keep, expert_layout, ties)
        return replace(plan, world_size=world), tensors
    return plan_live(model.state_dict(), dtype, config, keep, expert_layout, ties)


def _kept_in_fp32(model, dtype: str | None):
    """What a cast leaves in float32, from the model's own lists (as the offline merge reads its class's)."""
    module = getattr(model, "module", model)  # FSDP1 wraps the transformers model
    lists = {name: frozenset(getattr(module, name, None) or ()) for name in (keep_fp32.STRICT, keep_fp32.LOOSE)}
    return keep_fp32.matcher(keep_fp32.kept_patterns(lists, dtype))


@dataclass
class _Output:
    """Rank 0's target, and the token the other ranks join it by (only the token travels)."""

    token: str
    target: object = None

    def __getstate__(self):
        return {"token": self.token, "target": None}


def _make_output(out_dir: str, overwrite: bool, files: list[OutputFile], holdings) -> _Output:
    # before anything is made: ranks that lay out or plan differently would write a wrong folder
    check_ranks_options([options for _, options in holdings], "save_pretrained")
    agree([held for held, _ in holdings])
    target = LocalTarget(out_dir, overwrite)
    try:
        for f in files:  # the headers first: the ranks write tensor bytes only
            with target.open(f.name, f.size) as file:
                file.write_at(f.header, 0)
    except BaseException:
        target.discard()
        raise
    return _Output(target.token, target)


def _finish(target, plan, files, pieces, dtype, config, model, tokenizer, start, processes, out_dir) -> SaveReport:
    generation = getattr(model, "generation_config", None)
    beside = FolderFiles(
        config=config,
        dtype=dtype or _dtype_of(plan),  # config.json always says the dtype written
        generation_config=generation.to_dict() if generation is not None and hasattr(generation, "to_dict") else None,
        tokenizer=tokenizer,
    )
    write_small_files(target, plan, files, settle(files, pieces), beside, Provenance(None, [], "live"), dtype)
    target.publish()
    return SaveReport(
        out_dir,
        len(plan.tensors),
        sum(p.nbytes for f in files for p in f.tensors),
        [f.name for f in files],
        time.perf_counter() - start,
        processes,
        {t.name: list(t.aliases) for t in plan.tensors if t.aliases},
        list(target.warnings),
    )


def _dtype_of(plan) -> str:
    floating = [t.target_dtype for t in plan.tensors if t.target_dtype.startswith(("float", "bfloat"))]
    return max(set(floating), key=floating.count) if floating else "float32"


def _default_group(group):
    if group is not None:
        return group
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
