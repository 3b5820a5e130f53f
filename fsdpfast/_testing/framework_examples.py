"""Checkpoints written by training frameworks' own saving code, on spawned gloo ranks, for the tests.

- accelerate (1.15): `Accelerator.prepare` shards the FSDP2 writer's tiny model with FSDP2 or FSDP1,
  one AdamW step changes every weight, then `Accelerator.save_state` (a DCP folder per model,
  `pytorch_model_fsdp_{i}/`, beside `optimizer_{i}/` and rng states) or `save_fsdp_model(...,
  use_dcp=False)` (per-rank `pytorch_model_fsdp_{i}_rank{r}.bin`) writes it. On the CPU accelerate
  does not choose FSDP by itself (it does only on accelerators): its state's distributed type,
  plugin and device are set after the Accelerator is constructed; everything after that
  (prepare, the FSDP wrapping, the saving) is accelerate's own code.
- a Hugging Face Trainer's `checkpoint-N/`: the files `Trainer._save_checkpoint` writes under
  FSDP, by the same calls (accelerate's `save_fsdp_model` and `save_fsdp_optimizer`, `torch.save`
  of the scheduler and rng states, `trainer_state.json`); the Trainer itself selects FSDP only
  on an accelerator. config.json is where a user puts it: the run's output_dir, above.
- torchtitan (0.3): its `CheckpointManager` saves a resumable `step-N/` (the model's tensors at
  the top level of the state dict beside `optimizer`, `lr_scheduler`, `dataloader`,
  `train_state`) and the last step model-only in its export dtype, for a model sharded with
  FSDP2 and torchtitan's own optimizer and scheduler containers. (Its Trainer assumes CUDA;
  the checkpoint manager does not care which model it saves: the FSDP2 writer's Llama is used.)

Rank 0 also saves the unsharded model gathered in the writing process (FSDP2 `full_tensor()`,
FSDP1 FULL_STATE_DICT) as the reference a merge must equal bit for bit.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import partial

import torch

from .fsdp2_writer import CheckpointSpec, _free_port, _layers, build_model, model_config, serve_rank

KINDS = ("accelerate-state", "accelerate-two-models", "accelerate-ranks", "trainer-checkpoint", "torchtitan")


@dataclass(frozen=True)
class FrameworkSpec:
    name: str
    kind: str  # one of KINDS
    fsdp_version: int = 2  # accelerate kinds
    state_dict_type: str = "SHARDED_STATE_DICT"  # accelerate kinds; LOCAL_STATE_DICT: FSDP1 flat parameters
    seed: int = 0

    def root(self, root: str) -> str:
        """The folder the framework was told to save into (a Trainer's output_dir, torchtitan's dump folder)."""
        return os.path.join(root, self.name)

    def folder(self, root: str) -> str:
        """The checkpoint folder a user of the framework gives to fsdpfast."""
        if self.kind == "trainer-checkpoint":
            return os.path.join(self.root(root), "checkpoint-1")
        if self.kind == "torchtitan":
            return os.path.join(self.root(root), "checkpoint", "step-1")
        return self.root(root)

    def reference_path(self, root: str, model: int = 0) -> str:
        return os.path.join(root, f"{self.name}.reference{model}.pt")


def write_framework_checkpoints(root: str, specs: list[FrameworkSpec], world_size: int) -> None:
    import torch.multiprocessing as mp

    os.makedirs(root, exist_ok=True)
    port = _free_port()
    mp.spawn(_rank_main, args=(world_size, port, root, specs), nprocs=world_size, join=True)


def launched_environment(rank: int, world_size: int, port: int) -> None:
    """What `accelerate launch` / torchrun put in each rank's environment; accelerate reads it."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _rank_main(rank: int, world_size: int, port: int, root: str, specs: list[FrameworkSpec]) -> None:
    launched_environment(rank, world_size, port)
    serve_rank(rank, world_size, port, "gloo", [partial(_write_one, rank, root, spec) for spec in specs])


def _write_one(rank: int, root: str, spec: FrameworkSpec) -> None:
    os.makedirs(spec.root(root), exist_ok=True)
    if spec.kind == "torchtitan":
        _torchtitan(rank, root, spec)
    else:
        _accelerate(rank, root, spec)


# ---- accelerate and the Trainer ---------------------------------------------------------------


def _accelerator(fsdp_version: int, state_dict_type: str, wrap: tuple[str, ...] = ("LlamaDecoderLayer",)):
    """An Accelerator that runs FSDP on the CPU: what accelerate's launcher would select on GPUs;
    `wrap`: the decoder-layer classes its transformer_based_wrap wraps."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=fsdp_version,
        state_dict_type=state_dict_type,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=list(wrap),
        cpu_ram_efficient_loading=False,
    )
    # PartialState's shared state is copied into AcceleratorState's whenever one is constructed
    # (accelerate constructs them internally), so both are set.
    for state in (PartialState(), accelerator.state):
        state.distributed_type = DistributedType.FSDP
        state.device = torch.device("cpu")
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def _prepared_model(accelerator, spec: FrameworkSpec, seed: int):
    example = CheckpointSpec(spec.name, seed=seed)
    model = build_model(example)
    if spec.fsdp_version == 1:  # FSDP1 flattens the parameters: the optimizer is made from the wrapped model
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    else:  # FSDP2 swaps the optimizer's parameters itself
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(
        0, model_config(example).vocab_size, (2, 9), generator=torch.Generator().manual_seed(1000 + seed)
    )
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _accelerate(rank: int, root: str, spec: FrameworkSpec) -> None:
    from accelerate.utils import save_fsdp_model, save_fsdp_optimizer

    accelerator = _accelerator(spec.fsdp_version, spec.state_dict_type)
    plugin = accelerator.state.fsdp_plugin
    count = 2 if spec.kind == "accelerate-two-models" else 1
    prepared = [_prepared_model(accelerator, spec, spec.seed + i) for i in range(count)]
    folder = spec.folder(root)
    if spec.kind in ("accelerate-state", "accelerate-two-models"):
        accelerator.save_state(folder)
    elif spec.kind == "accelerate-ranks":
        model, optimizer = prepared[0]
        save_fsdp_model(plugin, accelerator, model, folder, use_dcp=False)
        save_fsdp_optimizer(plugin, accelerator, optimizer, model, folder, use_dcp=False)
    else:  # trainer-checkpoint: what Trainer._save_checkpoint writes under FSDP
        model, optimizer = prepared[0]
        os.makedirs(folder, exist_ok=True)
        save_fsdp_model(plugin, accelerator, model, folder)
        save_fsdp_optimizer(plugin, accelerator, optimizer, model, folder)
        torch.save({"python": 0, "cpu": torch.get_rng_state()}, os.path.join(folder, f"rng_state_{rank}.pth"))
        if rank == 0:
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
            torch.save(scheduler.state_dict(), os.path.join(folder, "scheduler.pt"))
            with open(os.path.join(folder, "trainer_state.json"), "w") as f:
                json.dump({"global_step": 1, "max_steps": 1, "log_history": []}, f)
    for index, (model, _) in enumerate(prepared):
        full = _full_state_dict(model, spec.fsdp_version)
        if rank == 0:
            torch.save({"state_dict": full, "tied": []}, spec.reference_path(root, index))
    if rank == 0:  # the model's config.json where a user puts it: beside the checkpoint, or above it (Trainer)
        config = model_config(CheckpointSpec(spec.name))
        config.architectures = ["LlamaForCausalLM"]
        config.save_pretrained(spec.root(root))


def _full_state_dict(model, fsdp_version: int) -> dict:
    from torch.distributed.tensor import DTensor

    if fsdp_version == 2:
        return {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()
        }
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.state_dict_type(
        model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    ):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- torchtitan ---------------------------------------------------------------------------------


class TrainState:
    """torchtitan's Trainer hands itself to the checkpoint manager as `train_state`; this is its state_dict."""

    def __init__(self, step: int):
        self.step, self.ntokens_seen = step, 18 * step

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


def _torchtitan(rank: int, root: str, spec: FrameworkSpec) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    example = CheckpointSpec(spec.name, seed=spec.seed)
    model = build_model(example)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = default_adamw(lr=1e-2, implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=2)
    ids = torch.randint(
        0, model_config(example).vocab_size, (2, 9), generator=torch.Generator().manual_seed(1000 + spec.seed)
    )
    model(input_ids=ids, labels=ids).loss.backward()
    optimizers.step()
    schedulers.step()
    optimizers.zero_grad()
    config = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=1, last_save_model_only=True, export_dtype="bfloat16"
    )
    manager = CheckpointManager(
        config,
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": TrainState(1)},
        sd_adapter=None,
        base_folder=spec.root(root),
    )
    try:
        manager.save(curr_step=1)  # resumable: model, optimizer, lr_scheduler, dataloader, train_state
        manager.save(curr_step=2, last_step=True)  # the last step: the model alone, in bfloat16
    finally:
        manager.close()
    full = _full_state_dict(model, 2)
    if rank == 0:
        torch.save({"state_dict": full, "tied": []}, spec.reference_path(root))
