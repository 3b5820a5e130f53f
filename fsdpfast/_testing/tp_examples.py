"""Real FSDP2 + tensor-parallel checkpoints on a dp x tp mesh, for the tests.

Each rank is a spawned gloo process. The tiny Llama of fsdpfast._testing.fsdp2_writer (with biases, so that
1-D parameters are sharded too) is split by torch's own `parallelize_module` over the "tp"
dimension of an `init_device_mesh("cpu", (dp, tp))` as torchtitan splits Llama (q/k/v and
gate/up projections ColwiseParallel, o/down projections RowwiseParallel, optionally lm_head
ColwiseParallel), then `fully_shard` shards every layer and the root over the "dp" sub-mesh.
That gives the placements FSDP2 + TP really produces: `(_StridedShard(0, split_factor=tp),
Shard(0))` for column-parallel weights and biases, `(Shard(0), Shard(1))` for row-parallel
weights, `(Shard(0), Replicate())` for row-parallel biases, and `(Shard(0),)` on the 1-D dp
sub-mesh for what TP leaves alone (embeddings, norms). With three mesh dimensions
(replicate, shard, tp) FSDP2 runs as HSDP over the first two.

One AdamW step changes every weight; then the same state is saved three ways: each rank's
`model.state_dict()` with torch.save under verl's names (`ranks/`), the guide layout's
per-rank dicts (`guide/`), and a torch.distributed.checkpoint save (`dcp/`). Rank 0 saves the
unsharded model gathered with `full_tensor()` as the reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .fsdp2_writer import CheckpointSpec, _tied_names, build_model, spawn_writers


@dataclass(frozen=True)
class TpSpec:
    name: str
    mesh: tuple[int, ...] = (2, 2)  # (dp, tp), or (replicate, shard, tp) for HSDP + TP
    model: str = "llama"  # llama | llama-tied
    dtype: str = "float32"
    tp_lm_head: bool = False  # lm_head ColwiseParallel too (vocab rows over tp)
    seed: int = 0
    sizes: dict = field(default_factory=dict)  # config overrides (tp must divide the head counts)
    dcp: bool = True  # False where torch's DCP refuses to save the layout ("overlapping chunks": uneven sizes, e.g.
    # 13 lm_head rows over a (3, 2) mesh, where its left-to-right chunk offsets miss FSDP2's pieces)

    def folder(self, root: str) -> str:
        return os.path.join(root, self.name)

    def ranks_folder(self, root: str) -> str:
        return os.path.join(root, self.name, "ranks")

    def guide_folder(self, root: str) -> str:
        return os.path.join(root, self.name, "guide")

    def dcp_folder(self, root: str) -> str:
        return os.path.join(root, self.name, "dcp")

    def reference_path(self, root: str) -> str:
        return os.path.join(root, f"{self.name}.reference.pt")


def write_tp_checkpoints(root: str, specs: list[TpSpec], world_size: int) -> None:
    """Write every spec's checkpoints with `world_size` spawned ranks (one process group for all)."""
    spawn_writers(root, specs, world_size, write_one)


def _example(spec: TpSpec) -> CheckpointSpec:
    sizes = {"attention_bias": True, "mlp_bias": True, **spec.sizes}
    return CheckpointSpec(spec.name, model=spec.model, dtype=spec.dtype, seed=spec.seed, sizes=sizes)


def parallelize(model, spec: TpSpec):
    """TP over the mesh's last dimension, then FSDP2 over the others; returns the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = ("replicate", "shard", "tp") if len(spec.mesh) == 3 else ("dp", "tp")
    mesh = init_device_mesh("cpu", spec.mesh, mesh_dim_names=names)
    plan = {}
    for i in range(len(model.model.layers)):
        prefix = f"model.layers.{i}"
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{prefix}.{proj}"] = ColwiseParallel()
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{prefix}.{proj}"] = RowwiseParallel()
    if spec.tp_lm_head:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, mesh["tp"], plan)
    dp_mesh = mesh[names[:-1]] if len(names) == 3 else mesh["dp"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return mesh


def write_one(rank: int, world_size: int, root: str, spec: TpSpec) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from .fsdp2_writer import _write_hf_files

    example = _example(spec)
    model = build_model(example)
    tied = _tied_names(model)
    parallelize(model, spec)
    optimizer = _train_one_step(model, spec.seed)
    state = model.state_dict()
    for folder in (spec.ranks_folder(root), spec.guide_folder(root)):
        os.makedirs(folder, exist_ok=True)
    torch.save(state, os.path.join(spec.ranks_folder(root), f"model_world_size_{world_size}_rank_{rank}.pt"))
    guide = {
        "state_dict": state,
        "optimizer_state": optimizer.state_dict(),
        "metadata": {"world_size": world_size, "rank": rank, "mesh": list(spec.mesh)},
    }
    torch.save(guide, os.path.join(spec.guide_folder(root), f"model_pt_rank_{rank}.pt"))
    if spec.dcp:
        dcp.save(state, checkpoint_id=spec.dcp_folder(root))
    if rank == 0:
        for folder in (spec.ranks_folder(root), spec.guide_folder(root), spec.dcp_folder(root) if spec.dcp else None):
            if folder:
                _write_hf_files(os.path.join(folder, "huggingface"), example)
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}
    if rank == 0:
        torch.save({"state_dict": full, "tied": tied}, spec.reference_path(root))


def _train_one_step(model, seed: int):
    generator = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=generator)
    # foreach=False: one optimizer over parameters on two meshes (the 2-D mesh and the dp sub-mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer
