"""Live models that `fsdpfast.save_pretrained` must refuse (or, for a plain model, write), on spawned gloo ranks.

Cases (every rank builds the same tiny transformers Llama from the same seed):
* "fsdp2-untied": FSDP2, config.json ties the embeddings, the model holds two parameters whose
  values differ after one training step: refused on every rank;
* "mixed": FSDP2 on rank 0, the same model plain on the others: refused before anything is made;
* "clash-on-rank-1": plain models, rank 1's with two keys that become one name: rank 1 cannot plan,
  and every rank stops;
* "plain": a plain model on every rank (DDP replicas: the same values): rank 0's copy is written;
  rank 0 also saves its state dict with safetensors (`reference.safetensors`);
* "shard-size-on-rank-1": FSDP2, rank 1 given another max_shard_size: refused before anything is made;
* "spelled-otherwise-on-rank-1": FSDP2, rank 0 given dtype "bf16", rank 1 "bfloat16" and the same
  max_shard_size as 5000MB: written; rank 0 saves the full tensors cast by torch (`reference.safetensors`).
* "overwrite": FSDP2, saved in bf16; rank 0 adds a file of its own to the folder, and a save with
  overwrite=True is refused on every rank (`refused-{rank}.json`); once the file is gone the same
  save replaces the folder (its full state dict in `reference.safetensors`).
FSDP1 cases are live_fsdp1_examples' specs, run in the same process group.
Each rank records how its call ended in `outcome-{rank}.json`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import partial

import torch

from .fsdp2_writer import CheckpointSpec, _free_port, _layers, _train_one_step, build_model, serve_rank
from .live_fsdp1_examples import LiveFsdp1Spec, save_one


@dataclass(frozen=True)
class LiveCase:
    name: str
    kind: str  # "fsdp2-untied" | "mixed" | "clash-on-rank-1" | "plain" | "shard-size-on-rank-1" | "spelled-otherwise-on-rank-1" | "overwrite"
    seed: int = 0

    def folder(self, root: str) -> str:
        return os.path.join(root, self.name)


def save_cases(root: str, cases: list, world_size: int) -> None:
    """Run every case (a LiveCase or a LiveFsdp1Spec) on `world_size` spawned ranks of one process group."""
    import torch.multiprocessing as mp

    os.makedirs(root, exist_ok=True)
    mp.spawn(_rank_main, args=(world_size, _free_port(), root, cases), nprocs=world_size, join=True)


def _rank_main(rank: int, world_size: int, port: int, root: str, cases: list) -> None:
    jobs = [
        partial(save_one, rank, root, case)
        if isinstance(case, LiveFsdp1Spec)
        else partial(_save_case, rank, root, case)
        for case in cases
    ]
    serve_rank(rank, world_size, port, "gloo", jobs)


def _save_case(rank: int, root: str, case: LiveCase) -> None:
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fsdpfast

    folder = case.folder(root)
    os.makedirs(folder, exist_ok=True)
    spec = CheckpointSpec(case.name, model="llama-tied" if case.kind == "fsdp2-untied" else "llama", seed=case.seed)
    model = build_model(spec)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))  # collective: every rank makes it
    if case.kind == "fsdp2-untied":
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    fsdp2 = ("fsdp2-untied", "shard-size-on-rank-1", "spelled-otherwise-on-rank-1", "overwrite")
    if case.kind in fsdp2 or (case.kind == "mixed" and rank == 0):
        for layer in _layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if case.kind == "clash-on-rank-1" and rank == 1:
        model.add_module("_orig_mod", torch.nn.Module())  # torch.compile's wrapper name, removed from names
        model._orig_mod.add_module("lm_head", model.lm_head)
    if case.kind != "mixed":  # a mixed model cannot train: its ranks' collectives do not match
        _train_one_step(model, spec)
    if case.kind == "plain" and rank == 0:
        save_file(
            {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
            os.path.join(folder, "reference.safetensors"),
        )
    options = {}
    if case.kind == "shard-size-on-rank-1" and rank == 1:
        options = {"max_shard_size": "100KB"}
    if case.kind == "spelled-otherwise-on-rank-1":
        options = {"dtype": "bf16"} if rank == 0 else {"dtype": "bfloat16", "max_shard_size": "5000MB"}
        full = {k: v.full_tensor().to(torch.bfloat16) for k, v in model.state_dict().items()}  # collective
        if rank == 0:
            save_file(full, os.path.join(folder, "reference.safetensors"))
    if case.kind == "overwrite":
        _save_over_an_earlier_save(rank, folder, model)
        options = {"overwrite": True}
    try:
        report = fsdpfast.save_pretrained(model, os.path.join(folder, "live"), **options)
        outcome = {"ok": True, "files": report.files, "tied": report.tied}
    except Exception as exc:  # recorded for the test
        outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    with open(os.path.join(folder, f"outcome-{rank}.json"), "w") as f:
        json.dump(outcome, f)


def _save_over_an_earlier_save(rank: int, folder: str, model) -> None:
    """The "overwrite" case up to its last save: the earlier (bf16) save, a file of the user's added to
    it, the refused overwrite (each rank's outcome in refused-{rank}.json), the file removed again."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import fsdpfast

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    live, added = os.path.join(folder, "live"), os.path.join(folder, "live", "eval_results.json")
    fsdpfast.save_pretrained(model, live, dtype="bf16")
    if rank == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, os.path.join(folder, "reference.safetensors"))
        with open(added, "w") as f:
            f.write('{"accuracy": 0.5}')
    dist.barrier()
    try:
        fsdpfast.save_pretrained(model, live, overwrite=True)
        refused = {"ok": True}
    except Exception as exc:
        refused = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "kept": os.path.isfile(added)}
    with open(os.path.join(folder, f"refused-{rank}.json"), "w") as f:
        json.dump(refused, f)
    dist.barrier()
    if rank == 0:
        os.unlink(added)
    dist.barrier()
