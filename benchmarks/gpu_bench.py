"""GPU figures for fsdpfast, in one run on a machine with a CUDA GPU (benchmarks/gpu_check.sh runs it).

1. End to end: a real FSDP2 checkpoint (3.8 GB fp32, 4 ranks) merged at `--dtype keep` and `bf16`
   by every engine, each merge its own process, beside the I/O floor, in the same run; the
   outputs' manifests (every tensor's CRC-32C) must agree across engines.
2. Raw conversion throughput of the device kernel (gather_convert on device tensors), per dtype pair.
3. Pinned host <-> device copy throughput (what the staged pipeline streams through).

With --record, the engine measured fastest for each kind of job is written where `--engine auto`
reads it on this machine (fsdpfast/execute/measurements.py), engines whose output differed left out.

    python benchmarks/gpu_bench.py [--workdir /tmp/fsdpfast-gpu] [--report report.md] [--record [PATH]]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_checkpoint import make_checkpoint, rank_files  # noqa: E402
from measure import clean, run_measured, size  # noqa: E402

PAIRS = [
    ("float32", "bfloat16"),
    ("float32", "float16"),
    ("bfloat16", "float32"),
    ("float16", "float32"),
    ("float16", "bfloat16"),
]
ENGINES = ("cpu", "cuda", "torch")
DTYPES = ("keep", "bf16")
WORLD = 4


def device_conversion(elements: int = 1 << 28) -> list[str]:
    from fsdpfast import _ops

    lines = ["| conversion | GB/s (bytes read + written), median of 10 |", "|---|---|"]
    for source, target in PAIRS:
        src = torch.randn(elements, device="cuda").to(getattr(torch, source))
        dst = torch.empty(elements, dtype=getattr(torch, target), device="cuda")
        plan = torch.tensor(
            [
                [
                    0,
                    0,
                    _ops.code(source),
                    _ops.code(target),
                    src.element_size(),
                    dst.element_size(),
                    0,
                    elements,
                    0,
                    1,
                    0,
                    0,
                ]
            ],
            dtype=torch.int64,
        )
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
    torch.cuda.empty_cache()
    return lines


def pinned_transfers(nbytes: int = 1 << 30) -> list[str]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    lines = ["| copy | GB/s, median of 10 |", "|---|---|"]
    for name, copy in (
        ("host -> device", lambda: device.copy_(host, non_blocking=True)),
        ("device -> host", lambda: host.copy_(device, non_blocking=True)),
    ):
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


def _manifest(out: str) -> dict:
    """The merge's manifest less the engine's name: equal across engines exactly when every tensor's bytes are."""
    with open(os.path.join(out, "fsdpfast-manifest.json")) as f:
        manifest = json.load(f)
    manifest.pop("engine", None)
    return manifest


def end_to_end(ckpt: str, workdir: str, rounds: int, deadline: float) -> tuple[list[str], dict, dict]:
    """(report lines, seconds[kind][engine] for engines whose output matched the cpu engine's, kinds by dtype)."""
    from fsdpfast import plan_merge
    from fsdpfast.execute.measurements import job_kind
    from fsdpfast.plan.layout import tensor_nbytes

    files = rank_files(ckpt, WORLD)
    input_bytes = sum(os.path.getsize(f) for f in files)
    out, floor_file = os.path.join(workdir, "out"), os.path.join(workdir, "floor.bin")
    kinds, commands = {}, {}
    for dtype in DTYPES:
        plan = plan_merge(ckpt, dtype=dtype)
        kinds[dtype] = job_kind(plan.tensors)
        out_bytes = sum(tensor_nbytes(t) for t in plan.tensors)
        commands[(dtype, "floor (pwrite)")] = [
            sys.executable,
            os.path.join(HERE, "io_floor.py"),
            floor_file,
            str(out_bytes),
            *files,
            "--write",
            "pwrite",
        ]
        for engine in ENGINES:
            commands[(dtype, engine)] = [
                sys.executable,
                "-m",
                "fsdpfast",
                "merge",
                ckpt,
                "--out",
                out,
                "--dtype",
                dtype,
                "--engine",
                engine,
                "--overwrite",
                "--quiet",
            ]
    runs: dict[tuple, list] = {key: [] for key in commands}
    manifests: dict[tuple, dict] = {}
    failures: list[str] = []
    done_rounds, round_seconds = 0, 0.0
    while done_rounds < rounds and (done_rounds == 0 or time.time() + round_seconds < deadline):
        started = time.time()
        for key, argv in commands.items():
            run = run_measured(argv)
            if run.returncode != 0:
                failures.append(f"{key[0]} {key[1]}: exit {run.returncode}: {run.stderr.strip().splitlines()[-1:]}")
            else:
                runs[key].append(run)
                if key[1] in ENGINES and key not in manifests:
                    manifests[key] = _manifest(out)
            if os.path.exists(floor_file):
                os.remove(floor_file)
            clean(out)  # and sync, so that no run pays for the previous one's writeback
        done_rounds += 1
        round_seconds = time.time() - started
    mismatched = {key for key in manifests if key[1] != "cpu" and manifests[key] != manifests.get((key[0], "cpu"))}
    lines = [
        f"{input_bytes / 1e9:.1f} GB fp32 checkpoint, {WORLD} ranks; inputs warm in the page cache; {os.cpu_count()} CPUs; "
        f"median of {done_rounds} round(s), every command its own process, output removed and synced between runs.",
        "",
        "| --dtype | command | wall s (min-max) | input GB/s | peak RSS | CPU s | vs cpu engine | output |",
        "|---|---|---|---|---|---|---|---|",
    ]
    seconds: dict[str, dict[str, float]] = {}
    for (dtype, name), measured in runs.items():
        if not measured:
            lines.append(f"| {dtype} | {name} | failed | | | | | |")
            continue
        wall = statistics.median(r.seconds for r in measured)
        cpu = runs.get((dtype, "cpu"))
        versus = f"{wall / statistics.median(r.seconds for r in cpu):.2f}" if cpu else ""
        check = "" if name not in ENGINES else ("differs from cpu" if (dtype, name) in mismatched else "same bytes")
        lines.append(
            f"| {dtype} | {name} | {wall:.2f} ({min(r.seconds for r in measured):.2f}-{max(r.seconds for r in measured):.2f}) "
            f"| {input_bytes / wall / 1e9:.2f} | {size(max(r.peak_rss for r in measured))} "
            f"| {statistics.median(r.cpu_seconds for r in measured):.1f} | {versus} | {check} |"
        )
        if name in ENGINES and (dtype, name) not in mismatched:
            seconds.setdefault(kinds[dtype], {})[name] = wall
    if failures or mismatched:
        lines += (
            ["", "Problems:"]
            + [f"- {f}" for f in failures]
            + [f"- {d} {e}: output differs from the cpu engine's" for d, e in sorted(mismatched)]
        )
    return lines, seconds, kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/fsdpfast-gpu")
    parser.add_argument("--report", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--seconds", type=float, default=300, help="stop starting merge rounds after this long (one round always runs)"
    )
    parser.add_argument(
        "--record",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="record the fastest engine per kind of job for --engine auto (default place: measurements.path())",
    )
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    deadline = time.time() + args.seconds
    ckpt = os.path.join(args.workdir, "ckpt")
    start = time.perf_counter()
    written = make_checkpoint(ckpt, WORLD)  # spawned ranks: none inherits this process's CUDA state
    gpu = torch.cuda.get_device_name()
    made = f"written in {time.perf_counter() - start:.0f} s" if written else "already there"
    merges, seconds, kinds = end_to_end(ckpt, args.workdir, args.rounds, deadline)
    sections = [
        f"# fsdpfast GPU benchmark, {time.strftime('%Y-%m-%d')}, {gpu}, torch {torch.__version__}",
        "",
        f"## Offline merge, every engine (checkpoint {made})",
        "",
        *merges,
        "",
        "## Device conversion kernel",
        "",
        *device_conversion(),
        "",
        "## Pinned transfers",
        "",
        *pinned_transfers(),
    ]
    if args.record is not None:
        from fsdpfast.execute import measurements
        from fsdpfast.execute.engines import auto_engine

        where = measurements.record(seconds, gpu, args.record or None)
        os.environ[measurements.ENV] = where  # what auto reads below, wherever it was written
        with open(where) as f:
            fastest = json.load(f)["fastest"]
        picks = ", ".join(f"--dtype {dtype} ({kind}): {auto_engine(kind)}" for dtype, kind in kinds.items())
        sections += [
            "",
            "## Recorded for --engine auto",
            "",
            f"{where}: fastest {json.dumps(fastest)}",
            "",
            f"auto now picks: {picks}",
        ]
    text = "\n".join(sections) + "\n"
    print(text, flush=True)
    if args.report:
        with open(args.report, "w") as f:
            f.write(text)
    shutil.rmtree(os.path.join(args.workdir, "out"), ignore_errors=True)


if __name__ == "__main__":
    main()
