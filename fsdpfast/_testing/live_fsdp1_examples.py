"""Live FSDP1 models saved by `fsdpfast.save_pretrained` on spawned gloo ranks, for the tests.

Each rank builds the same tiny model, wraps it in FSDP1 (`FullyShardedDataParallel`, one unit
per decoder layer and the root, `device_id=cpu` so that it runs on gloo), trains one AdamW step,
then writes: FSDP1's LOCAL_STATE_DICT rank files and the huggingface/ folder for an offline merge
of the same model (`ckpt/`), on rank 0 FSDP1's own FULL_STATE_DICT saved with safetensors
(`reference.safetensors`, every name, tied ones too), and the folder save_pretrained makes
(`live/`). Each rank records how its call ended in `outcome-{rank}.json`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import partial

import torch

from .fsdp1_examples import FILE_NAME, wrap_classes
from .fsdp2_writer import (
    PROBE_INPUT,
    CheckpointSpec,
    _free_port,
    _layers,
    _train_one_step,
    _write_hf_files,
    build_model,
    serve_rank,
)
from .live_examples import _limit_file_size


@dataclass(frozen=True)
class LiveFsdp1Spec:
    name: str
    model: str = "llama"  # "llama-tied": tied embeddings
    dtype: str = "float32"  # the parameters'
    use_orig_params: bool = True
    checkpoint_wrappers: bool = False  # layers under activation checkpointing: names carry _checkpoint_wrapped_module
    save_dtype: str | None = None  # save_pretrained(dtype=...)
    max_shard_size: str | int = "5GB"
    fail_rank: int | None = None  # this rank's writes fail (its file size limit is 1 KB): nothing may be published
    untie: bool = False  # the config ties the embeddings, the model holds two parameters: refused
    strategy: str = "FULL_SHARD"  # FSDP1's ShardingStrategy; HYBRID_SHARD on a (replicate 2, shard world/2) mesh
    cast_buffers: bool = False  # a persistent buffer, and MixedPrecision(buffer_dtype=bf16): refused
    # MixedPrecision(param_dtype=bf16) and a forward just before the save, no backward (a save
    # mid-step): the fp32 shards the optimizer updates are what must be written, not the bf16 copies
    compute_in_bf16: bool = False
    seed: int = 0

    def folder(self, root: str) -> str:
        return os.path.join(root, self.name)

    def as_checkpoint_spec(self) -> CheckpointSpec:
        return CheckpointSpec(
            self.name, model=self.model, dtype=self.dtype, seed=self.seed, architecture=True, buffer=self.cast_buffers
        )


def save_live_fsdp1(root: str, specs: list[LiveFsdp1Spec], world_size: int) -> None:
    import torch.multiprocessing as mp

    os.makedirs(root, exist_ok=True)
    mp.spawn(_rank_main, args=(world_size, _free_port(), root, specs), nprocs=world_size, join=True)


def _rank_main(rank: int, world_size: int, port: int, root: str, specs: list[LiveFsdp1Spec]) -> None:
    serve_rank(rank, world_size, port, "gloo", [partial(save_one, rank, root, spec) for spec in specs])


def save_one(rank: int, root: str, spec: LiveFsdp1Spec) -> None:
    from safetensors.torch import save_file
    from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import fsdpfast
    from fsdpfast.live.fsdp1 import live_state
    from fsdpfast.plan.normalise import clean_name

    folder = spec.folder(root)
    os.makedirs(os.path.join(folder, "ckpt"), exist_ok=True)
    base = spec.as_checkpoint_spec()
    model = build_model(base)
    if spec.untie:  # two parameters under the names config.json ties, with values that differ after training
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    wrap = wrap_classes(model, ())
    if spec.checkpoint_wrappers:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        layers = _layers(model)
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    strategy = {"sharding_strategy": ShardingStrategy[spec.strategy]}
    if spec.strategy == "HYBRID_SHARD":
        from torch.distributed.device_mesh import init_device_mesh

        strategy["device_mesh"] = init_device_mesh("cpu", (2, torch.distributed.get_world_size() // 2))
    fsdp = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy(wrap),
        use_orig_params=spec.use_orig_params,
        device_id=torch.device("cpu"),
        mixed_precision=MixedPrecision(
            param_dtype=torch.bfloat16 if spec.compute_in_bf16 else None,
            buffer_dtype=torch.bfloat16 if spec.cast_buffers else None,
        )
        if spec.cast_buffers or spec.compute_in_bf16
        else None,
        **strategy,
    )
    _train_one_step(fsdp, base)
    if (
        spec.strategy != "HYBRID_SHARD"
    ):  # FSDP1 on a device mesh has no LOCAL_STATE_DICT: no offline merge to compare with
        with FSDP.state_dict_type(fsdp, StateDictType.LOCAL_STATE_DICT):
            torch.save(fsdp.state_dict(), os.path.join(folder, "ckpt", FILE_NAME.format(rank=rank)))
    full_config = FullStateDictConfig(
        offload_to_cpu=False, rank0_only=False
    )  # offload would free a CPU model's storage
    with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, full_config):
        full = {k: v.detach().clone().contiguous() for k, v in fsdp.state_dict().items()}
    if rank == 0:
        _write_hf_files(os.path.join(folder, "ckpt", "huggingface"), base)
        save_file(full, os.path.join(folder, "reference.safetensors"))
        with open(os.path.join(folder, "reference-order.json"), "w") as f:
            json.dump(list(full), f)
    if spec.compute_in_bf16:
        fsdp(input_ids=torch.tensor(PROBE_INPUT))  # computes in bf16 copies of the parameters
    limit = _limit_file_size(1024) if rank == spec.fail_rank else None
    try:
        report = fsdpfast.save_pretrained(
            fsdp, os.path.join(folder, "live"), dtype=spec.save_dtype, max_shard_size=spec.max_shard_size
        )
        walked = [clean_name(key) for key in live_state(fsdp)[0]]  # the names save_pretrained planned, in its order
        outcome = {"ok": True, "files": report.files, "tied": report.tied, "walked": walked}
    except Exception as exc:  # recorded for the test: every rank must fail when one does
        outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        if limit is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    with open(os.path.join(folder, f"outcome-{rank}.json"), "w") as f:
        json.dump(outcome, f)
