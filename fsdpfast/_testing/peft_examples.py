"""Real PEFT LoRA checkpoints for the tests, written the way verl writes a LoRA actor.

Each rank is a spawned gloo process: a tiny transformers model (fsdpfast._testing.fsdp2_writer) becomes a
peft model (`get_peft_model`, `init_lora_weights=False` so lora_B starts non-zero), FSDP2
shards every decoder layer and the root (`fully_shard`), one AdamW step trains the adapter,
and each rank saves `model.state_dict()` as verl's FSDPCheckpointManager does
(`model_world_size_{W}_rank_{r}.pt`; with `lora_only`, only the LoRA tensors, as
`save_lora_only` keeps them), or the same state dict in another layout (a DCP folder, a
HuggingFaceStorageWriter folder, the guide's per-rank dicts; or DeepSpeed ZeRO trains and
saves it, write_peft_deepspeed_checkpoints). Rank 0
writes verl's `lora_train_meta.json` and `huggingface/` (config.json), and the references
taken from the live model: the sharded peft model's logits for each adapter, the full state
dict (`full_tensor`), and from an unsharded copy of it (the same weights loaded into a fresh
peft model): peft's own adapter state dicts (`get_peft_model_state_dict`) and `merge_and_unload()` for
the adapters merged, bit for bit what peft computes; and the base model as it was built
before peft wrapped it (LoRA training never changes it). A LoRA-only spec also gets the base model saved with `save_pretrained`, the
`--base` folder a user would give.

Needs transformers and peft (the `test` extra).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field

import torch

from .fsdp2_writer import PROBE_INPUT, CheckpointSpec, _write_hf_files, build_model, spawn_writers


@dataclass(frozen=True)
class PeftSpec:
    name: str
    # fsdp-ranks (verl) | guide-ranks | dcp | dcp-hf | deepspeed-zero2 | fsdp1-orig, fsdp1-peft-policy (their own writers)
    layout: str = "fsdp-ranks"
    model: str = "llama"  # llama | llama-tied (fsdpfast._testing.fsdp2_writer)
    dtype: str = "float32"  # the model's dtype; adapters keep it (autocast_adapter_dtype=False)
    r: int = 8
    lora_alpha: int = 16
    targets: tuple[str, ...] = ("q_proj", "v_proj", "gate_proj", "down_proj")
    extras: dict = field(default_factory=dict)  # more LoraConfig fields (use_rslora, lora_bias, modules_to_save)
    second: dict | None = None  # a second adapter "second" (add_adapter) with these LoraConfig fields
    merged: tuple[str, ...] = ("default",)  # the adapters merge_and_unload merges for the reference
    lora_only: bool = False  # verl's save_lora_only: the rank files hold only the LoRA tensors
    meta: bool = True  # lora_train_meta.json (verl); False: peft's adapter_config.json files instead
    seed: int = 0
    sizes: dict = field(default_factory=dict)  # model config overrides (attention_bias=True for lora_bias)

    def folder(self, root: str) -> str:
        return os.path.join(root, self.name)

    def reference_path(self, root: str) -> str:
        return os.path.join(root, f"{self.name}.reference.pt")

    def base_folder(self, root: str) -> str:
        return os.path.join(root, f"{self.name}.base")


def write_peft_checkpoints(root: str, specs: list[PeftSpec], world_size: int) -> None:
    spawn_writers(root, specs, world_size, write_one)


def lora_config(spec: PeftSpec, **fields):
    import peft

    base = dict(
        r=spec.r,
        lora_alpha=spec.lora_alpha,
        target_modules=list(spec.targets),
        task_type="CAUSAL_LM",
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    return peft.LoraConfig(**{**base, **spec.extras, **fields})


def build_peft_model(spec: PeftSpec):
    import peft

    example = CheckpointSpec(spec.name, model=spec.model, dtype=spec.dtype, seed=spec.seed, sizes=spec.sizes)
    model = build_model(example)
    torch.manual_seed(100 + spec.seed)  # the adapters' random init
    peft_model = peft.get_peft_model(model, lora_config(spec), autocast_adapter_dtype=False)
    if spec.second is not None:
        peft_model.add_adapter("second", lora_config(spec, **spec.second))
    return peft_model, example


def write_one(rank: int, world_size: int, root: str, spec: PeftSpec) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    folder = spec.folder(root)
    os.makedirs(folder, exist_ok=True)
    model, example = build_peft_model(spec)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train_adapters(model, spec)
    logits = _logits_per_adapter(model, spec)
    state = model.state_dict()
    if spec.lora_only:  # save_lora_only: the adapter's tensors alone
        state = {k: v for k, v in state.items() if "lora_" in k}
    if spec.layout.startswith("dcp"):
        import torch.distributed.checkpoint as dcp

        writer = None
        if spec.layout == "dcp-hf":  # every rank writes its chunks as safetensors
            writer = dcp.HuggingFaceStorageWriter(folder, save_distributed=True)
        dcp.save(state, checkpoint_id=folder, storage_writer=writer)
    elif spec.layout == "guide-ranks":
        payload = {"state_dict": state, "metadata": {"world_size": world_size, "rank": rank}}
        torch.save(payload, os.path.join(folder, f"model_pt_rank_{rank}.pt"))
    else:
        torch.save(state, os.path.join(folder, f"model_world_size_{world_size}_rank_{rank}.pt"))
    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }
    if rank == 0:
        _write_references(root, spec, full, logits)
        _write_verl_files(folder, spec, world_size, model)


def write_peft_deepspeed_checkpoints(root: str, specs: list[PeftSpec], world_size: int) -> None:
    """The same peft models trained and saved by DeepSpeed ZeRO (`layout` "deepspeed-zero2"), gloo on the CPU."""
    from .deepspeed_examples import spawn_deepspeed_ranks

    os.makedirs(root, exist_ok=True)
    spawn_deepspeed_ranks(_deepspeed_rank_main, world_size, root, specs)


def _deepspeed_rank_main(rank: int, world_size: int, port: int, root: str, specs: list[PeftSpec]) -> None:
    import contextlib
    import io

    from .deepspeed_examples import join_deepspeed
    from .fsdp2_writer import exit_rank

    join_deepspeed(rank, world_size, port)
    import deepspeed

    for spec in specs:
        model, _ = build_peft_model(spec)
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 1_000_000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": int(spec.layout[-1])},
        }
        with contextlib.redirect_stdout(io.StringIO()):
            engine, *_ = deepspeed.initialize(
                model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config
            )
        generator = torch.Generator().manual_seed(1000 + spec.seed)
        ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=generator)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        engine.save_checkpoint(spec.folder(root))
        logits = _logits_per_adapter(model, spec)
        full = {
            k: v.detach().clone() for k, v in model.state_dict().items()
        }  # ZeRO 1/2: every rank holds the module whole
        if rank == 0:
            _write_references(root, spec, full, logits)
            _write_verl_files(spec.folder(root), spec, world_size, model)
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    exit_rank()


def _train_adapters(model, spec: PeftSpec) -> None:
    """One AdamW step per adapter on its own trainable parameters (peft trains the active adapter)."""
    generator = torch.Generator().manual_seed(1000 + spec.seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=generator)
    for adapter in ["default"] + (["second"] if spec.second is not None else []):
        model.base_model.set_adapter(adapter)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.base_model.set_adapter("default")


@torch.no_grad()
def _logits_per_adapter(model, spec: PeftSpec) -> dict[str, torch.Tensor]:
    model.eval()
    found = {}
    for adapter in ["default"] + (["second"] if spec.second is not None else []):
        model.base_model.set_adapter(adapter)
        found[adapter] = model(input_ids=torch.tensor(PROBE_INPUT)).logits.detach().clone()
    model.base_model.set_adapter("default")
    return found


def _write_references(root: str, spec: PeftSpec, full: dict, logits: dict) -> None:
    import peft

    model, example = build_peft_model(spec)  # unsharded, then given the trained weights
    plain = build_model(example)  # as it was before peft wrapped it: LoRA training never changes it
    frozen = {k: v.clone() for k, v in plain.state_dict().items()}
    model.load_state_dict(full, strict=True)
    adapters = {
        name: {
            k: v.clone()
            for k, v in peft.get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False).items()
        }
        for name in logits
    }
    merged = {
        k: v.clone()
        for k, v in copy.deepcopy(model).merge_and_unload(adapter_names=list(spec.merged)).state_dict().items()
    }
    configs = {name: config.to_dict() for name, config in model.peft_config.items()}
    torch.save(
        {
            "full": full,
            "logits": logits,
            "adapters": adapters,
            "base": frozen,
            "merged": merged,
            "configs": json.loads(json.dumps(configs, default=_jsonable)),
        },
        spec.reference_path(root),
    )
    if spec.lora_only:  # the base model folder a user gives as --base
        plain.config.architectures = [type(plain).__name__]
        plain.save_pretrained(spec.base_folder(root))


def _write_verl_files(folder: str, spec: PeftSpec, world_size: int, model) -> None:
    hf = os.path.join(folder, "huggingface")
    _write_hf_files(hf, CheckpointSpec(spec.name, model=spec.model, dtype=spec.dtype, seed=spec.seed, sizes=spec.sizes))
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = [type(model.base_model.model).__name__]
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if spec.layout == "fsdp-ranks":
        with open(os.path.join(folder, "fsdp_config.json"), "w") as f:
            json.dump({"FSDP_version": 2, "world_size": world_size}, f)
    if spec.meta:  # verl's lora_train_meta.json
        with open(os.path.join(folder, "lora_train_meta.json"), "w") as f:
            json.dump({"r": spec.r, "lora_alpha": spec.lora_alpha, "task_type": "CAUSAL_LM"}, f)
    else:  # peft's own adapter configs, laid out as save_pretrained lays them out
        for name, config in model.peft_config.items():
            where = os.path.join(folder, "lora_adapter", *([] if name == "default" else [name]))
            os.makedirs(where, exist_ok=True)
            config.save_pretrained(where)


def _jsonable(value):
    if isinstance(value, set):
        return sorted(value)
    return str(getattr(value, "value", value))
