"""Real FSDP1 LOCAL_STATE_DICT checkpoints (flat parameters) for the tests, written by real FSDP1.

FSDP1 (`FullyShardedDataParallel`) refuses to start without an accelerator unless it is told
the device: with `device_id=torch.device("cpu")` it runs on the CPU with gloo (torch 2.13),
so these files come from FSDP1 itself, not from an imitation of its flattening rules. Each
rank is a spawned process; FSDP1 wraps a tiny transformers model (the FSDP2 writer's models) with
`ModuleWrapPolicy` over the given classes, one AdamW step changes every weight, and each rank
saves `model.state_dict()` under `StateDictType.LOCAL_STATE_DICT` as accelerate names it
(`pytorch_model_fsdp_rank{r}.bin`). Rank 0 also saves FSDP1's own FULL_STATE_DICT as the
reference the merge must equal bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import torch

from .fsdp2_writer import (
    CheckpointSpec,
    _free_port,
    _tied_names,
    _train_one_step,
    _write_hf_files,
    build_model,
    name_architecture,
    serve_rank,
)

FILE_NAME = "pytorch_model_fsdp_rank{rank}.bin"  # accelerate's name for LOCAL_STATE_DICT rank files


@dataclass(frozen=True)
class Fsdp1Spec:
    name: str
    model: str = "llama"  # llama | llama-tied | bert (fsdpfast._testing.fsdp2_writer)
    dtype: str = "float32"
    use_orig_params: bool = False
    wrap: tuple[str, ...] = ()  # module class names; () = the model's _no_split_modules; ("none",) = the root only
    seed: int = 0
    file_name: str = FILE_NAME

    def folder(self, root: str) -> str:
        return os.path.join(root, self.name)

    def reference_path(self, root: str) -> str:
        return os.path.join(root, f"{self.name}.reference.pt")


def write_fsdp1_checkpoints(
    root: str, specs: list[Fsdp1Spec], world_size: int, device: str = "cpu", backend: str = "gloo"
) -> None:
    """Write every spec's checkpoint with `world_size` spawned ranks (one process group for all).

    `device` "cuda": rank r runs on GPU r % count (benchmarks/fsdp1_real_check.py).
    """
    import torch.multiprocessing as mp

    os.makedirs(root, exist_ok=True)
    mp.spawn(_rank_main, args=(world_size, _free_port(), root, specs, device, backend), nprocs=world_size, join=True)


def _rank_main(
    rank: int, world_size: int, port: int, root: str, specs: list[Fsdp1Spec], device_kind: str, backend: str
) -> None:
    device = torch.device("cpu")
    if device_kind == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    serve_rank(rank, world_size, port, backend, [partial(write_one, rank, root, spec, device) for spec in specs])


def wrap_classes(model, names: tuple[str, ...]) -> set[type]:
    """The module classes named (by class name) in `names`, or the model's _no_split_modules; ("none",): no class."""
    wanted = set() if names == ("none",) else set(names) or set(model._no_split_modules or ())
    return {type(m) for m in model.modules() if type(m).__name__ in wanted}


def write_one(rank: int, root: str, spec: Fsdp1Spec, device: torch.device) -> None:
    """One spec's rank file (and, on rank 0, the reference and the huggingface/ folder)."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    folder = spec.folder(root)
    os.makedirs(folder, exist_ok=True)
    example = CheckpointSpec(spec.name, model=spec.model, dtype=spec.dtype, seed=spec.seed)
    model = build_model(example)
    tied = _tied_names(model)
    fsdp = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy(wrap_classes(model, spec.wrap)),
        use_orig_params=spec.use_orig_params,
        device_id=device,
    )
    _train_one_step(fsdp, example)
    with FSDP.state_dict_type(fsdp, StateDictType.LOCAL_STATE_DICT):
        local = fsdp.state_dict()
    torch.save(local, os.path.join(folder, spec.file_name.format(rank=rank)))
    # offload_to_cpu on a CPU model frees the very storage it would copy: only offload from a GPU
    full_config = FullStateDictConfig(offload_to_cpu=device.type != "cpu", rank0_only=False)
    with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, full_config):
        full = {k: v.detach().cpu().clone() for k, v in fsdp.state_dict().items()}
    if rank == 0:
        torch.save({"state_dict": full, "tied": tied}, spec.reference_path(root))
        hf = os.path.join(folder, "huggingface")
        _write_hf_files(hf, example)
        name_architecture(os.path.join(hf, "config.json"), type(model).__name__)
