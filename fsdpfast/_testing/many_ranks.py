"""Checkpoints of hundreds of ranks, written in one process: real FSDP2 over torch's fake process group.

Spawning hundreds of gloo ranks is beyond a small machine, and a 1,024-rank checkpoint of a 405B
model is beyond its disk. Here each rank is one turn of a loop: torch's fake process group
(`torch.testing._internal.distributed.fake_pg`, whose collectives do nothing) takes the rank's
number, `fully_shard` shards a Llama-shaped model for it exactly as on a real rank, and the rank's
state dict is saved by torch itself. FSDP2 shards without communicating (it only copies the rank's
chunk of each parameter into padded storage), so the files are what that rank would have saved:
DTensors, their DeviceMesh, padded storages. What differs is the data, by choice:

* `values`: the model is built with real values from a seed and each rank saves its real shards;
  the unsharded state dict is the model before sharding (tests: tiny sizes, compared bit for bit);
* `sparse`: built on the meta device and saved under `torch.serialization.skip_data`, so a file
  holds real metadata and no data blocks (benchmarks: full Llama-3 sizes; reads as zeros).

Layouts: verl's `model_world_size_{W}_rank_{r}.pt` files, or a DCP folder whose save is driven
step by step as `torch.distributed.checkpoint.save` drives it (each rank's local plan, the
coordinator's global plan, each rank's writes, the coordinator's `.metadata`); a sparse DCP folder
is written with zeros and its zero blocks then deallocated (`fallocate --dig-holes`: the bytes read
back the same).

    python -m fsdpfast._testing.many_ranks OUT --model 8B --world-size 1024 [--layout dcp] [--ranks 0:512]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-architecture model's sizes (Hugging Face's LlamaForCausalLM names its tensors)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False

    def config(self) -> dict:
        """config.json as Hugging Face writes it for this shape."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "vocab_size": self.vocab,
            "tie_word_embeddings": self.tied,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }


# Llama 3 / 3.1 / 3.2 sizes; TINY is the tests' size (hidden 64, 2 layers, vocab 101).
LLAMA3 = {
    "1B": LlamaShape(2048, 8192, 16, 32, 8, 128256, tied=True),
    "8B": LlamaShape(4096, 14336, 32, 32, 8, 128256),
    "70B": LlamaShape(8192, 28672, 80, 64, 8, 128256),
    "405B": LlamaShape(16384, 53248, 126, 128, 8, 128256),
}
TINY = LlamaShape(64, 88, 2, 4, 2, 101)


def build(shape: LlamaShape, device: str, dtype: torch.dtype, seed: int | None = None):
    """The model as an nn.Module with LlamaForCausalLM's parameter names (no forward: only its
    state is saved). With `seed`, every parameter gets normal values from it."""
    import torch.nn as nn

    head = shape.hidden // shape.heads

    def linear(n_in: int, n_out: int) -> nn.Linear:
        return nn.Linear(n_in, n_out, bias=False, device=device, dtype=dtype)

    def norm() -> nn.Module:
        module = nn.Module()
        module.weight = nn.Parameter(torch.empty(shape.hidden, device=device, dtype=dtype))
        return module

    def layer() -> nn.Module:
        module, attn, mlp = nn.Module(), nn.Module(), nn.Module()
        attn.q_proj, attn.k_proj = linear(shape.hidden, shape.heads * head), linear(shape.hidden, shape.kv_heads * head)
        attn.v_proj, attn.o_proj = linear(shape.hidden, shape.kv_heads * head), linear(shape.heads * head, shape.hidden)
        mlp.gate_proj, mlp.up_proj = linear(shape.hidden, shape.intermediate), linear(shape.hidden, shape.intermediate)
        mlp.down_proj = linear(shape.intermediate, shape.hidden)
        module.self_attn, module.mlp, module.input_layernorm, module.post_attention_layernorm = (
            attn,
            mlp,
            norm(),
            norm(),
        )
        return module

    model, inner = nn.Module(), nn.Module()
    inner.embed_tokens = nn.Embedding(shape.vocab, shape.hidden, device=device, dtype=dtype)
    inner.layers = nn.ModuleList(layer() for _ in range(shape.layers))
    inner.norm = norm()
    model.model = inner
    model.lm_head = linear(shape.hidden, shape.vocab)
    if shape.tied:
        model.lm_head.weight = inner.embed_tokens.weight
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32).to(dtype))
    return model


class _RankGroup:
    """The fake process group of one rank: joined on enter, left on exit."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def __enter__(self):
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor
        from torch.testing._internal.distributed.fake_pg import FakeStore

        # DTensor caches sharding results by spec, and a DeviceMesh equals the same mesh seen from
        # another rank: without this the previous rank's mesh (its coordinate) would come back.
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        torch._C._clear_DTensor_sharding_propagator_cache()
        dist.init_process_group("fake", rank=self.rank, world_size=self.world, store=FakeStore())
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.destroy_process_group()


def shard(shape: LlamaShape, world: int, rank: int, data: str, dtype: torch.dtype, seed: int = 0):
    """Rank `rank`'s FSDP2 model (call inside `_RankGroup(rank, world)`): every decoder layer and
    then the root wrapped by `fully_shard`, as trainers do."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    if data == "values":
        model = build(shape, "cpu", dtype, seed)
    else:
        model = build(shape, "meta", dtype)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if data != "values":
        model.to_empty(device="cpu")  # untouched memory: only the saved metadata matters
        if data == "zeros":
            with torch.no_grad():
                for param in model.parameters():
                    param.to_local().zero_()
    coordinate = model.lm_head.weight.device_mesh.get_coordinate()
    if tuple(coordinate or ()) != (rank,):  # the caches above failed us: the files would name another rank
        raise RuntimeError(f"rank {rank}'s DTensors carry mesh coordinate {coordinate}")
    return model


def unsharded_state(shape: LlamaShape, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """The model every `values` rank shards, whole: what a merge must give back."""
    return {name: tensor.detach().clone() for name, tensor in build(shape, "cpu", dtype, seed).state_dict().items()}


def write_fsdp_ranks(
    folder: str,
    shape: LlamaShape,
    world: int,
    ranks=None,
    data: str = "sparse",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    fast_chunks: bool = True,
) -> None:
    """verl's rank files `model_world_size_{W}_rank_{r}.pt` for `ranks` (default all).

    `fast_chunks`: FSDP2 finds a rank's piece by cutting each parameter into `world` views
    (torch.chunk) and keeping one; at 1,024 ranks that dominates the writing, so the one view is
    cut directly: the same view (torch.chunk's sizes), the rest of fully_shard untouched."""
    os.makedirs(folder, exist_ok=True)
    restore = _one_chunk() if fast_chunks else None
    try:
        for rank in ranks if ranks is not None else range(world):
            with _RankGroup(rank, world):
                model = shard(shape, world, rank, data, dtype, seed)
                path = os.path.join(folder, f"model_world_size_{world}_rank_{rank}.pt")
                if data == "values":
                    torch.save(model.state_dict(), path)
                else:
                    with torch.serialization.skip_data():
                        torch.save(model.state_dict(), path)
                del model
    finally:
        if restore:
            restore()


def write_config(folder: str, shape: LlamaShape) -> None:
    """huggingface/config.json beside the rank files, as verl saves it."""
    os.makedirs(os.path.join(folder, "huggingface"), exist_ok=True)
    with open(os.path.join(folder, "huggingface", "config.json"), "w") as f:
        json.dump(shape.config(), f, indent=2)


def write_dcp(
    folder: str,
    shape: LlamaShape,
    world: int,
    data: str = "sparse",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    fast_chunks: bool = True,
) -> None:
    """A DCP folder, saved the way `torch.distributed.checkpoint.save` saves with `world` ranks:
    its four steps run here in turn for every rank (two passes over the ranks: the global plan
    needs every rank's local plan before any rank writes)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    os.makedirs(folder, exist_ok=True)
    restore = _one_chunk() if fast_chunks else None
    kind = "values" if data == "values" else "zeros"

    def set_up(rank: int, model):
        planner, writer = DefaultSavePlanner(), FileSystemWriter(folder, sync_files=False)
        planner.set_up_planner(
            state_dict=model.state_dict(), storage_meta=writer.storage_meta(), is_coordinator=rank == 0
        )
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        return planner, writer

    try:
        local_plans, coordinator = [], None
        for rank in range(world):  # each rank's local plan
            with _RankGroup(rank, world):
                model = shard(shape, world, rank, "values" if data == "values" else "sparse", dtype, seed)
                planner, writer = set_up(rank, model)
                local_plans.append(writer.prepare_local_plan(planner.create_local_plan()))
                if rank == 0:
                    coordinator = (planner, writer)
        planner0, writer0 = coordinator
        global_plans, metadata = planner0.create_global_plan(local_plans)  # the coordinator's step
        global_plans = writer0.prepare_global_plan(global_plans)
        results = []
        for rank in range(world):  # each rank writes its items
            with _RankGroup(rank, world):
                model = shard(shape, world, rank, kind, dtype, seed)
                planner, writer = set_up(rank, model)
                planner.create_local_plan()
                writes = writer.write_data(planner.finish_plan(global_plans[rank]), planner)
                writes.wait()
                results.append(writes.value())
                del model, planner, writer
            if data != "values":
                for name in os.listdir(folder):
                    if name.startswith(f"__{rank}_") and name.endswith(".distcp"):
                        subprocess.run(["fallocate", "--dig-holes", os.path.join(folder, name)], check=True)
        writer0.finish(metadata=metadata, results=results)
    finally:
        if restore:
            restore()


def _one_chunk():
    """Make FSDP2 cut only the chunk a rank keeps (see write_fsdp_ranks); returns the undo."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    original = _fsdp_param._chunk_with_empty

    class Chunks:
        """torch.chunk(tensor, parts, dim) padded with empty tensors to `parts`, each made when asked."""

        def __init__(self, tensor, parts: int, dim: int):
            self.tensor, self.parts, self.dim = tensor, parts, dim
            size = tensor.size(dim)
            self.step = -(-size // parts) if size else 0
            self.real = -(-size // self.step) if self.step else 1  # how many pieces torch.chunk returns

        def __len__(self) -> int:
            return self.parts

        def __getitem__(self, index: int):
            if index < 0:
                index += self.parts
            if not 0 <= index < self.parts:
                raise IndexError(index)
            if index >= self.real:
                return self.tensor.narrow(self.dim, 0, 0).new_empty(0)
            if self.step == 0:
                return self.tensor
            start = index * self.step
            return self.tensor.narrow(self.dim, start, min(self.step, self.tensor.size(self.dim) - start))

    _fsdp_param._chunk_with_empty = Chunks

    def restore():
        _fsdp_param._chunk_with_empty = original

    return restore


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--model", default="8B", choices=[*LLAMA3, "tiny"])
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--layout", default="fsdp-ranks", choices=["fsdp-ranks", "dcp"])
    parser.add_argument("--ranks", help="START:END, the ranks to write (fsdp-ranks; default all)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--data", default="sparse", choices=["sparse", "values"], help="see the module doc")
    parser.add_argument("--seed", type=int, default=0, help="the values' seed (--data values)")
    parser.add_argument("--config", action="store_true", help="also write huggingface/config.json")
    args = parser.parse_args(argv)
    shape = TINY if args.model == "tiny" else LLAMA3[args.model]
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    if args.layout == "dcp":
        write_dcp(args.out, shape, args.world_size, args.data, dtype, args.seed)
    else:
        start, end = map(int, args.ranks.split(":")) if args.ranks else (0, args.world_size)
        write_fsdp_ranks(args.out, shape, args.world_size, range(start, end), args.data, dtype, args.seed)
    if args.config:
        write_config(args.out, shape)


if __name__ == "__main__":
    main()
