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
side. Before each round the script waits until the rest of the machine is quiet; a round during
which other jobs used more than --max-busy CPUs on average is run again (at most --repeat times
in all). Each run is measured by benchmarks/measure.py (time.perf_counter around the process;
user + sys CPU; CPU the rest of the machine used meanwhile; peak RSS and RssAnon summed over the
process tree, read from /proc every ~20 ms). After each run, untimed, benchmarks/check_merged.py
compares the output with the unsharded model bit for bit (a failure is a table entry, not a
crash); then the output is deleted and dirty pages flushed (os.sync), so one tool's output is on
disk at a time. fsdpfast and the floor fsync their output inside the timed run; the baselines
(save_pretrained) do not, so their timings leave out writing back to disk.

Results: benchmarks/results/compare.csv (one row per run; running a (size, world size) pair again
replaces its rows), and compare.md and compare_*.png drawn from the whole CSV (benchmarks/report.py).

    python benchmarks/compare.py [--sizes 0.25,1,3] [--world-sizes 4] [--tools ...] [--repeat 3]
    python benchmarks/compare.py --sizes 1 --world-sizes 2,4,8,16,32,64      # throughput vs ranks
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402
from bench_merge import output_bytes  # noqa: E402
from make_checkpoint import checkpoint_exists, rank_files  # noqa: E402
from measure import Run, clean, run_measured, size, wait_for_quiet  # noqa: E402

MODELS = {
    "0.25": dict(hidden=768, layers=2, intermediate=2048, vocab=32000, heads=12),
    "1": dict(hidden=1536, layers=5, intermediate=4608, vocab=32000, heads=12),
    "3": dict(hidden=2048, layers=12, intermediate=5632, vocab=32000, heads=16),
}
TOOLS_HELP = (
    "comma-separated, in run order: fsdpfast-cpu, fsdpfast-torch, fsdpfast-cuda (with a GPU), guide, "
    "verl-style, floor (default: every fsdpfast engine available here, then guide, verl-style, floor). "
    "DCP folders against torch's dcp_to_torch_save, and HuggingFaceStorageWriter folders against torch's "
    "consolidate_safetensors_files: benchmarks/compare_dcp.py."
)
FIELDS = [
    "date",
    "fsdpfast",
    "size",
    "input_bytes",
    "world_size",
    "tool",
    "round",
    "seconds",
    "cpu_seconds",
    "others_cpu_seconds",
    "peak_rss",
    "peak_anon",
    "exit",
    "check",
    "busy_cpus_before",
]
RANK_MEMORY_GUESS = 100e6  # bytes a forked generating rank costs beyond its shard, until a generation is measured


def fsdpfast_version() -> str:
    """The commit of the fsdpfast tree measured, with a digest of any uncommitted change to fsdpfast/ or csrc/."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", os.path.dirname(HERE), *args], capture_output=True, text=True
        ).stdout.strip()

    diff = git("diff", "HEAD", "--", "fsdpfast", "csrc") + git(
        "ls-files", "--others", "--exclude-standard", "--", "fsdpfast", "csrc"
    )
    return git("rev-parse", "--short", "HEAD") + (
        f"+dirty-{hashlib.sha1(diff.encode()).hexdigest()[:8]}" if diff else ""
    )


def available_tools() -> list[str]:
    """Every tool this machine can run, in the default order: fsdpfast's engines, fastest first, then the others."""
    from fsdpfast.execute.engines import available_engines

    return [f"fsdpfast-{e}" for e in available_engines()] + ["guide", "verl-style", "floor"]


def chosen_tools(option: str | None) -> list[str]:
    """The --tools list, less fsdpfast engines this machine lacks (said, not fatal); unknown names are an error."""
    available = available_tools()
    if option is None:
        return available
    tools = option.split(",")
    for tool in tools:
        if tool not in available and tool not in ("fsdpfast-cpu", "fsdpfast-torch", "fsdpfast-cuda"):
            raise SystemExit(f"--tools: unknown tool {tool!r}; {TOOLS_HELP}")
        if tool not in available:
            print(f"{tool}: that engine is not available here; skipped", flush=True)
    return [tool for tool in tools if tool in available]


def verl_available() -> bool:
    return importlib.util.find_spec("verl") is not None


def tool_commands(tools: list[str], ckpt: str, out: str, world_size: int) -> dict[str, list[str]]:
    """run name -> argv. `floor` gives two runs, floor-mmap and floor-pwrite."""
    python = sys.executable
    cmds = {}
    for tool in tools:
        if tool.startswith("fsdpfast-"):
            cmds[tool] = [
                python,
                "-m",
                "fsdpfast",
                "merge",
                ckpt,
                "--out",
                out,
                "--dtype",
                "bf16",
                "--engine",
                tool.removeprefix("fsdpfast-"),
            ]
        elif tool == "guide":
            cmds[tool] = [python, os.path.join(HERE, "baselines", "guide.py"), ckpt, out]
        elif tool == "verl-style" and verl_available():
            cmds["verl"] = [
                python,
                "-m",
                "verl.model_merger",
                "merge",
                "--backend",
                "fsdp",
                "--local_dir",
                ckpt,
                "--target_dir",
                out,
            ]
        elif tool == "verl-style":
            cmds[tool] = [python, os.path.join(HERE, "baselines", "verl_style.py"), ckpt, out]
        elif tool == "floor":
            floor = [
                python,
                os.path.join(HERE, "io_floor.py"),
                os.path.join(out, "floor.bin"),
                str(output_bytes(ckpt, "bf16")),
                *rank_files(ckpt, world_size),
            ]
            for mode in ("mmap", "pwrite"):
                cmds[f"floor-{mode}"] = ["sh", "-c", 'mkdir -p "$0" && exec "$@"', out, *floor, "--write", mode]
    return cmds


def check_output(ckpt: str, out: str) -> str:
    """The bit-for-bit verdict on a merged folder, from its own process: 'ok: ...' or 'FAIL: ...'."""
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "check_merged.py"), ckpt, out], capture_output=True, text=True
    )
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else f"FAIL: checker exited {done.returncode}: {done.stderr.strip()[-200:]}"


def model_bytes(label: str) -> int:
    """fp32 bytes of a Llama-like model of MODELS[label] (embeddings and head untied)."""
    m = MODELS[label]
    hidden, mlp = m["hidden"], m["intermediate"]
    layer = 4 * hidden * hidden + 3 * hidden * mlp + 2 * hidden
    return 4 * (2 * m["vocab"] * hidden + m["layers"] * layer + hidden)


def ensure_checkpoint(workdir: str, label: str, world_size: int, per_rank: list[float]) -> str | None:
    """The checkpoint's folder, written now if missing; None if its ranks would not fit in memory.

    The ranks are forked from one parent that imported torch and transformers, so they share
    those pages; together they hold the model once, plus `per_rank[0]` bytes each (the most
    seen so far, updated here).
    """
    ckpt = os.path.join(workdir, f"ckpt_{label}gb_w{world_size}")
    if checkpoint_exists(ckpt, world_size):
        return ckpt
    need, available = model_bytes(label) + world_size * per_rank[0], psutil.virtual_memory().available
    if need > 0.8 * available:
        print(
            f"{world_size} ranks need about {size(need)} to generate (the model, and {size(per_rank[0])} per rank), "
            f"{size(available)} available: skipped",
            flush=True,
        )
        return None
    argv = [
        sys.executable,
        os.path.join(HERE, "make_checkpoint.py"),
        ckpt,
        "--world-size",
        str(world_size),
        "--start-method",
        "fork",
        *[arg for key, value in MODELS[label].items() for arg in (f"--{key}", str(value))],
    ]
    run = run_measured(argv)
    if run.returncode != 0:
        print(f"generating {ckpt} failed ({run.returncode}): {run.stderr.strip()[-500:]}", flush=True)
        return None
    cost = available - run.low_available
    per_rank[0] = max(per_rank[0], (cost - model_bytes(label)) / world_size)
    print(
        f"generated {ckpt}: {run.stdout.strip()}; the machine's available memory fell by {size(cost)} at most "
        f"(the ranks' RssAnon summed: {size(run.peak_anon)}, shared pages counted in each)",
        flush=True,
    )
    return ckpt


def error_line(stderr: str) -> str:
    """The line of a failed run's stderr that names the error (a traceback's 'XxxError: ...'), else its last line."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"\w*(Error|Exception)\b", line)]
    return (errors or lines or ["(no stderr)"])[-1]


def one_run(name: str, argv: list[str], ckpt: str, out: str) -> tuple[Run, str]:
    """Measure one run, then (untimed) check its output and delete it."""
    clean(out)
    run = run_measured(argv)
    if name.startswith("floor"):
        verdict = "-"
    elif run.returncode != 0:
        verdict = f"FAIL: exit {run.returncode}: {error_line(run.stderr)[:160]}"
    else:
        verdict = check_output(ckpt, out)
    clean(out)
    return run, verdict


def one_round(cmds: dict[str, list[str]], ckpt: str, out: str, meta: dict) -> list[dict]:
    rows = []
    for name, argv in cmds.items():
        run, verdict = one_run(name, argv, ckpt, out)
        rows.append(
            dict(
                meta,
                tool=name,
                seconds=f"{run.seconds:.3f}",
                cpu_seconds=f"{run.cpu_seconds:.2f}",
                others_cpu_seconds=f"{run.others_cpu_seconds:.2f}",
                peak_rss=run.peak_rss,
                peak_anon=run.peak_anon,
                exit=run.returncode,
                check=verdict,
            )
        )
        print(
            f"  round {meta['round']} {name}: {run.seconds:.2f} s, {run.cpu_seconds:.1f} CPU s, others "
            f"{run.others_cpu_seconds:.1f} CPU s, peak RSS {size(run.peak_rss)}, RssAnon {size(run.peak_anon)}, "
            f"exit {run.returncode}, check {verdict}",
            flush=True,
        )
    return rows


def disturbed(rows: list[dict], max_busy: float) -> list[str]:
    """The runs of a round during which the rest of the machine used more than `max_busy` CPUs on average."""
    return [r["tool"] for r in rows if float(r["others_cpu_seconds"]) > max_busy * float(r["seconds"])]


def run_rounds(cmds: dict[str, list[str]], ckpt: str, out: str, repeat: int, meta: dict, max_busy: float) -> list[dict]:
    """Warm up, then `repeat` rounds; a round disturbed by other jobs is run again (at most `repeat` times in all)."""
    for argv in cmds.values():  # warm-up: page cache, imports; untimed
        clean(out)
        run_measured(argv)
    rows, redone = [], 0
    while len(rows) < repeat * len(cmds):
        busy = wait_for_quiet(max_busy)
        round_rows = one_round(
            cmds, ckpt, out, dict(meta, round=len(rows) // len(cmds) + 1, busy_cpus_before=f"{busy:.2f}")
        )
        noisy = disturbed(round_rows, max_busy)
        if noisy and redone < repeat:
            redone += 1
            print(f"  round run again: other jobs used over {max_busy} CPUs during {', '.join(noisy)}", flush=True)
            continue
        rows += round_rows
    return rows


def measure_checkpoint(
    ckpt: str, label: str, world_size: int, args: argparse.Namespace, tools: list[str], date: str
) -> list[dict]:
    input_bytes = sum(os.path.getsize(f) for f in rank_files(ckpt, world_size))
    print(
        f"{label} GB checkpoint, {world_size} ranks, {size(input_bytes)} of fp32 shards; tools: {', '.join(tools)}",
        flush=True,
    )
    start = time.perf_counter()
    meta = dict(date=date, fsdpfast=fsdpfast_version(), size=label, input_bytes=input_bytes, world_size=world_size)
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
        {k: str(v) for k, v in r.items()} for r in new_rows
    ]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="0.25,1,3", help=f"GB of fp32 shards, from {', '.join(MODELS)} (default all)"
    )
    parser.add_argument("--world-sizes", default="4", help="ranks, comma-separated (default 4)")
    parser.add_argument("--tools", default=None, help=TOOLS_HELP)
    parser.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    parser.add_argument(
        "--max-busy",
        type=float,
        default=0.5,
        help="CPUs other jobs may use: before each round, wait (up to 15 min) until they use fewer; "
        "a round during which they used more is run again (default 0.5)",
    )
    parser.add_argument("--workdir", default=os.path.join(HERE, "work"))
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    sizes, world_sizes = args.sizes.split(","), [int(w) for w in args.world_sizes.split(",")]
    tools = chosen_tools(args.tools)
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
                notes.append(
                    f"{label} GB at {world_size} ranks: not generated (see the log); larger world sizes skipped"
                )
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
