"""Merge a checkpoint bigger than the machine's memory: fsdpfast streams it, an in-RAM merger cannot.

Not part of CI: it needs about 48 GB of free disk and took 5 minutes here. Steps, each its own
process, measured by benchmarks/measure.py (wall time with time.perf_counter; peak RSS and peak
RssAnon summed over the process tree, sampled from /proc/<pid>/status every ~20 ms):

  1. generate  a real FSDP2 fp32 checkpoint of a Llama-like model (hidden 4096, MLP 11008, vocab
               32000, 36 layers, untied: 7.55 B parameters, 30.2 GB) on 8 spawned gloo ranks.
               The ranks take turns, with a barrier after each turn: only the rank whose turn it
               is builds the model on the meta device, shards it with fully_shard (every layer,
               then the root), allocates its own shards (to_empty), fills them from its seed,
               torch.saves its state dict and frees them. Peak memory is one rank's share
               (~3.8 GB) plus the idle ranks' interpreters. Large allocations are mmapped
               (MALLOC_MMAP_THRESHOLD_) so freed shards go back to the system.
  2. merge     python -m fsdpfast merge CKPT --out OUT --dtype bf16
  3. check     python benchmarks/check_merged.py CKPT OUT: every tensor bit for bit against
               torch.cat of the rank pieces .to(bf16), one tensor at a time.
  4. in-RAM    python benchmarks/baselines/verl_style.py CKPT OUT2 (load every rank file whole,
               torch.cat per key, cast, save) under `prlimit --as=LIMIT`, LIMIT = min(20 GB,
               available memory - 3 GB): it must hold the whole 30 GB state, so it fails with an
               allocation error instead of waking the OOM killer for the whole machine.

The inputs cannot all be in the page cache (30 GB > RAM), so the merge reads most of them
from disk; the machine's disk counters (psutil) around each step say how much. Results go to benchmarks/results/larger_than_ram.md; then the checkpoint and the
outputs are deleted (unless --keep). Before starting, it waits (up to 30 min, polling every
minute) for the rest of the machine to be quiet.

    python benchmarks/larger_than_ram.py [--workdir benchmarks/work/large] [--layers 36] [--world-size 8] [--keep] [--no-wait]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import shlex
import shutil
import socket
import sys
import time
from dataclasses import dataclass

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_checkpoint import fill_local_shards, llama_config, rank_files  # noqa: E402
from measure import Run, run_measured, size, wait_for_quiet  # noqa: E402

MODEL = dict(hidden=4096, intermediate=11008, vocab=32000, heads=32)
IN_RAM_LIMIT_CAP = 20_000_000_000
DISK_MARGIN = 3_000_000_000


# --- 1. generating the checkpoint, one rank at a time ---------------------------------------


def parameter_count(config) -> int:
    import torch
    import transformers

    with torch.device("meta"):
        return sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())


def generate(ckpt: str, world_size: int, config) -> None:
    import torch.multiprocessing as mp

    os.makedirs(ckpt, exist_ok=True)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # the ranks' shards are munmapped when freed
    mp.spawn(_rank_main, args=(world_size, _free_port(), ckpt, config), nprocs=world_size, join=True)
    print(f"wrote {world_size} rank files, {sum(map(os.path.getsize, rank_files(ckpt, world_size))) / 1e9:.1f} GB")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, ckpt: str, config) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(psutil.cpu_count())  # one rank works at a time
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(hours=2),
    )
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        for turn in range(world_size):
            if turn == rank:
                save_own_shards(config, mesh, rank, world_size, ckpt)
                gc.collect()
                print(
                    f"rank {rank}: freed, RSS {size(psutil.Process().memory_info().rss)}", file=sys.stderr, flush=True
                )
            dist.barrier()
        if rank == 0:
            config.save_pretrained(os.path.join(ckpt, "huggingface"))
    finally:
        dist.destroy_process_group()


def save_own_shards(config, mesh, rank: int, world_size: int, ckpt: str) -> None:
    """Build, shard, fill and save this rank's part; everything is freed on return."""
    import torch
    import transformers
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    fill_local_shards(model, seed=1234 + rank)
    torch.save(model.state_dict(), os.path.join(ckpt, f"model_world_size_{world_size}_rank_{rank}.pt"))
    print(f"rank {rank}: saved, RSS {size(psutil.Process().memory_info().rss)}", file=sys.stderr, flush=True)


# --- the run -----------------------------------------------------------------------------------


def check_disk(path: str, needed: int) -> None:
    free = shutil.disk_usage(path).free
    if free < needed:
        sys.exit(f"need {size(needed)} free on {path}, have {size(free)}")
    print(f"disk: {size(free)} free, {size(needed)} needed", flush=True)


def in_ram_limit() -> int:
    return min(IN_RAM_LIMIT_CAP, psutil.virtual_memory().available - 3_000_000_000)


@dataclass
class Step:
    argv: list[str]
    run: Run
    disk_read: int  # bytes the whole machine read from / wrote to its disks meanwhile
    disk_written: int


def step(name: str, argv: list[str]) -> Step:
    print(f"{time.strftime('%H:%M:%S')} {name}: {shlex.join(argv)}", flush=True)
    before = psutil.disk_io_counters()
    run = run_measured(argv)
    after = psutil.disk_io_counters()
    done = Step(argv, run, after.read_bytes - before.read_bytes, after.write_bytes - before.write_bytes)
    print(
        f"  exit {run.returncode}, {run.seconds:.1f} s, peak RSS {size(run.peak_rss)}, peak RssAnon {size(run.peak_anon)}, "
        f"disk read {size(done.disk_read)}, written {size(done.disk_written)}\n  {outcome(run)}",
        flush=True,
    )
    return done


def outcome(run: Run) -> str:
    """What a step said: its output when it worked, the last line of its error when it failed."""
    if run.returncode == 0:
        return "; ".join(line.strip() for line in run.stdout.splitlines() if line.strip()) or "done"
    lines = [line.strip() for line in run.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {run.returncode}"


def shorten(text: str, labels: dict[str, str]) -> str:
    for path, label in labels.items():
        text = text.replace(path, label)
    return text


def results(
    steps: dict[str, Step], params: int, ckpt_bytes: int, out_bytes: int, limit: int, labels: dict[str, str]
) -> str:
    memory = psutil.virtual_memory().total
    lines = [
        f"Larger-than-RAM merge, {datetime.date.today()}: {psutil.cpu_count()} CPUs, {size(memory)} ({memory / 2**30:.1f} GiB) RAM, "
        f"swap {size(psutil.swap_memory().total)}. Checkpoint: {params / 1e9:.2f} B parameters, fp32, "
        f"{ckpt_bytes / 1e9:.1f} GB in rank files ({ckpt_bytes / memory:.2f}x RAM); bf16 output {out_bytes / 1e9:.1f} GB. "
        f"In-RAM merger's limit (prlimit --as): {size(limit)}. Disk read / written: the whole machine's, during the step; "
        "others CPU s: CPU time the rest of the machine used meanwhile.",
        "",
        "| step | command | exit | wall s | CPU s | others CPU s | disk read | disk written | peak RSS | peak RssAnon | outcome |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, done in steps.items():
        run = done.run
        command = shorten(shlex.join(done.argv), labels)
        lines.append(
            f"| {name} | `{command}` | {run.returncode} | {run.seconds:.1f} | {run.cpu_seconds:.1f} "
            f"| {run.others_cpu_seconds:.1f} | {size(done.disk_read)} | {size(done.disk_written)} "
            f"| {size(run.peak_rss)} | {size(run.peak_anon)} | {shorten(outcome(run), labels)[:200].replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=os.path.join(HERE, "work", "large"))
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and the merged folder")
    parser.add_argument("--no-wait", action="store_true", help="start without waiting for a quiet machine")
    parser.add_argument("--generate-only", action="store_true", help=argparse.SUPPRESS)  # step 1, as its own process
    args = parser.parse_args()
    config = llama_config(layers=args.layers, **MODEL)
    ckpt, out, out_in_ram = (os.path.join(args.workdir, name) for name in ("ckpt", "out", "out_in_ram"))
    if args.generate_only:
        return generate(ckpt, args.world_size, config)

    params = parameter_count(config)
    print(
        f"{params / 1e9:.2f} B parameters: {params * 4 / 1e9:.1f} GB fp32, {params * 2 / 1e9:.1f} GB bf16", flush=True
    )
    os.makedirs(args.workdir, exist_ok=True)
    if not args.no_wait:
        wait_for_quiet(max_busy=0.5, max_wait=1800, poll=60)
    check_disk(args.workdir, params * 6 + DISK_MARGIN)
    me = [
        sys.executable,
        os.path.abspath(__file__),
        "--workdir",
        args.workdir,
        "--layers",
        str(args.layers),
        "--world-size",
        str(args.world_size),
    ]
    commands = {
        f"generate ({args.world_size} ranks in turn)": me + ["--generate-only"],
        "fsdpfast merge --dtype bf16": [
            sys.executable,
            "-m",
            "fsdpfast",
            "merge",
            ckpt,
            "--out",
            out,
            "--dtype",
            "bf16",
        ],
        "check, bit for bit": [sys.executable, os.path.join(HERE, "check_merged.py"), ckpt, out],
    }
    steps = {}
    for name, argv in commands.items():
        steps[name] = step(name, argv)
        if steps[name].run.returncode != 0 and not name.startswith("check"):
            sys.exit(f"{name} failed:\n{steps[name].run.stderr[-3000:]}")
    ckpt_bytes, out_bytes = sum(map(os.path.getsize, rank_files(ckpt, args.world_size))), folder_bytes(out)
    shutil.rmtree(out)
    limit = in_ram_limit()
    argv = [
        "prlimit",
        f"--as={limit}",
        sys.executable,
        os.path.join(HERE, "baselines", "verl_style.py"),
        ckpt,
        out_in_ram,
    ]
    steps["in-RAM merger (verl-style)"] = step("in-RAM merger", argv)
    shutil.rmtree(out_in_ram, ignore_errors=True)
    labels = {
        ckpt: "CKPT",
        out_in_ram: "OUT2",
        out: "OUT",
        sys.executable: "python",
        os.path.abspath(__file__): "benchmarks/larger_than_ram.py",
        HERE + "/": "benchmarks/",
    }
    text = results(steps, params, ckpt_bytes, out_bytes, limit, labels)
    print("\n" + text)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "larger_than_ram.md"), "w") as f:
        f.write(text)
    if not args.keep:
        shutil.rmtree(args.workdir)


if __name__ == "__main__":
    main()
