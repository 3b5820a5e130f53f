"""Does a background save_pretrained hold training up? Side by side on gloo ranks (CPU), or --device cuda.

Each round, on the same seeded FSDP2 Llama, every rank times (from a barrier):
  step          one training step alone (forward, backward, AdamW), the baseline
  blocking      save_pretrained(model, out): training waits for all of it before its next step
  background    save_pretrained(model, out2, background=True) of the same model, the next step while
                the files are written, then handle.wait(): how long the call takes to return, the
                step beside the writing thread, and the time until the folder is published
and the two folders' safetensors files are compared byte for byte. Rank 0's figures, medians over
--rounds, with ratios to the step alone; host memory the copy took (handle.host_bytes) against the
rank's pieces.

    python benchmarks/background_save.py --world 2 --hidden 512 --layers 4 --rounds 3
    python benchmarks/background_save.py --device cuda --backend nccl --world 1 --hidden 2048 --layers 16
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(rank: int, world: int, port: int, args, out_root: str, result_path: str) -> None:
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import fsdpfast

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        vocab_size=args.vocab,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(args.device)
    mesh = init_device_mesh(args.device, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank))
    ids = ids.to(args.device)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if args.device == "cuda":
            torch.cuda.synchronize()

    def timed(fn):
        dist.barrier()
        start = time.perf_counter()
        value = fn()
        return time.perf_counter() - start, value

    step()  # warm-up
    local = sum((v.to_local() if isinstance(v, DTensor) else v).nbytes for v in model.state_dict().values())
    rounds = []
    for r in range(args.rounds):
        blocking_out, background_out = (os.path.join(out_root, f"{way}-{r}") for way in ("blocking", "background"))
        alone, _ = timed(step)
        save_s, _ = timed(partial(fsdpfast.save_pretrained, model, blocking_out, dtype=args.dtype))
        # the same model, saved in the background; then the next step while the thread writes
        returned, handle = timed(
            partial(fsdpfast.save_pretrained, model, background_out, dtype=args.dtype, background=True)
        )
        beside, _ = timed(step)
        waited, _ = timed(handle.wait)
        rounds.append(
            dict(
                step=alone,
                blocking_save=save_s,
                blocking_then_step=save_s + alone,
                background_return=returned,
                background_step=beside,
                background_return_then_step=returned + beside,
                background_wait=waited,
                host_bytes=handle.host_bytes,
            )
        )
        dist.barrier()
    if rank == 0:
        same = all(
            filecmp.cmp(os.path.join(out_root, f"blocking-{r}", f), os.path.join(out_root, f"background-{r}", f), False)
            for r in range(args.rounds)
            for f in os.listdir(os.path.join(out_root, f"blocking-{r}"))
            if f.endswith(".safetensors")
        )
        with open(result_path, "w") as f:
            json.dump({"rounds": rounds, "local_bytes": local, "same_bytes": same}, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--report", default=None, help="also write the table to this file")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    work = tempfile.mkdtemp(prefix="fsdpfast-background-")
    try:
        result = os.path.join(work, "result.json")
        mp.spawn(_rank, args=(args.world, _free_port(), args, work, result), nprocs=args.world, join=True)
        with open(result) as f:
            found = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in found["rounds"]) for k in found["rounds"][0]}
    base = med["step"]
    lines = [
        f"world {args.world}, hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}, saved as "
        f"{args.dtype}, {args.device}/{args.backend}; medians of {args.rounds} rounds, rank 0",
        "",
        "| what | seconds | x one step |",
        "|---|---|---|",
    ]
    for key, what in [
        ("step", "one training step alone"),
        ("blocking_save", "blocking save_pretrained"),
        ("blocking_then_step", "blocking save, then the next step"),
        ("background_return", "background save_pretrained: until it returns"),
        ("background_step", "the next step, while the files are written"),
        ("background_return_then_step", "background save returned, then the next step"),
        ("background_wait", "handle.wait() after that step (publish)"),
    ]:
        lines.append(f"| {what} | {med[key]:.3f} | {med[key] / base:.2f} |")
    lines += [
        "",
        f"host memory of the copy: {med['host_bytes'] / 1e6:.1f} MB; the rank's pieces: {found['local_bytes'] / 1e6:.1f} MB; "
        f"background files byte-identical to blocking: {found['same_bytes']}",
    ]
    text = "\n".join(lines)
    print(text)
    if args.report:
        with open(args.report, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
