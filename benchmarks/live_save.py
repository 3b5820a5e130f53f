"""Saving a live FSDP2 model as a Hugging Face folder: three ways, side by side, on gloo ranks (CPU),
or with the model on a GPU (--device cuda: NCCL, one rank per GPU; --backend gloo for more ranks
sharing one GPU, with CUDA tensors).

  fsdpfast      fsdpfast.save_pretrained(model, out): every rank writes its pieces in place
  gather        get_model_state_dict(full_state_dict=True, cpu_offload=True), then rank 0's
                model.save_pretrained(state_dict=...): what accelerate and the Trainer do
  dcp+consol.   torch.distributed.checkpoint.save with HuggingFaceStorageWriter (one shard file per
                rank), then consolidate_safetensors_files_on_every_rank into one folder

and two variants of fsdpfast's, to measure the choices it makes (--ways picks any of the five):

  fsdpfast-redistribute   pieces that are not whole rows (--shard-dim 1) redistributed to Shard(0)
                          first (live.write.WriteWays.redistribute), instead of written as strided runs
  fsdpfast-torch-cast     CPU tensors cast by torch's .to() (WriteWays.torch_cast), not by the native kernel

Each way runs in fresh processes (so peak RSS is its own), on the same seeded model, one round
after another, for --rounds rounds; the table gives each way's min and median seconds (the save
alone, from a barrier to a barrier) and rank 0's peak RSS growth during the save, with ratios to fsdpfast.
--shard-dim 1 shards the 2-D weights on their columns (FSDP2's shard_placement_fn).

    python benchmarks/live_save.py --world 4 --hidden 1024 --layers 8 --rounds 3
    python benchmarks/live_save.py --world 4 --shard-dim 1 --rounds 5 --ways fsdpfast fsdpfast-redistribute fsdpfast-torch-cast
    python benchmarks/live_save.py --device cuda --world 1 --hidden 2048 --layers 16 --rounds 1 --report live_save_gpu.md

With --device cuda, fsdpfast casts on the GPU (the extension's CUDA op, or torch's .to() for
fsdpfast-torch-cast) and writes from pinned host buffers; the others gather or save as they do.
--report also writes the table to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WAYS = ("fsdpfast", "gather", "dcp+consol.", "fsdpfast-redistribute", "fsdpfast-torch-cast")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rank(rank: int, world: int, port: int, way: str, args, result_path: str) -> None:
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # more ranks than GPUs share them (gloo)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    config = llama_config(args)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    mesh = init_device_mesh(args.device, (world,))
    placement = (lambda p: Shard(args.shard_dim) if p.ndim == 2 else None) if args.shard_dim else None
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    model.to_empty(device=torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    out = os.path.join(args.workdir, f"{way}-out")
    dist.barrier()
    before = _rss_mb()
    start = time.perf_counter()
    if way.startswith("fsdpfast"):
        import fsdpfast
        from fsdpfast.live.write import WriteWays

        ways = WriteWays(redistribute=way == "fsdpfast-redistribute", torch_cast=way == "fsdpfast-torch-cast")
        fsdpfast.save_pretrained(model, out, dtype="bf16", ways=ways)
    elif way == "gather":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            model.save_pretrained(out, state_dict={k: v.to(torch.bfloat16) for k, v in full.items()})
        del full
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank

        shards = os.path.join(args.workdir, "dcp-shards")
        state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
        dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(shards, save_distributed=True))
        os.makedirs(out, exist_ok=True)
        dist.barrier()
        consolidate_safetensors_files_on_every_rank(
            shards, out, fqn_to_index_mapping={k: 1 for k in state}, num_threads=1
        )
    if args.device == "cuda":
        torch.cuda.synchronize()
    finish_rank(rank, result_path, start, before, _peak_mb)


def llama_config(args):
    """The benchmark model: Llama of --hidden, --layers and --vocab, heads of 64 and 2 per KV head."""
    import transformers

    return transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 128,
        vocab_size=args.vocab,
        architectures=["LlamaForCausalLM"],
    )


def finish_rank(rank: int, result_path: str, start: float, before_mb: float, peak_mb) -> None:
    """A way's end on every rank: wait for all, rank 0 writes the time since `start` and the growth
    of `peak_mb()` past `before_mb` for spawn_way, and the process leaves at once."""
    import torch.distributed as dist

    dist.barrier()
    seconds = time.perf_counter() - start
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump({"seconds": seconds, "rss_growth_mb": peak_mb() - before_mb, "before_mb": before_mb}, f)
    dist.destroy_process_group()
    os._exit(0)


def run_way(way: str, args) -> dict:
    return spawn_way(_rank, way, args, leftovers=(f"{way}-out", "dcp-shards"))


def spawn_way(rank_main, way: str, args, leftovers: tuple[str, ...]) -> dict:
    """`rank_main(rank, world, port, way, args, result)` on `args.world` fresh processes, after removing
    `leftovers` from the work folder; what rank 0 wrote to `result` (JSON)."""
    import torch.multiprocessing as mp

    from fsdpfast._testing.fsdp2_writer import _free_port

    for leftover in leftovers:
        shutil.rmtree(os.path.join(args.workdir, leftover), ignore_errors=True)
    result = os.path.join(args.workdir, f"{way}.json")
    mp.spawn(rank_main, args=(args.world, _free_port(), way, args, result), nprocs=args.world, join=True)
    with open(result) as f:
        return json.load(f)


def table_lines(results: dict[str, list[dict]]) -> list[str]:
    """Each way's min and median seconds and median rank-0 RSS growth, against the first way's."""
    first = next(iter(results))
    lines = [f"{'way':<23}{'min s':>8}{'median s':>10}{'x ' + first:>12}{'rank-0 RSS growth MB':>22}{'x ' + first:>12}"]
    base = {k: statistics.median(r[k] for r in results[first]) for k in ("seconds", "rss_growth_mb")}
    for way, runs in results.items():
        low = min(r["seconds"] for r in runs)
        secs = statistics.median(r["seconds"] for r in runs)
        rss = statistics.median(r["rss_growth_mb"] for r in runs)
        lines.append(
            f"{way:<23}{low:>8.2f}{secs:>10.2f}{secs / base['seconds']:>12.2f}{rss:>22.0f}"
            f"{rss / max(base['rss_growth_mb'], 1):>12.1f}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shard-dim", type=int, default=0, help="FSDP2 shards 2-D weights on this dim")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS[:3]))
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model's tensors are")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl on cuda, else gloo")
    parser.add_argument("--report", default=None, help="also write the table to this file")
    args = parser.parse_args()
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="fsdpfast-live-")
    ways = ["fsdpfast"] + [w for w in args.ways if w != "fsdpfast"]
    results = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way in ways:
            results[way].append(run_way(way, args))
    out = os.path.join(args.workdir, f"{ways[-1]}-out")
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))
    where = f"on {args.device}" + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
    lines = [
        f"model: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {size / 1e9:.2f} GB in bf16; "
        f"Shard({args.shard_dim}); {args.world} {args.backend} ranks {where}; {args.rounds} rounds",
        *table_lines(results),
    ]
    print("\n".join(lines), flush=True)
    if args.report:
        with open(args.report, "w") as f:
            f.write("```\n" + "\n".join(lines) + "\n```\n")
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
