"""Live FSDP2 models saved by `fsdpfast.save_pretrained` on spawned gloo ranks, for the tests.

Each rank builds the same tiny model, shards it with FSDP2 `fully_shard` (dim 0, another dim via
shard_placement_fn, or HSDP; or tensor parallel with torch's `parallelize_module` over a (dp, tp)
mesh and FSDP2 over dp, as fsdpfast._testing.tp_examples does), trains one step, then writes three things: the folder
save_pretrained makes (`live/`), the verl-style rank files of the same model for an offline merge
(`ckpt/`), and, on rank 0, the reference: `get_model_state_dict(full_state_dict=True)` saved the
usual way, by the model's own `save_pretrained` (`reference/`). Each rank records how its call
ended in `outcome-{rank}.json`, so a test can check that a rank's failure failed them all.
LiveSpec.device = "cuda" puts the model on the GPU instead (save_live's `backend`: NCCL or gloo).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import partial

import torch

from .fsdp2_writer import CheckpointSpec, _free_port, _layers, _train_one_step, _write_hf_files, build_model, serve_rank
from .tp_examples import TpSpec, parallelize
from .tp_examples import _example as _tp_example
from .tp_examples import _train_one_step as _train_tp_one_step


@dataclass(frozen=True)
class LiveSpec:
    name: str
    model: str = "llama"  # "llama-tied": tied embeddings
    dtype: str = "float32"  # the parameters'
    shard_dim: int = 0  # FSDP2's Shard(dim) of 2-D parameters
    hsdp: bool = False  # a (replicate, shard) mesh: world size 4 (with tp: (replicate, shard, tp), world size 8)
    save_dtype: str | None = None  # save_pretrained(dtype=...)
    max_shard_size: str | int = "5GB"
    fail_rank: int | None = None  # this rank's writes fail (its file size limit is 1 KB): nothing may be published
    # the DeviceMesh's rank tensor (nested lists under hsdp), e.g. (3, 2, 1, 0); None: init_device_mesh's
    mesh_ranks: tuple | None = None
    tp: int = 1  # > 1: a (dp, tp) mesh, tensor parallel (torch's parallelize_module) over tp, then FSDP2 over dp
    # a DTensor buffer save_pretrained must refuse, added just before it is called: "partial" (a Partial
    # placement) or "uneven" (local pieces that are not torch.chunk's split, made with DTensor.from_local)
    refused: str | None = None
    # the measured alternatives save_pretrained keeps reachable: redistribute column blocks to Shard(0)
    # first, cast CPU tensors with torch's .to() (live.write.WriteWays)
    redistribute: bool = False
    torch_cast: bool = False
    seed: int = 0
    # "cuda": the model on GPU 0 (every rank shares it), sharded over a CUDA mesh. On NCCL (one rank: NCCL
    # refuses two ranks on one GPU) it trains a step and the reference is gathered as on CPU; on gloo, whose
    # CUDA collectives FSDP2's training does not have, it does not train, and the reference is rank 0's
    # unsharded model saved before sharding (the same seed). No rank files are written (`ckpt/` is CPU only).
    device: str = "cpu"

    def folder(self, root: str) -> str:
        return os.path.join(root, self.name)

    def as_checkpoint_spec(self) -> CheckpointSpec:
        if self.tp > 1:
            return _tp_example(self.as_tp_spec())
        return CheckpointSpec(self.name, model=self.model, dtype=self.dtype, seed=self.seed)

    def as_tp_spec(self, world_size: int = 4) -> TpSpec:
        """hsdp: a (replicate, shard, tp) mesh with two replica groups, else (dp, tp)."""
        dp = (2, world_size // (2 * self.tp)) if self.hsdp else (world_size // self.tp,)
        return TpSpec(self.name, mesh=(*dp, self.tp), model=self.model, dtype=self.dtype, seed=self.seed)


def save_live(root: str, specs: list[LiveSpec], world_size: int, backend: str = "gloo") -> None:
    import torch.multiprocessing as mp

    os.makedirs(root, exist_ok=True)
    mp.spawn(_rank_main, args=(world_size, _free_port(), root, specs, backend), nprocs=world_size, join=True)


def _rank_main(rank: int, world_size: int, port: int, root: str, specs: list[LiveSpec], backend: str = "gloo") -> None:
    if any(spec.device == "cuda" for spec in specs):
        torch.cuda.set_device(0)  # before the process group: NCCL binds to the current device
    serve_rank(rank, world_size, port, backend, [partial(_save_one, rank, world_size, root, spec) for spec in specs])


def _save_one(rank: int, world_size: int, root: str, spec: LiveSpec) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    import fsdpfast
    from fsdpfast.live.write import WriteWays

    folder = spec.folder(root)
    os.makedirs(os.path.join(folder, "ckpt"), exist_ok=True)
    base = spec.as_checkpoint_spec()
    model = build_model(base)
    if spec.device == "cuda":
        mesh = _shard_on_cuda(model, base, spec, rank, world_size, folder)
    elif spec.tp > 1:
        mesh = parallelize(model, spec.as_tp_spec(world_size))
        _train_tp_one_step(model, spec.seed)
    else:
        names = ("replicate", "shard") if spec.hsdp else None
        if spec.mesh_ranks is not None:  # the ranks in the order given
            mesh = DeviceMesh("cpu", torch.tensor(spec.mesh_ranks), mesh_dim_names=names)
        elif spec.hsdp:
            mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=names)
        else:
            mesh = init_device_mesh("cpu", (world_size,))
        placement = (lambda p: Shard(spec.shard_dim) if p.ndim == 2 else None) if spec.shard_dim else None
        for layer in _layers(model):
            fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
        fully_shard(model, mesh=mesh, shard_placement_fn=placement)
        _train_one_step(model, base)
    if spec.device == "cpu":
        torch.save(model.state_dict(), os.path.join(folder, "ckpt", f"model_world_size_{world_size}_rank_{rank}.pt"))
    if spec.device == "cpu" or _trains_on_cuda():
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            if spec.device == "cpu":
                _write_hf_files(os.path.join(folder, "ckpt", "huggingface"), base)
            model.save_pretrained(os.path.join(folder, "reference"), state_dict=full)
    if spec.refused is not None:
        model.register_buffer("fsdpfast_refused", _refused_dtensor(spec.refused, mesh, rank, world_size))
    limit = _limit_file_size(1024) if rank == spec.fail_rank else None
    ways = WriteWays(redistribute=spec.redistribute, torch_cast=spec.torch_cast)
    try:
        report = fsdpfast.save_pretrained(
            model, os.path.join(folder, "live"), dtype=spec.save_dtype, max_shard_size=spec.max_shard_size, ways=ways
        )
        outcome = {"ok": True, "files": report.files, "tied": report.tied}
    except Exception as exc:  # recorded for the test: every rank must fail when one does
        outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        if limit is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    with open(os.path.join(folder, f"outcome-{rank}.json"), "w") as f:
        json.dump(outcome, f)


def _trains_on_cuda() -> bool:
    import torch.distributed as dist

    return "nccl" in str(dist.get_backend())


def _shard_on_cuda(model, base: CheckpointSpec, spec: LiveSpec, rank: int, world_size: int, folder: str):
    """Move the model to GPU 0 and shard it over a CUDA mesh; train one step where the backend can (NCCL),
    else save rank 0's unsharded model first as the reference. The mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    model.to("cuda")
    if not _trains_on_cuda() and rank == 0:
        model.save_pretrained(os.path.join(folder, "reference"))
    mesh = init_device_mesh("cuda", (world_size,))
    placement = (lambda p: Shard(spec.shard_dim) if p.ndim == 2 else None) if spec.shard_dim else None
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    if _trains_on_cuda():
        generator = torch.Generator().manual_seed(1000 + base.seed)
        ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=generator).to("cuda")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return mesh


def _refused_dtensor(kind: str, mesh, rank: int, world_size: int):
    """A DTensor made by torch's own DTensor.from_local that save_pretrained cannot write."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    if kind == "partial":
        return DTensor.from_local(torch.full((3, 4), float(rank)), mesh, [Partial()])
    rows = [world_size + 1 if r == 0 else 1 for r in range(world_size)]  # not torch.chunk's split of the rows
    local = torch.arange(rows[rank] * 4, dtype=torch.float32).reshape(rows[rank], 4)
    return DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size((sum(rows), 4)), stride=(4, 1))


def _limit_file_size(limit: int) -> tuple[int, int]:
    """Writes past `limit` bytes fail with EFBIG on this rank (as a full disk would fail them); the old limits."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error from pwrite, not a killed process
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    return old
