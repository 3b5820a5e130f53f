"""Write a large, real FSDP2 checkpoint to benchmark merges on: a Llama-like model in fp32.

`world_size` ranks are started (spawned, or forked with --start-method fork) into a gloo
process group; each builds the model on the meta device, shards it with `fully_shard` (every
decoder layer, then the root), allocates only its own shards with `to_empty`, fills them from
a per-rank seed and saves its state dict as
`model_world_size_{W}_rank_{r}.pt`, as a trainer does. No rank ever holds the whole model,
so memory stays at about one shard per rank. Rank 0 also writes `huggingface/config.json`.

The default sizes (hidden 2048, 16 layers, MLP 5632, vocab 32000) make about 3.8 GB.

    python benchmarks/make_checkpoint.py OUT_DIR [--hidden 2048 --layers 16 --world-size 4]
"""

from __future__ import annotations

import argparse
import glob
import importlib
import os
import socket
import time

import torch

from fsdpfast._testing.fsdp2_writer import exit_rank


def llama_config(hidden: int = 2048, layers: int = 16, intermediate: int = 5632, vocab: int = 32000, heads: int = 16):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        vocab_size=vocab,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def rank_files(out_dir: str, world_size: int) -> list[str]:
    """The rank files, in rank order (rank 10 after rank 9)."""
    files = glob.glob(os.path.join(out_dir, f"model_world_size_{world_size}_rank_*.pt"))
    return sorted(files, key=lambda f: int(f.rsplit("_", 1)[1].removesuffix(".pt")))


def hf_shard_files(out_dir: str) -> list[str]:
    """The safetensors files HuggingFaceStorageWriter(save_distributed=True) wrote, one per rank."""
    return sorted(glob.glob(os.path.join(out_dir, "shard-*-model-*-of-*.safetensors")))


def checkpoint_files(out_dir: str, world_size: int, fmt: str = "ranks") -> list[str]:
    """The files holding the tensors, in the checkpoint's format."""
    if fmt == "dcp":
        return sorted(glob.glob(os.path.join(out_dir, "*.distcp")))
    return hf_shard_files(out_dir) if fmt == "dcp-hf" else rank_files(out_dir, world_size)


def checkpoint_exists(out_dir: str, world_size: int, fmt: str = "ranks") -> bool:
    if fmt == "dcp":
        written = os.path.isfile(os.path.join(out_dir, ".metadata"))
    else:
        written = len(checkpoint_files(out_dir, world_size, fmt)) == world_size
    return written and os.path.isfile(os.path.join(out_dir, "huggingface", "config.json"))


def make_checkpoint(
    out_dir: str, world_size: int = 4, start_method: str = "spawn", fmt: str = "ranks", **sizes
) -> bool:
    """Write the checkpoint unless it is already there; True if it was written now.

    fmt "ranks": one torch.save file per rank (verl's layout); "dcp": one
    torch.distributed.checkpoint folder (.metadata + .distcp files), written collectively;
    "dcp-hf": the same save through HuggingFaceStorageWriter(save_distributed=True), one
    `shard-{r}-model-00001-of-00001.safetensors` per rank with the chunks' offsets in its header.

    start_method "fork" imports torch, transformers and FSDP once, here, and forks the ranks:
    they share those pages, so many ranks fit where spawned ones (each importing everything
    again, about 300 MB apiece) would not. The files written are the same.
    """
    if checkpoint_exists(out_dir, world_size, fmt):
        return False
    import torch.multiprocessing as mp

    os.makedirs(out_dir, exist_ok=True)
    config = llama_config(**sizes)
    if start_method == "fork":  # import once, before the fork
        for module in (
            "torch.distributed.fsdp",
            "torch.distributed.device_mesh",
            "transformers.models.llama.modeling_llama",
        ):
            importlib.import_module(module)
    mp.start_processes(
        _rank_main,
        args=(world_size, _free_port(), out_dir, config, fmt),
        nprocs=world_size,
        join=True,
        start_method=start_method,
    )
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, out_dir: str, config, fmt: str = "ranks") -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        model = sharded_model(config, world_size)
        fill_local_shards(model, seed=1234 + rank)
        if fmt in ("dcp", "dcp-hf"):
            import torch.distributed.checkpoint as dcp

            writer = dcp.HuggingFaceStorageWriter(out_dir, save_distributed=True) if fmt == "dcp-hf" else None
            dcp.save(model.state_dict(), checkpoint_id=out_dir, storage_writer=writer)
        else:
            torch.save(model.state_dict(), os.path.join(out_dir, f"model_world_size_{world_size}_rank_{rank}.pt"))
        if rank == 0:
            config.save_pretrained(os.path.join(out_dir, "huggingface"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_rank()


def sharded_model(config, world_size: int):
    """The model sharded by FSDP2, with real storage for this rank's shards only."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return model


@torch.no_grad()
def fill_local_shards(model, seed: int) -> None:
    """Norm weights to one, every other weight to N(0, 0.02), from this rank's own generator."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        local = param.to_local()
        if local.ndim == 1:
            local.fill_(1.0)
        else:
            local.normal_(0.0, 0.02, generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a real FSDP2 checkpoint of a Llama-like fp32 model.")
    parser.add_argument("out_dir")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument(
        "--start-method",
        choices=("spawn", "fork"),
        default="spawn",
        help="fork: the ranks share the parent's imports (less memory for many ranks)",
    )
    parser.add_argument(
        "--format",
        choices=("ranks", "dcp", "dcp-hf"),
        default="ranks",
        help="ranks: a torch.save file per rank (default); dcp: torch.distributed.checkpoint.save; "
        "dcp-hf: the same with HuggingFaceStorageWriter",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    written = make_checkpoint(
        args.out_dir,
        args.world_size,
        args.start_method,
        fmt=args.format,
        hidden=args.hidden,
        layers=args.layers,
        intermediate=args.intermediate,
        vocab=args.vocab,
        heads=args.heads,
    )
    files = checkpoint_files(args.out_dir, args.world_size, args.format)
    size = sum(os.path.getsize(f) for f in files)
    verb = f"wrote in {time.perf_counter() - start:.1f} s" if written else "already there"
    print(f"{args.out_dir}: {args.world_size} ranks, {len(files)} files, {size / 1e9:.2f} GB, {verb}")


if __name__ == "__main__":
    main()
