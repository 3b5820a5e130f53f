"""Training runs whose checkpoints the frameworks' own saving code writes, several steps in a row,
for the tests of `fsdpfast watch` that run the watcher beside them.

Real gloo ranks; one AdamW step before each save, so every step's weights differ:
- "accelerate": `Accelerator.save_state(run/checkpoint_N)` on an FSDP2 model (framework_examples'
  CPU Accelerator); the model's DCP folder `pytorch_model_fsdp_0/` beside the optimizer's and the
  rng states.
- "trainer": a real `transformers.Trainer.train()` under FSDP2 (save_steps=1) writes `run/checkpoint-N/`
  itself (model and optimizer DCP folders, scheduler, rng states, trainer_state.json last);
  config.json in the output_dir. No TrainingArguments switch runs the Trainer's FSDP on CPU ranks
  (accelerate's AcceleratorState picks FSDP only for accelerator ranks; `fsdp=` with `use_cpu=True`
  trains DDP), so the Accelerator's state is set to FSDP first, as framework_examples does, and
  the Trainer is told `accelerator_config={"use_configured_state": True}` to take it.
- "torchtitan": its `CheckpointManager` (interval 1) saves `run/step-N/` (the manager's folder is
  the run folder) with the model, optimizer, scheduler and train state.
- "deepspeed": `engine.save_checkpoint(run)` (ZeRO-3, bf16), tags `global_stepN`, `latest` after.
- "verl": verl's own `FSDPCheckpointManager.save_checkpoint(run/global_step_N/actor)` on an FSDP2
  model (its rank files, optimizer and extra states, `huggingface/`, fsdp_config.json), then
  latest_checkpointed_iteration.txt written by rank 0 as verl's trainer writes it after the save
  (verl/trainer/ppo/ray_trainer.py, RayPPOTrainer._save_checkpoint; verl skips it with
  checkpoint.async_save). verl is not a test dependency (its requirements pin
  transformers < 5.11 and pull in ray): see tests/watch/test_frameworks_live.py.
Rank 0 saves each step's unsharded model to `refs/<checkpoint name>.pt` after the save returns.
"""

from __future__ import annotations

import os
from functools import partial

import torch

from .fsdp2_writer import CheckpointSpec, _free_port, _layers, build_model, model_config, serve_rank

FRAMEWORKS = ("accelerate", "trainer", "torchtitan", "deepspeed", "verl")
# A little larger than the readers' examples, so that a save takes long enough to be looked at midway.
SIZES = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, vocab_size=4096, num_attention_heads=8)


def checkpoint_name(framework: str, step: int) -> str:
    return {
        "accelerate": f"checkpoint_{step}",
        "trainer": f"checkpoint-{step}",
        "torchtitan": f"step-{step}",
        "deepspeed": f"global_step{step}",
        "verl": f"global_step_{step}",
    }[framework]


def run_folder(root: str, framework: str) -> str:
    """The folder `fsdpfast watch` is given: where the framework puts its checkpoints."""
    return os.path.join(root, "run", "checkpoint") if framework == "torchtitan" else os.path.join(root, "run")


def write_framework_run(root: str, framework: str, steps: int, world_size: int = 2, seed: int = 60) -> None:
    import torch.multiprocessing as mp

    for sub in ("run", "refs"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    if framework == "deepspeed":
        from .deepspeed_examples import spawn_deepspeed_ranks

        spawn_deepspeed_ranks(_deepspeed_rank, world_size, root, steps, seed)
        return
    port = _free_port()
    mp.spawn(_rank_main, args=(world_size, port, root, framework, steps, seed), nprocs=world_size, join=True)


def _spec(seed: int) -> CheckpointSpec:
    return CheckpointSpec("run", sizes=SIZES, seed=seed)


def _rank_main(rank: int, world_size: int, port: int, root: str, framework: str, steps: int, seed: int) -> None:
    from .framework_examples import launched_environment

    launched_environment(rank, world_size, port)
    job = {"torchtitan": _torchtitan, "trainer": _trainer, "verl": _verl}.get(framework, _accelerate)
    serve_rank(rank, world_size, port, "gloo", [partial(job, rank, root, framework, steps, seed)])


def _write_config(root: str, seed: int) -> None:
    config = model_config(_spec(seed))
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(os.path.join(root, "run"))


def _save_reference(rank: int, root: str, name: str, model) -> None:
    from torch.distributed.tensor import DTensor

    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }
    if rank == 0:
        torch.save({"state_dict": full, "tied": []}, os.path.join(root, "refs", f"{name}.pt"))


def _ids(vocab: int, seed: int, step: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(1000 * seed + step))


def _accelerate(rank: int, root: str, framework: str, steps: int, seed: int) -> None:
    from .framework_examples import _accelerator

    if rank == 0:
        _write_config(root, seed)
    accelerator = _accelerator(2, "SHARDED_STATE_DICT")
    model = build_model(_spec(seed))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(1, steps + 1):
        ids = _ids(SIZES["vocab_size"], seed, step)
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
        name = checkpoint_name(framework, step)
        accelerator.save_state(os.path.join(root, "run", name))
        _save_reference(rank, root, name, model)


def _trainer(rank: int, root: str, framework: str, steps: int, seed: int) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from .framework_examples import _accelerator

    if rank == 0:
        _write_config(root, seed)
    _accelerator(2, "SHARDED_STATE_DICT")  # the state the Trainer's Accelerator takes (use_configured_state)

    class SaveReference(TrainerCallback):  # called on every rank right after _save_checkpoint
        def on_save(self, args, state, control, model=None, **kwargs):
            _save_reference(rank, root, checkpoint_name(framework, state.global_step), model)

    batches = [_ids(SIZES["vocab_size"], seed, step) for step in range(1, steps + 1)]
    rows = [{"input_ids": row, "labels": row} for ids in batches for row in ids]  # 2 ranks x 1 row a step
    args = TrainingArguments(
        output_dir=os.path.join(root, "run"),
        use_cpu=True,
        max_steps=steps,
        save_steps=1,
        per_device_train_batch_size=1,
        learning_rate=1e-2,
        report_to=[],
        disable_tqdm=True,
        logging_steps=steps + 1,
        fsdp=True,
        fsdp_config={
            "version": 2,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "state_dict_type": "SHARDED_STATE_DICT",
        },
        accelerator_config={"use_configured_state": True},
    )
    trainer = Trainer(model=build_model(_spec(seed)), args=args, train_dataset=rows, callbacks=[SaveReference()])
    assert trainer.is_fsdp_enabled, "the Trainer did not take the FSDP state"
    trainer.train()


def _fsdp2_model(rank: int, root: str, seed: int):
    """The run's Llama (config.json in the run folder, rank 0), each layer and the root fully_shard-ed."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if rank == 0:
        _write_config(root, seed)
    model = build_model(_spec(seed))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _torchtitan(rank: int, root: str, framework: str, steps: int, seed: int) -> None:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    from .framework_examples import TrainState

    model = _fsdp2_model(rank, root, seed)
    optimizers = default_adamw(lr=1e-2, implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=steps + 1)
    state = TrainState(0)
    manager = CheckpointManager(
        CheckpointManager.Config(enable=True, folder="checkpoint", interval=1),
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder=os.path.join(root, "run"),
    )
    try:
        for step in range(1, steps + 1):
            ids = _ids(SIZES["vocab_size"], seed, step)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizers.step()
            schedulers.step()
            optimizers.zero_grad()
            state.step = step
            manager.save(curr_step=step)
            _save_reference(rank, root, checkpoint_name(framework, step), model)
    finally:
        manager.close()


def _verl(rank: int, root: str, framework: str, steps: int, seed: int) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    model = _fsdp2_model(rank, root, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    contents = ["model", "optimizer", "extra"]
    manager = FSDPCheckpointManager(
        model,
        optimizer,
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
        checkpoint_config=OmegaConf.create({"save_contents": contents, "load_contents": contents}),
    )
    for step in range(1, steps + 1):
        ids = _ids(SIZES["vocab_size"], seed, step)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        name = checkpoint_name(framework, step)
        manager.save_checkpoint(os.path.join(root, "run", name, "actor"), global_step=step)
        _save_reference(rank, root, name, model)
        dist.barrier()
        if rank == 0:  # verl's trainer, once the actor's save returned on every rank
            with open(os.path.join(root, "run", "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(step))


def _deepspeed_rank(rank: int, world_size: int, port: int, root: str, steps: int, seed: int) -> None:
    import contextlib
    import io

    from .deepspeed_examples import DeepSpeedSpec, _ds_config, _gather_reference, join_deepspeed
    from .fsdp2_writer import exit_rank

    join_deepspeed(rank, world_size, port)
    import deepspeed

    if rank == 0:
        _write_config(root, seed)
    with contextlib.redirect_stdout(io.StringIO()):
        model = build_model(_spec(seed))
        config = _ds_config(DeepSpeedSpec("run", stage=3, dtype="bfloat16"))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    for step in range(1, steps + 1):
        ids = _ids(SIZES["vocab_size"], seed, step)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        engine.save_checkpoint(os.path.join(root, "run"))  # tag global_step{N}: N is the engine's step count
        reference = _gather_reference(engine)
        if rank == 0:
            torch.save(reference, os.path.join(root, "refs", f"{checkpoint_name('deepspeed', step)}.pt"))
    torch.distributed.destroy_process_group()
    exit_rank()
