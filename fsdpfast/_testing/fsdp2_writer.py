"""Real sharded checkpoints for the demo and the tests, written by real torch.distributed.

Each rank is a spawned process in a gloo process group; FSDP2 (`fully_shard`) shards a tiny
transformers model initialised from a seed, one AdamW step changes every weight, and each
rank saves its state dict the way a trainer does. Rank 0 also saves the unsharded result
(gathered with `full_tensor`) and the logits of the sharded model on a fixed input, so a
merge can be checked bit for bit against the model the shards came from.

Needs transformers (the `demo` / `test` extras).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from functools import partial

import torch

# The fixed input whose logits are recorded: batch 2, length 7.
PROBE_INPUT = [[3, 14, 15, 92, 65, 35, 89], [79, 32, 38, 46, 26, 43, 38]]


@dataclass(frozen=True)
class CheckpointSpec:
    name: str  # sub-folder of the root folder
    model: str = "llama"  # llama | llama-tied | bert
    dtype: str = "float32"
    # fsdp-ranks | guide-ranks | guide-ranks-local (plain to_local() pieces) | dcp | dcp-nested | dcp-safetensors
    # | dcp-hf (HuggingFaceStorageWriter, save_distributed) | dcp-hf-split (the same, two model files per rank)
    layout: str = "fsdp-ranks"
    hsdp: bool = False  # 2-D ("ddp", "fsdp") mesh with two replica groups
    # the DeviceMesh's rank tensor, nested lists for HSDP (e.g. (3, 2, 1, 0)); None: init_device_mesh's
    mesh_ranks: tuple | None = None
    shard_dim: int = 0  # FSDP2 shards 2-D weights along this dim
    wrappers: bool = False  # names carry module. / _checkpoint_wrapped_module. / _orig_mod.
    fsdp: bool = True  # False: plain model.state_dict() (a world of one; DDP when there are more ranks)
    full_state: bool = False  # FSDP2, but every rank saves the full state dict (get_model_state_dict, full_state_dict)
    buffer: bool = False  # a persistent buffer every rank holds whole
    architecture: bool = False  # huggingface/config.json names the model class (so fsdpfast can build it)
    verl_files: bool = False  # fsdp-ranks: also each rank's optim_ and extra_state_ files, as verl's checkpoint manager
    second_save: bool = False  # after everything, one more training step saved into `{name}-step2`
    seed: int = 0
    sizes: dict = field(default_factory=dict)  # config overrides

    def folder(self, root: str) -> str:
        return os.path.join(root, self.name)

    def second_folder(self, root: str) -> str:
        return os.path.join(root, f"{self.name}-step2")

    def reference_path(self, root: str) -> str:
        return os.path.join(root, f"{self.name}.reference.pt")

    def logits_path(self, root: str) -> str:
        return os.path.join(root, f"{self.name}.logits.pt")


def model_config(spec: CheckpointSpec):
    import transformers

    if spec.model.startswith("llama"):
        base = dict(
            hidden_size=64,
            intermediate_size=88,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=101,
            max_position_embeddings=64,
            tie_word_embeddings=spec.model == "llama-tied",
        )
        # `architectures` as a model's save_pretrained records it; a model with an extra probe buffer
        # keeps a bare config's None, so the check covers the base model and leaves the buffer alone
        return transformers.LlamaConfig(**{**base, **spec.sizes}, architectures=_named(spec, "LlamaForCausalLM"))
    if spec.model == "bert":
        base = dict(
            hidden_size=48,
            intermediate_size=72,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=103,
            max_position_embeddings=40,
        )
        return transformers.BertConfig(**{**base, **spec.sizes}, architectures=_named(spec, "BertForMaskedLM"))
    raise ValueError(f"unknown example model {spec.model!r}")


def _named(spec: CheckpointSpec, cls: str) -> list[str] | None:
    return None if spec.buffer else [cls]


def build_model(spec: CheckpointSpec):
    import transformers

    config = model_config(spec)
    torch.manual_seed(spec.seed)
    cls = transformers.BertForMaskedLM if spec.model == "bert" else transformers.LlamaForCausalLM
    model = cls(config).to(getattr(torch, spec.dtype))
    if spec.buffer:
        model.register_buffer("fsdpfast_probe_buffer", torch.arange(12, dtype=torch.float32).reshape(3, 4) + spec.seed)
    return model


def write_checkpoints(root: str, specs: list[CheckpointSpec], world_size: int) -> None:
    """Write every spec's checkpoint with `world_size` spawned ranks (one process group for all)."""
    spawn_writers(root, specs, world_size, _write_one)


def spawn_writers(root: str, specs: list, world_size: int, write_one, backend: str = "gloo") -> None:
    """Run `write_one(rank, world_size, root, spec)` for each spec on `world_size` spawned ranks of one
    process group (serve_rank: a barrier after each spec). `write_one` must be a module-level function."""
    import torch.multiprocessing as mp

    os.makedirs(root, exist_ok=True)
    mp.spawn(
        _writer_rank, args=(world_size, _free_port(), root, specs, write_one, backend), nprocs=world_size, join=True
    )


def _writer_rank(rank: int, world_size: int, port: int, root: str, specs: list, write_one, backend: str) -> None:
    serve_rank(rank, world_size, port, backend, [partial(write_one, rank, world_size, root, spec) for spec in specs])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_rank() -> None:
    """End a spawned rank whose work is done (process group already destroyed) at once. Interpreter
    shutdown after gloo has run sometimes aborts ("terminate called without an active exception",
    a thread still joinable when destroyed), which would fail a run whose files are all written."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve_rank(rank: int, world_size: int, port: int, backend: str, jobs) -> None:
    """A spawned rank's life: join the process group, run each job with a barrier after it, tear
    the group down and exit."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        for job in jobs:
            job()
            dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_rank()


def _write_one(rank: int, world_size: int, root: str, spec: CheckpointSpec) -> None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    folder = spec.folder(root)
    os.makedirs(folder, exist_ok=True)
    model = build_model(spec)
    architecture = type(model).__name__  # fully_shard swaps the class for an FSDP subclass
    trained = model
    runner = model  # what the training step calls
    if spec.wrappers:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        layers = _layers(model)
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    if spec.fsdp:
        names = ("ddp", "fsdp") if spec.hsdp else None
        if spec.mesh_ranks is not None:  # a DeviceMesh over the ranks in the order given
            mesh = DeviceMesh("cpu", torch.tensor(spec.mesh_ranks), mesh_dim_names=names)
        elif spec.hsdp:
            mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=names)
        else:
            mesh = init_device_mesh("cpu", (world_size,))
        placement = (lambda p: Shard(spec.shard_dim) if p.ndim == 2 else None) if spec.shard_dim else None
        for layer in _layers(model):
            fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
        fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    elif world_size > 1:  # DDP: every rank trains and saves the whole model (names under `module.`)
        from torch.nn.parallel import DistributedDataParallel

        runner = DistributedDataParallel(model)
    _train_one_step(model, spec, runner)
    logits = _probe_logits(model, spec)
    state_owner = runner
    if spec.wrappers:  # an outer DDP-style `module.` and a torch.compile `_orig_mod.` on top
        state_owner = torch.compile(_Outer(model))
    state = _state_to_save(state_owner, spec)
    _save_rank(folder, rank, world_size, spec, state, trained)
    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }
    if rank == 0:
        torch.save({"state_dict": full, "tied": _tied_names(model)}, spec.reference_path(root))
        torch.save(logits, spec.logits_path(root))
        _write_hf_files(os.path.join(folder, "huggingface"), spec)
        if spec.architecture:
            name_architecture(os.path.join(folder, "huggingface", "config.json"), architecture)
    if spec.second_save:  # the next step's files, for tests of folders that mix two saves
        _train_one_step(model, spec, runner)
        os.makedirs(spec.second_folder(root), exist_ok=True)
        _save_rank(spec.second_folder(root), rank, world_size, spec, _state_to_save(state_owner, spec), trained)


def _state_to_save(owner, spec: CheckpointSpec) -> dict:
    if spec.full_state:  # every rank gathers and saves the whole model
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(owner, options=StateDictOptions(full_state_dict=True))
    return owner.state_dict()


def _tied_names(model) -> list[str]:
    """Parameter names that repeat an earlier name's parameter (tied weights)."""
    seen, tied = set(), []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.append(name)
        seen.add(id(param))
    return tied


class _Outer(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module


def _layers(model):
    return model.bert.encoder.layer if hasattr(model, "bert") else model.model.layers


def _train_one_step(model, spec: CheckpointSpec, runner=None) -> None:
    """One AdamW step (a second call continues the same optimizer, and scheduler if any); `runner`
    is what is called (a DDP wrapper), `model` the module itself."""
    step = getattr(model, "_fsdpfast_steps", 0)
    generator = torch.Generator().manual_seed(1000 + spec.seed + 100 * step)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 9), generator=generator)
    if step == 0:  # kept for the layouts that save optimizer (and scheduler) state
        model._fsdpfast_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model._fsdpfast_scheduler = (
            torch.optim.lr_scheduler.LambdaLR(model._fsdpfast_optimizer, _warmup) if spec.verl_files else None
        )
    optimizer = model._fsdpfast_optimizer
    loss = (runner or model)(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    if model._fsdpfast_scheduler is not None:
        model._fsdpfast_scheduler.step()
    optimizer.zero_grad()
    model._fsdpfast_steps = step + 1


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


@torch.no_grad()
def _probe_logits(model, spec: CheckpointSpec) -> torch.Tensor:
    model.eval()  # no dropout: the logits must be a function of the weights alone
    ids = torch.tensor(PROBE_INPUT)
    return model(input_ids=ids).logits.detach().clone()


def _save_rank(folder: str, rank: int, world_size: int, spec: CheckpointSpec, state: dict, model) -> None:
    from torch.distributed.tensor import DTensor

    if spec.layout == "fsdp-ranks":
        torch.save(state, os.path.join(folder, f"model_world_size_{world_size}_rank_{rank}.pt"))
        if spec.verl_files:  # what verl's FSDP checkpoint manager saves beside the model
            _save_verl_extras(folder, rank, world_size, model)
        return
    if spec.layout.startswith("dcp"):  # torch.distributed.checkpoint: a collective save into one folder
        import torch.distributed.checkpoint as dcp

        if spec.layout == "dcp-nested":  # as trainers save it: model and optimizer together
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optim_state = get_state_dict(model, model._fsdpfast_optimizer)
            state = {"model": model_state, "optim": optim_state}
        writer = None
        if spec.layout == "dcp-safetensors":  # the other serialisation a .distcp can hold
            from torch.distributed.checkpoint.filesystem import SerializationFormat

            writer = dcp.FileSystemWriter(folder, serialization_format=SerializationFormat.SAFETENSORS)
        if spec.layout.startswith("dcp-hf"):  # every rank writes its chunks as safetensors, offsets in the header
            from torch.distributed.checkpoint import HuggingFaceStorageWriter

            split = None  # dcp-hf-split: layers in model file 2, everything else in file 1
            if spec.layout == "dcp-hf-split":
                split = {k: 2 if ".layers." in k or ".layer." in k else 1 for k in state}
            writer = HuggingFaceStorageWriter(folder, fqn_to_index_mapping=split, save_distributed=True)
            for name in _tied_names(model):  # safetensors refuses two names over one storage: a copy each
                state[name] = state[name].detach().clone()
        dcp.save(state, checkpoint_id=folder, storage_writer=writer)
        return
    if spec.layout == "guide-ranks-local":
        state = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in state.items()}
    payload = {
        "state_dict": state,
        "optimizer_state": model._fsdpfast_optimizer.state_dict(),
        "metadata": {"world_size": world_size, "rank": rank, "step": model._fsdpfast_steps, "model": spec.model},
    }
    torch.save(payload, os.path.join(folder, f"model_pt_rank_{rank}.pt"))


def _save_verl_extras(folder: str, rank: int, world_size: int, model) -> None:
    import random

    import numpy

    torch.save(
        model._fsdpfast_optimizer.state_dict(), os.path.join(folder, f"optim_world_size_{world_size}_rank_{rank}.pt")
    )
    extra = {
        "lr_scheduler": model._fsdpfast_scheduler.state_dict(),
        "rng": {"cpu": torch.get_rng_state(), "numpy": numpy.random.get_state(), "random": random.getstate()},
    }
    torch.save(extra, os.path.join(folder, f"extra_state_world_size_{world_size}_rank_{rank}.pt"))


def _write_hf_files(folder: str, spec: CheckpointSpec) -> None:
    import json

    config = model_config(spec)
    config.dtype = getattr(torch, spec.dtype)
    config.save_pretrained(folder)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 64}, f)
    with open(os.path.join(folder, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>"}, f)


def name_architecture(path: str, cls: str) -> None:
    """config.json names the model class, as a model's save_pretrained writes it."""
    import json

    with open(path) as f:
        config = json.load(f)
    config["architectures"] = [cls]
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
