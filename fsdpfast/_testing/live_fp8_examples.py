"""Live models saved by `fsdpfast.save_pretrained(dtype="fp8")` on spawned gloo ranks, for the tests.

Each rank builds the same seeded model (a Llama with weights of several 128x128 blocks, partial ones
at the edges, or a family model of fsdpfast._testing.family_writer), rank 0 saves the unsharded
model the usual way (`anchor/`, its own save_pretrained, in float32: the reference quantized by
transformers' Fp8Quantize in the tests), the ranks shard it (FSDP2 fully_shard on dim 0 or 1, or
FSDP1 with device_id=cpu), FSDP2 ranks save their rank files (`ckpt/`, for the offline --dtype fp8
merge), and every rank calls save_pretrained(dtype="fp8") (`live/`). No training step: the anchor
is the model the ranks hold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .family_writer import FamilySpec, _blocks, build_family_model
from .fsdp2_writer import CheckpointSpec, build_model, spawn_writers


@dataclass(frozen=True)
class LiveFp8Spec:
    name: str
    wrap: str = "fsdp2"  # "fsdp2", "fsdp2-dim1" (Shard(1) of 2-D parameters) or "fsdp1"
    family: FamilySpec | None = None  # None: a Llama of `sizes`
    sizes: dict = field(default_factory=dict)
    fp8_skip: str | None = None
    expert_layout: str = "hub"  # "packed": the anchor is the model's own state dict (transformers' packed experts)
    seed: int = 0

    def folder(self, root: str) -> str:
        return os.path.join(root, self.name)


def save_live_fp8(root: str, specs: list[LiveFp8Spec], world_size: int) -> None:
    spawn_writers(root, specs, world_size, _save_one)


def _model(spec: LiveFp8Spec):
    if spec.family is not None:
        return build_family_model(spec.family)
    return build_model(CheckpointSpec(spec.name, sizes=spec.sizes, seed=spec.seed, architecture=True))


def _save_one(rank: int, world_size: int, root: str, spec: LiveFp8Spec) -> None:
    import fsdpfast

    folder = spec.folder(root)
    model = _model(spec)
    if rank == 0 and spec.expert_layout == "packed":
        from safetensors.torch import save_file

        os.makedirs(os.path.join(folder, "anchor"), exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in model.state_dict().items()},
            os.path.join(folder, "anchor", "model.safetensors"),
        )
    elif rank == 0:
        model.save_pretrained(os.path.join(folder, "anchor"))
    if rank == 0:
        model.config.save_pretrained(os.path.join(folder, "ckpt", "huggingface"))
    if spec.wrap == "fsdp1":
        model = _fsdp1(model)
    else:
        _fsdp2(model, world_size, 1 if spec.wrap == "fsdp2-dim1" else 0)
        os.makedirs(os.path.join(folder, "ckpt"), exist_ok=True)
        torch.save(model.state_dict(), os.path.join(folder, "ckpt", f"model_world_size_{world_size}_rank_{rank}.pt"))
    fsdpfast.save_pretrained(
        model, os.path.join(folder, "live"), dtype="fp8", fp8_skip=spec.fp8_skip, expert_layout=spec.expert_layout
    )


def _fsdp2(model, world_size: int, dim: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world_size,))
    placement = (lambda p: Shard(dim) if p.ndim == 2 else None) if dim else None
    for block in _blocks(model):
        fully_shard(block, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)


def _fsdp1(model):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    layers = {type(block) for block in _blocks(model)}
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy(layers), use_orig_params=True, device_id=torch.device("cpu"))
