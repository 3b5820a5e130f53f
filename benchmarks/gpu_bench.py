"""GPU figures for fsdpfast, in one run on a machine with a CUDA GPU.

1. Raw conversion throughput of the device kernel (gather_convert on device tensors), per dtype pair.
2. Pinned host <-> device copy throughput (what the staged pipeline streams through).
3. End to end: a real FSDP2 checkpoint of 8 GB or more (fp32, 4 ranks) merged to bf16 by each
   engine, each merge its own process, beside the I/O floor, in the same run.

    python benchmarks/gpu_bench.py [--workdir /tmp/fsdpfast-gpu] [--report report.md]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_checkpoint import make_checkpoint, rank_files  # noqa: E402

# About 9.8 GB of fp32 shards: hidden 3072, 20 layers, MLP 8192, vocab 32000.
BIG = dict(hidden=3072, layers=20, intermediate=8192, vocab=32000, heads=24)
PAIRS = [("float32", "bfloat16"), ("float32", "float16"), ("bfloat16", "float32"), ("float16", "float32"), ("float16", "bfloat16")]


def device_conversion(elements: int = 1 << 28) -> list[str]:
    from fsdpfast import _ops

    lines = ["| conversion | GB/s (bytes read + written), median of 10 |", "|---|---|"]
    for source, target in PAIRS:
        src = torch.randn(elements, device="cuda").to(getattr(torch, source))
        dst = torch.empty(elements, dtype=getattr(torch, target), device="cuda")
        plan = torch.tensor([[0, 0, _ops.code(source), _ops.code(target), src.element_size(), dst.element_size(),
                              0, elements, 0, 1, 0, 0]], dtype=torch.int64)
        args = ([src.view(torch.uint8)], [dst.view(torch.uint8)], plan)
        _ops.gather_convert(*args)
        torch.cuda.synchronize()
        seconds = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _ops.gather_convert(*args)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        moved = elements * (src.element_size() + dst.element_size())
        lines.append(f"| {source} -> {target} | {moved / statistics.median(seconds) / 1e9:.0f} |")
        del src, dst
    return lines


def pinned_transfers(nbytes: int = 1 << 30) -> list[str]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    lines = ["| copy | GB/s, median of 10 |", "|---|---|"]
    for name, copy in (("host -> device", lambda: device.copy_(host, non_blocking=True)),
                       ("device -> host", lambda: host.copy_(device, non_blocking=True))):
        copy()
        torch.cuda.synchronize()
        seconds = []
        for _ in range(10):
            start = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        lines.append(f"| {name} (pinned) | {nbytes / statistics.median(seconds) / 1e9:.1f} |")
    return lines


def end_to_end(workdir: str, rounds: int) -> list[str]:
    ckpt, out = os.path.join(workdir, "ckpt"), os.path.join(workdir, "out")
    start = time.perf_counter()
    make_checkpoint(ckpt, 4, **BIG)
    made = time.perf_counter() - start
    files = rank_files(ckpt, 4)
    input_bytes = sum(os.path.getsize(f) for f in files)
    from fsdpfast import plan_merge
    from fsdpfast.plan.layout import tensor_nbytes

    out_bytes = sum(tensor_nbytes(t) for t in plan_merge(ckpt, dtype="bf16").tensors)
    commands = {"floor (mmap writes)": [sys.executable, os.path.join(HERE, "io_floor.py"), os.path.join(workdir, "floor.bin"),
                                        str(out_bytes), *files, "--write", "mmap"],
                "floor (pwrite)": [sys.executable, os.path.join(HERE, "io_floor.py"), os.path.join(workdir, "floor.bin"),
                                   str(out_bytes), *files, "--write", "pwrite"]}
    for engine in ("cuda", "cpu", "torch"):
        commands[f"merge bf16, {engine} engine"] = [sys.executable, "-m", "fsdpfast", "merge", ckpt, "--out", out,
                                                     "--dtype", "bf16", "--engine", engine, "--overwrite"]
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(rounds + 1):  # the first round warms the page cache and is not counted
        for name, argv in commands.items():
            start = time.perf_counter()
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - start)
            subprocess.run(["rm", "-rf", out, os.path.join(workdir, "floor.bin")], check=True)
            os.sync()
    lines = [f"{input_bytes / 1e9:.1f} GB fp32 checkpoint, 4 ranks (written in {made:.0f} s); bf16 output {out_bytes / 1e9:.1f} GB; "
             f"inputs warm in the page cache; {os.cpu_count()} CPUs; median of {rounds} rounds after a warm-up round.",
             "", "| command | wall s | input GB/s |", "|---|---|---|"]
    for name, secs in times.items():
        median = statistics.median(secs[1:])
        lines.append(f"| {name} | {median:.2f} | {input_bytes / median / 1e9:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/fsdpfast-gpu")
    parser.add_argument("--report", default=None)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    sections = [f"# fsdpfast GPU benchmark, {time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, torch {torch.__version__}",
                "", "## Device conversion kernel", "", *device_conversion(),
                "", "## Pinned transfers", "", *pinned_transfers(),
                "", "## End to end", "", *end_to_end(args.workdir, args.rounds)]
    text = "\n".join(sections) + "\n"
    print(text, flush=True)
    if args.report:
        with open(args.report, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
