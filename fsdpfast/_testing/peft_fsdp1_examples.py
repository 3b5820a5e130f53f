"""PEFT LoRA models in FSDP1 LOCAL_STATE_DICT flat parameters, written by real peft and real FSDP1 on gloo ranks.

The peft model of peft_examples (a tiny Llama, `init_lora_weights=False` so lora_B starts
non-zero) is wrapped by FSDP1 on the CPU (`device_id=torch.device("cpu")`) in one of the two
ways peft training can be: layout "fsdp1-orig", the decoder layers as units with
use_orig_params=True (frozen base weights and trainable adapters share a flat parameter,
which only use_orig_params allows); layout "fsdp1-peft-policy", peft's own
`fsdp_auto_wrap_policy` (each trainable LoRA leaf a unit of its own, as the HF Trainer wraps
peft models) with use_orig_params=False. One AdamW step trains the adapter; each rank saves
its `StateDictType.LOCAL_STATE_DICT` under accelerate's name (pytorch_model_fsdp_rank{r}.bin).
Rank 0 writes verl's lora_train_meta.json (or peft's adapter_config.json), huggingface/ and
the references of peft_examples, taken from FSDP1's own FULL_STATE_DICT of the live model and
the live model's logits.
"""

from __future__ import annotations

import os

import torch

from .fsdp1_examples import FILE_NAME, wrap_classes
from .fsdp2_writer import PROBE_INPUT, spawn_writers
from .peft_examples import PeftSpec, _write_references, _write_verl_files, build_peft_model

LAYOUTS = ("fsdp1-orig", "fsdp1-peft-policy")


def write_peft_fsdp1_checkpoints(root: str, specs: list[PeftSpec], world_size: int) -> None:
    """Every spec (`layout` one of LAYOUTS, one adapter) written by `world_size` spawned ranks."""
    for spec in specs:
        if spec.layout not in LAYOUTS or spec.second is not None:
            raise ValueError(f"{spec.name}: the FSDP1 writer takes one adapter and a layout of {LAYOUTS}")
    spawn_writers(root, specs, world_size, write_one)


def write_one(rank: int, world_size: int, root: str, spec: PeftSpec) -> None:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    folder = spec.folder(root)
    os.makedirs(folder, exist_ok=True)
    model, _ = build_peft_model(spec)
    if spec.layout == "fsdp1-peft-policy":
        from peft.utils.other import fsdp_auto_wrap_policy

        policy, use_orig_params = fsdp_auto_wrap_policy(model), False
    else:
        policy, use_orig_params = ModuleWrapPolicy(wrap_classes(model.get_base_model(), ())), True
    fsdp = FSDP(model, auto_wrap_policy=policy, use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    _train_one_step(fsdp, spec)
    fsdp.eval()
    with torch.no_grad():
        logits = fsdp(input_ids=torch.tensor(PROBE_INPUT)).logits.detach().clone()
    with FSDP.state_dict_type(fsdp, StateDictType.LOCAL_STATE_DICT):
        torch.save(fsdp.state_dict(), os.path.join(folder, FILE_NAME.format(rank=rank)))
    full_config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)  # on the CPU offloading would free it
    with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, full_config):
        full = {k: v.detach().cpu().clone() for k, v in fsdp.state_dict().items()}
    if rank == 0:
        _write_references(root, spec, full, {"default": logits})
        _write_verl_files(folder, spec, world_size, model)


def _train_one_step(fsdp, spec: PeftSpec) -> None:
    """One AdamW step on the trainable (LoRA) parameters: every adapter tensor changes, no base weight does."""
    generator = torch.Generator().manual_seed(1000 + spec.seed)
    ids = torch.randint(0, fsdp.config.vocab_size, (2, 9), generator=generator)
    optimizer = torch.optim.AdamW([p for p in fsdp.parameters() if p.requires_grad], lr=1e-2)
    fsdp(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
