"""fsdpfast beside the mergers people use today and beside the I/O floor, on real FSDP2 checkpoints.

Checkpoints: Llama-like fp32 models written by benchmarks/make_checkpoint.py (real
torch.distributed: gloo, one process per rank, FSDP2 fully_shard, meta init; the ranks are forked
from a parent that imported torch once, so 64 of them fit in memory), cached in --workdir:

  size   hidden  layers  MLP   vocab   fp32 shards
  0.25   768     2       2048  32000   0.25 GB
  1      1536    5       4608  32000   1.01 GB
  3      2048    12      5632  32000   2.99 GB

Tools, every run its own process, all merging fp32 -> bf16:

  fsdpfast-cpu, fsdpfast-torch, fsdpfast-cuda
              python -m fsdpfast merge CKPT --out OUT --dtype bf16 --engine E (cuda only with a GPU)
  guide       benchmarks/baselines/guide.py: the popular guide's algorithm, a baseline
  verl-style  benchmarks/baselines/verl_style.py: verl's published FSDP merge algorithm, written
              anew; when the verl package is importable, verl's own merger runs instead ("verl")
  floor       benchmarks/io_floor.py with the bf16 output's size: every input byte read, the
              output written and fsynced, nothing merged; both write modes (floor-mmap,
              floor-pwrite) run and, per round, the faster is the floor

Method: for each checkpoint every tool runs once untimed (inputs warm in the page cache), then
--repeat rounds run every tool in turn (A B C A B C ...), so ratios compare runs made side by
side; before each round the script waits until the rest of the machine is quiet. Each run is
measured by benchmarks/measure.py (time.perf_counter around the process; user + sys CPU; CPU the
rest of the machine used meanwhile; peak RSS and RssAnon summed over the process tree, read from
/proc every ~20 ms). After each run, untimed, benchmarks/check_merged.py compares the output with
the unsharded model bit for bit (a failure is a table entry, not a crash); then the output is
deleted and dirty pages flushed, so one tool's output is on disk at a time.

Results: benchmarks/results/compare.csv (one row per run; running a (size, world size) pair again
replaces its rows), and compare.md and compare_*.png drawn from the whole CSV (benchmarks/report.py).

    python benchmarks/compare.py [--sizes 0.25,1,3] [--world-sizes 4] [--tools ...] [--repeat 3]
    python benchmarks/compare.py --sizes 1 --world-sizes 2,4,8,16,32,64      # throughput vs ranks
"""
from __future__ import annotations

import argparse
import csv
import datetime
import importlib.util
import os
import subprocess
import sys
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_merge import output_bytes  # noqa: E402
from make_checkpoint import checkpoint_exists, rank_files  # noqa: E402
from measure import clean, run_measured, size, wait_for_quiet  # noqa: E402
import report  # noqa: E402

MODELS = {
    "0.25": dict(hidden=768, layers=2, intermediate=2048, vocab=32000, heads=12),
    "1": dict(hidden=1536, layers=5, intermediate=4608, vocab=32000, heads=12),
    "3": dict(hidden=2048, layers=12, intermediate=5632, vocab=32000, heads=16),
}
TOOLS_HELP = ("comma-separated, in run order: fsdpfast-cpu, fsdpfast-torch, fsdpfast-cuda (with a GPU), guide, "
              "verl-style, floor (default: every fsdpfast engine available here, then guide, verl-style, floor). "
              "TODO, later issues, not implemented yet: dcp-to-torch-save (torch.distributed.checkpoint.format_utils."
              "dcp_to_torch_save) and consolidate-safetensors (torch's consolidate_safetensors_files).")
FIELDS = ["date", "size", "input_bytes", "world_size", "tool", "round", "seconds", "cpu_seconds",
          "others_cpu_seconds", "peak_rss", "peak_anon", "exit", "check", "busy_cpus_before"]
RANK_MEMORY_GUESS = 100e6  # bytes one forked generating rank costs, until a generation is measured


def default_tools() -> list[str]:
    from fsdpfast.engine import available_engines

    return [f"fsdpfast-{e}" for e in available_engines()] + ["guide", "verl-style", "floor"]


def verl_available() -> bool:
    return importlib.util.find_spec("verl") is not None


def tool_commands(tools: list[str], ckpt: str, out: str, world_size: int) -> dict[str, list[str]]:
    """run name -> argv. `floor` gives two runs, floor-mmap and floor-pwrite."""
    python = sys.executable
    cmds = {}
    for tool in tools:
        if tool.startswith("fsdpfast-"):
            cmds[tool] = [python, "-m", "fsdpfast", "merge", ckpt, "--out", out, "--dtype", "bf16",
                          "--engine", tool.removeprefix("fsdpfast-")]
        elif tool == "guide":
            cmds[tool] = [python, os.path.join(HERE, "baselines", "guide.py"), ckpt, out]
        elif tool == "verl-style" and verl_available():
            cmds["verl"] = [python, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
                            "--local_dir", ckpt, "--target_dir", out]
        elif tool == "verl-style":
            cmds[tool] = [python, os.path.join(HERE, "baselines", "verl_style.py"), ckpt, out]
        elif tool == "floor":
            floor = [python, os.path.join(HERE, "io_floor.py"), os.path.join(out, "floor.bin"),
                     str(output_bytes(ckpt, "bf16")), *rank_files(ckpt, world_size)]
            for mode in ("mmap", "pwrite"):
                cmds[f"floor-{mode}"] = ["sh", "-c", 'mkdir -p "$0" && exec "$@"', out, *floor, "--write", mode]
        else:
            raise SystemExit(f"unknown tool {tool!r}; {TOOLS_HELP}")
    return cmds


def check_output(ckpt: str, out: str) -> str:
    """The bit-for-bit verdict on a merged folder, from its own process: 'ok: ...' or 'FAIL: ...'."""
    done = subprocess.run([sys.executable, os.path.join(HERE, "check_merged.py"), ckpt, out],
                          capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else f"FAIL: checker exited {done.returncode}: {done.stderr.strip()[-200:]}"


def ensure_checkpoint(workdir: str, label: str, world_size: int, per_rank: list[float]) -> str | None:
    """The checkpoint's folder, written now if missing; None if its ranks would not fit in memory.

    The ranks are forked from one parent that imported torch and transformers, so they share
    those pages. `per_rank` holds the memory one generating rank was seen to cost (updated here).
    """
    ckpt = os.path.join(workdir, f"ckpt_{label}gb_w{world_size}")
    if checkpoint_exists(ckpt, world_size):
        return ckpt
    need, available = world_size * per_rank[0], psutil.virtual_memory().available
    if need > 0.8 * available:
        print(f"{world_size} ranks need about {size(need)} to generate ({size(per_rank[0])} each), "
              f"{size(available)} available: skipped", flush=True)
        return None
    argv = [sys.executable, os.path.join(HERE, "make_checkpoint.py"), ckpt, "--world-size", str(world_size),
            "--start-method", "fork", *[arg for key, value in MODELS[label].items() for arg in (f"--{key}", str(value))]]
    run = run_measured(argv)
    if run.returncode != 0:
        print(f"generating {ckpt} failed ({run.returncode}): {run.stderr.strip()[-500:]}", flush=True)
        return None
    cost = available - run.low_available
    per_rank[0] = max(per_rank[0], cost / world_size)
    print(f"generated {ckpt}: {run.stdout.strip()}; the machine's available memory fell by {size(cost)} "
          f"(ranks' summed RssAnon {size(run.peak_anon)}, shared pages counted in each)", flush=True)
    return ckpt


def one_run(name: str, argv: list[str], ckpt: str, out: str) -> tuple:
    """Measure one run, then (untimed) check its output and delete it."""
    clean(out)
    run = run_measured(argv)
    if name.startswith("floor"):
        verdict = "-"
    elif run.returncode != 0:
        verdict = f"FAIL: exit {run.returncode}: {run.stderr.strip()[-160:]}"
    else:
        verdict = check_output(ckpt, out)
    clean(out)
    return run, verdict


def run_rounds(cmds: dict[str, list[str]], ckpt: str, out: str, repeat: int, meta: dict, max_busy: float) -> list[dict]:
    for name, argv in cmds.items():  # warm-up: page cache, imports; untimed
        clean(out)
        run_measured(argv)
    rows = []
    for round_no in range(1, repeat + 1):
        busy = wait_for_quiet(max_busy)
        for name, argv in cmds.items():
            run, verdict = one_run(name, argv, ckpt, out)
            rows.append(dict(meta, tool=name, round=round_no, seconds=f"{run.seconds:.3f}",
                             cpu_seconds=f"{run.cpu_seconds:.2f}", others_cpu_seconds=f"{run.others_cpu_seconds:.2f}",
                             peak_rss=run.peak_rss, peak_anon=run.peak_anon, exit=run.returncode, check=verdict,
                             busy_cpus_before=f"{busy:.2f}"))
            print(f"  round {round_no} {name}: {run.seconds:.2f} s, {run.cpu_seconds:.1f} CPU s, others "
                  f"{run.others_cpu_seconds:.1f} CPU s, peak RSS {size(run.peak_rss)}, RssAnon {size(run.peak_anon)}, "
                  f"exit {run.returncode}, check {verdict}", flush=True)
    return rows


def measure_checkpoint(ckpt: str, label: str, world_size: int, args: argparse.Namespace, tools: list[str],
                       date: str) -> list[dict]:
    input_bytes = sum(os.path.getsize(f) for f in rank_files(ckpt, world_size))
    print(f"{label} GB checkpoint, {world_size} ranks, {size(input_bytes)} of fp32 shards; tools: {', '.join(tools)}",
          flush=True)
    start = time.perf_counter()
    meta = dict(date=date, size=label, input_bytes=input_bytes, world_size=world_size)
    out = os.path.join(args.workdir, "out")
    rows = run_rounds(tool_commands(tools, ckpt, out, world_size), ckpt, out, args.repeat, meta, args.max_busy)
    print(f"  ({time.perf_counter() - start:.0f} s with warm-up and checks)", flush=True)
    return rows


def save_rows(path: str, new_rows: list[dict]) -> list[dict]:
    """Add the new runs to the CSV, replacing earlier runs of the same (size, world size); return all rows."""
    rows = []
    if os.path.isfile(path):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    replaced = {(str(r["size"]), str(r["world_size"])) for r in new_rows}
    rows = [r for r in rows if (r["size"], r["world_size"]) not in replaced] + [
        {k: str(v) for k, v in r.items()} for r in new_rows]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.25,1,3", help=f"GB of fp32 shards, from {', '.join(MODELS)} (default all)")
    parser.add_argument("--world-sizes", default="4", help="ranks, comma-separated (default 4)")
    parser.add_argument("--tools", default=None, help=TOOLS_HELP)
    parser.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--max-busy", type=float, default=0.5,
                        help="before each round, wait (up to 15 min) until the rest of the machine uses fewer CPUs than this")
    parser.add_argument("--workdir", default=os.path.join(HERE, "work"))
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    sizes, world_sizes = args.sizes.split(","), [int(w) for w in args.world_sizes.split(",")]
    tools = args.tools.split(",") if args.tools else default_tools()
    for label in sizes:
        if label not in MODELS:
            raise SystemExit(f"--sizes: {label!r} is not one of {', '.join(MODELS)}")
    os.makedirs(args.results, exist_ok=True)
    csv_path = os.path.join(args.results, "compare.csv")
    date = datetime.date.today().isoformat()
    per_rank, notes = [RANK_MEMORY_GUESS], []
    all_rows = save_rows(csv_path, [])
    for world_size in sorted(world_sizes):
        fits = True
        for label in sizes:
            ckpt = ensure_checkpoint(args.workdir, label, world_size, per_rank)
            if ckpt is None:
                notes.append(f"{label} GB at {world_size} ranks: not generated (see the log); larger world sizes skipped")
                fits = False
                break
            rows = measure_checkpoint(ckpt, label, world_size, args, tools, date)
            all_rows = save_rows(csv_path, rows)  # after each checkpoint, so a later failure loses nothing
        if not fits:
            break
    text = report.render(all_rows, args.results, notes)
    print("\n" + text)


if __name__ == "__main__":
    main()
