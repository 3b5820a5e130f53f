"""Background `save_pretrained` on spawned gloo ranks, beside the blocking one, for the tests.

Each rank shards a tiny Llama with FSDP2, trains a step, and saves it twice: blocking into
`blocking/`, then in the background into `background/`, and trains the next step (its
collectives on the same process group) while the files are written. A second background save
(`second/`) is started before the first is waited for, and must wait for it; the model trained a
second step is also saved blocking into `after/`, which `second/` must equal. Each rank records
how it ended and the host memory its copy took in `outcome-{rank}.json`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import partial

from .fsdp2_writer import CheckpointSpec, _free_port, _layers, _train_one_step, build_model, serve_rank


@dataclass(frozen=True)
class BackgroundSpec:
    name: str
    shard_dim: int = 0
    save_dtype: str | None = None
    max_shard_size: str = "5GB"
    fail_rank: int | None = None  # this rank's background writes fail (a 1 KB file size limit): nothing published
    seed: int = 50


def save_both_ways(root: str, specs: list[BackgroundSpec], world_size: int) -> None:
    import torch.multiprocessing as mp

    os.makedirs(root, exist_ok=True)
    mp.spawn(_rank_main, args=(world_size, _free_port(), root, specs), nprocs=world_size, join=True)


def _rank_main(rank: int, world_size: int, port: int, root: str, specs: list[BackgroundSpec]) -> None:
    serve_rank(rank, world_size, port, "gloo", [partial(_save, rank, world_size, root, spec) for spec in specs])


def _save(rank: int, world_size: int, root: str, spec: BackgroundSpec) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    import fsdpfast

    folder = os.path.join(root, spec.name)
    base = CheckpointSpec(spec.name, seed=spec.seed)
    model = build_model(base)
    mesh = init_device_mesh("cpu", (world_size,))
    placement = (lambda p: Shard(spec.shard_dim) if p.ndim == 2 else None) if spec.shard_dim else None
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    _train_one_step(model, base)
    save = partial(fsdpfast.save_pretrained, model, dtype=spec.save_dtype, max_shard_size=spec.max_shard_size)
    outcome = {}
    if spec.fail_rank is not None:
        _save_failing(rank, spec, model, base, save, folder)
        return
    try:
        save(os.path.join(folder, "blocking"))
        first = save(os.path.join(folder, "background"), background=True)
        outcome["host_bytes"] = first.host_bytes
        _train_one_step(model, base)  # the next step, while the thread writes: the snapshot is what is saved
        second = save(os.path.join(folder, "second"), background=True)  # waits for the first
        outcome["first_done_before_second"] = first.done() and first.wait() is not None
        save(os.path.join(folder, "after"))  # waits for the second; the model as `second` saw it
        outcome["files"] = second.wait().files
        outcome["ok"] = True
    except Exception as exc:  # recorded for the test
        outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    with open(os.path.join(folder, f"outcome-{rank}.json"), "w") as f:
        json.dump(outcome, f)


def _save_failing(rank: int, spec: BackgroundSpec, model, base, save, folder: str) -> None:
    """A background save whose writes fail on `spec.fail_rank` while the next step trains: wait()
    raises on every rank, and `live/` is never published."""
    import resource

    from .live_examples import _limit_file_size

    limit = _limit_file_size(1024) if rank == spec.fail_rank else None
    try:
        handle = save(os.path.join(folder, "live"), background=True)
        _train_one_step(model, base)
        handle.wait()
        outcome = {"ok": True}
    except Exception as exc:  # recorded for the test: every rank must fail when one does
        outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    with open(os.path.join(folder, f"outcome-{rank}.json"), "w") as f:
        json.dump(outcome, f)
