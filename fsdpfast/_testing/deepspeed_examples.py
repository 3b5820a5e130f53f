"""Real DeepSpeed ZeRO checkpoints for the tests, written by DeepSpeed itself on the CPU.

Each rank is a spawned process; `deepspeed.init_distributed` joins a gloo group, the same tiny
transformers model as the FSDP2 examples is wrapped by `deepspeed.initialize` (ZeRO stage 1, 2
or 3, bf16 or fp32, AdamW through torch so nothing is compiled), trains one step and is saved
with `engine.save_checkpoint` (plus config.json beside it, as a Hugging Face Trainer does). Rank 0
then writes:

- `<name>.reference.pt`: what the checkpoint must merge to, gathered from the live engine
  (fp32 master weights of every trained parameter with deepspeed.utils.safe_get_full_fp32_param,
  frozen parameters and persistent buffers as the module holds them), plus the tied names;
- `<name>.oracle.pt`: DeepSpeed's own `zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`
  on the saved folder, or the error it raised, whether its safetensors export worked, and (with
  frozen parameters) its output with `exclude_frozen_parameters=True`.

Needs deepspeed (installed with DS_BUILD_OPS=0; the CPU accelerator JIT-builds one small
shared-memory op on first use) and transformers.
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass

import torch

from .fsdp2_writer import CheckpointSpec, _free_port, build_model, exit_rank, model_config

# Parameters frozen (requires_grad False) when a spec asks for frozen parameters: one 2-D
# weight and one norm, so both land outside the optimizer's flat groups.
FROZEN = ("model.layers.0.mlp.up_proj.weight", "model.layers.1.input_layernorm.weight")


@dataclass(frozen=True)
class DeepSpeedSpec:
    name: str
    stage: int  # ZeRO stage 1, 2 or 3
    dtype: str = "float32"  # float32 | bfloat16 (the engine's training precision)
    tied: bool = False  # tie_word_embeddings: lm_head.weight is embed_tokens.weight
    frozen: bool = False  # FROZEN parameters take no optimizer step
    buffer: bool = False  # a persistent buffer in the module's state dict
    extra_tag: str | None = None  # also save a second checkpoint under this tag after another step
    seed: int = 0

    def root(self, base: str) -> str:
        return os.path.join(base, self.name)

    def reference_path(self, base: str, tag: str | None = None) -> str:
        return os.path.join(base, f"{self.name}{'.' + tag if tag else ''}.reference.pt")

    def oracle_path(self, base: str) -> str:
        return os.path.join(base, f"{self.name}.oracle.pt")


def write_deepspeed_checkpoints(base: str, specs: list[DeepSpeedSpec], world_size: int) -> None:
    os.makedirs(base, exist_ok=True)
    spawn_deepspeed_ranks(_rank_main, world_size, base, specs)


def spawn_deepspeed_ranks(rank_main, world_size: int, *args) -> None:
    """`rank_main(rank, world_size, port, *args)` in `world_size` processes; each calls `join_deepspeed`.

    DeepSpeed's CPU backend gives each rank a 66 MB shared-memory buffer for its allreduce, named by
    the port, and never removes it: left in /dev/shm, a suite's runs would fill the machine's memory."""
    import glob

    import torch.multiprocessing as mp

    port = _free_port()
    try:
        mp.spawn(rank_main, args=(world_size, port, *args), nprocs=world_size, join=True)
    finally:
        for buffer in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"):
            os.remove(buffer)


def join_deepspeed(rank: int, world_size: int, port: int) -> None:
    """This process joins the DeepSpeed job as rank `rank`, on the CPU (gloo), as its launcher would set it up."""
    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel("ERROR")
    deepspeed.init_distributed(dist_backend="gloo")


def _rank_main(rank: int, world_size: int, port: int, base: str, specs: list[DeepSpeedSpec]) -> None:
    join_deepspeed(rank, world_size, port)
    import deepspeed.comm as dist

    for spec in specs:
        _write_one(rank, base, spec)
        dist.barrier()
        if rank == 0:
            _write_oracle(base, spec)
        dist.barrier()
    torch.distributed.destroy_process_group()
    exit_rank()


def _ds_config(spec: DeepSpeedSpec) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": spec.stage},
        "bf16": {"enabled": spec.dtype == "bfloat16"},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def _write_one(rank: int, base: str, spec: DeepSpeedSpec) -> None:
    import deepspeed

    example = CheckpointSpec(
        spec.name, model="llama-tied" if spec.tied else "llama", buffer=spec.buffer, seed=spec.seed
    )
    model = build_model(example)
    if spec.frozen:
        for name, param in model.named_parameters():
            if name in FROZEN:
                param.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=_ds_config(spec))
    _train_step(engine, spec, step=0)
    if spec.extra_tag:  # an older checkpoint under another tag; `latest` names the last one saved
        engine.save_checkpoint(spec.root(base), tag=spec.extra_tag)
        reference = _gather_reference(engine)
        if rank == 0:
            torch.save(reference, spec.reference_path(base, spec.extra_tag))
        _train_step(engine, spec, step=1)
    engine.save_checkpoint(spec.root(base))
    reference = _gather_reference(engine)
    if rank == 0:
        torch.save(reference, spec.reference_path(base))
        model_config(example).save_pretrained(spec.root(base))  # as a Hugging Face Trainer's checkpoint-N/ holds it


def _train_step(engine, spec: DeepSpeedSpec, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 + 10 * spec.seed + step)
    ids = torch.randint(0, engine.module.config.vocab_size, (2, 9), generator=generator)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()


def _gather_reference(engine) -> dict:
    """Every rank takes part (stage 3 gathers collectively); rank 0's result is saved."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    state, seen, tied = {}, {}, []
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.append(name)
            continue
        seen[id(param)] = name
        if param.requires_grad:
            state[name] = safe_get_full_fp32_param(param).detach().cpu().clone()
        else:  # copied while gathered: stage 3 frees the full tensor on leaving the context
            with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
                state[name] = param.data.detach().cpu().clone()
    params = set(seen.values()) | set(tied)
    for name, value in module.state_dict().items():
        if name not in params:  # persistent buffers
            state[name] = value.detach().cpu().clone()
    return {"state_dict": state, "tied": tied}


def _write_oracle(base: str, spec: DeepSpeedSpec) -> None:
    """DeepSpeed's own converter on the folder just written, or why it failed."""
    import tempfile

    from deepspeed.utils import zero_to_fp32

    result = {"state_dict": None, "error": None, "safetensors_error": None, "excluding_frozen": None}
    quiet = contextlib.redirect_stdout(io.StringIO())
    try:
        with quiet:
            result["state_dict"] = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(spec.root(base))
            if spec.frozen:  # zero_to_fp32 --exclude_frozen_parameters
                result["excluding_frozen"] = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                    spec.root(base), exclude_frozen_parameters=True
                )
    except Exception as exc:  # recorded: the tests show where fsdpfast does better
        result["error"] = f"{type(exc).__name__}: {exc}"
    with tempfile.TemporaryDirectory() as out:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(spec.root(base), out, safe_serialization=True)
        except Exception as exc:
            result["safetensors_error"] = f"{type(exc).__name__}: {exc}"
    torch.save(result, spec.oracle_path(base))


def finish_fixture(folder: str) -> None:
    """A stored DeepSpeed fixture's last touches (rank 0, after save_checkpoint into `folder`/checkpoint):
    DeepSpeed's zero_to_fp32 scripts removed (not fixtures), and `versions.json` saying what wrote it."""
    import json

    import deepspeed
    import transformers

    for stale in ("zero_to_fp32.py", "zero_to_torch.py"):
        path = os.path.join(folder, "checkpoint", stale)
        if os.path.exists(path):
            os.remove(path)
    versions = {
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    with open(os.path.join(folder, "versions.json"), "w") as f:
        json.dump(versions, f)
