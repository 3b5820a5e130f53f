"""Time `fsdpfast merge` engines on a ~3.8 GB real 4-rank FSDP2 fp32 checkpoint, beside the I/O floor.

For each output dtype (bf16, keep), each run as its own subprocess:
  floor-mmap / floor-pwrite  benchmarks/io_floor.py: python with torch imported, reading every
                             shard byte and writing the merged output's size with one thread per
                             core, output written through a mapping / with pwrite, then fsync.
                             The floor of a round is the faster of the two.
  cpu, torch, ...            python -m fsdpfast merge CKPT --out OUT --dtype D --engine E
and `cp` + `sync` of the same shard files, for reference.

Each command runs once untimed as a warm-up, so the inputs are warm in the page cache; then
`--repeat` rounds run every command in turn, so each ratio compares runs made side by side.
`--cold`: before every timed run the rank files' cached pages are dropped
(posix_fadvise(DONTNEED), which needs no root; the kernel may keep a few), so every command,
floor and `cp` included, reads from the disk. Wall time is time.perf_counter around the subprocess;
CPU time is its user + sys (getrusage), and the CPU time the rest of the machine used
meanwhile (psutil.cpu_times) is shown so contention from other jobs is visible. Every ~20 ms
/proc/<pid>/status of the process and all its children is read; peak RSS and peak RssAnon
are the largest sums over that tree. Between runs the output is deleted and dirty pages are
flushed (os.sync), untimed. The measuring code is in benchmarks/measure.py.

    python benchmarks/bench_merge.py [--workdir benchmarks/work] [--repeat 3] [--engines cpu,torch]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_checkpoint import make_checkpoint, rank_files  # noqa: E402
from measure import Run, clean, ratios, run_measured, size  # noqa: E402

WORLD_SIZE = 4
HERE = os.path.dirname(os.path.abspath(__file__))
DTYPES = ("bf16", "keep")


def output_bytes(ckpt: str, dtype: str) -> int:
    """Bytes of tensor data a merge writes (from the plan: metadata only)."""
    from fsdpfast import plan_merge
    from fsdpfast.plan.layout import tensor_nbytes

    return sum(tensor_nbytes(t) for t in plan_merge(ckpt, dtype=dtype).tensors)


def commands(ckpt: str, out: str, engines: list[str]) -> dict[str, list[str]]:
    """name -> argv; names are "<dtype> <what>" so the table can pair each merge with its floor."""
    files = rank_files(ckpt, WORLD_SIZE)
    copies = [os.path.join(out, os.path.basename(f)) for f in files]
    copy_and_sync = (
        f"mkdir -p {shlex.quote(out)} && cp {shlex.join(files)} {shlex.quote(out)}/ && sync {shlex.join(copies)}"
    )
    cmds = {"cp": ["sh", "-c", copy_and_sync]}
    floor = [sys.executable, os.path.join(HERE, "io_floor.py"), os.path.join(out, "floor.bin")]
    for dtype in DTYPES:
        nbytes = str(output_bytes(ckpt, dtype))
        for mode in ("mmap", "pwrite"):
            cmds[f"{dtype} floor-{mode}"] = [
                "sh",
                "-c",
                f"mkdir -p {shlex.quote(out)} && exec {shlex.join(floor + [nbytes, *files, '--write', mode])}",
            ]
        for engine in engines:
            cmds[f"{dtype} {engine}"] = [
                sys.executable,
                "-m",
                "fsdpfast",
                "merge",
                ckpt,
                "--out",
                out,
                "--overwrite",
                "--dtype",
                dtype,
                "--engine",
                engine,
            ]
    return cmds


def run_checked(argv: list[str]) -> tuple[Run, str]:
    """Measure `argv`, which must succeed; also return the engine the merge reports ("-" for others)."""
    run = run_measured(argv)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({run.returncode}):\n{run.stderr}")
    engine = re.search(r"with the (\S+) engine", run.stdout)
    return run, engine[1] if engine else "-"


def drop_cached(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_all(cmds: dict[str, list[str]], out: str, repeat: int, cold: list[str]) -> dict[str, list[Run]]:
    """Every command once untimed, then `repeat` rounds of all of them; `cold`: files to drop from the
    page cache before each timed run."""
    for argv in cmds.values():  # warm-up: page cache, bytecode caches
        clean(out)
        run_checked(argv)
    runs: dict[str, list[Run]] = {name: [] for name in cmds}
    for round_no in range(repeat):
        for name, argv in cmds.items():
            clean(out)
            drop_cached(cold)
            run, engine = run_checked(argv)
            runs[name].append(run)
            print(
                f"round {round_no + 1} {name}: {run.seconds:.2f} s, {run.cpu_seconds:.1f} CPU s, engine {engine}, "
                f"others used {run.others_cpu_seconds:.1f} CPU s",
                flush=True,
            )
    clean(out)
    return runs


def shorten(argv: list[str], ckpt: str, out: str) -> str:
    """A command line with the work folder's paths written as CKPT and OUT."""
    return shlex.join(argv).replace(ckpt, "CKPT").replace(out, "OUT").replace(sys.executable, "python")


def floor_seconds(runs: dict[str, list[Run]], dtype: str) -> list[float]:
    """Per round, the faster of the two floor variants."""
    return [min(a.seconds, b.seconds) for a, b in zip(runs[f"{dtype} floor-mmap"], runs[f"{dtype} floor-pwrite"])]


def table(runs: dict[str, list[Run]], input_bytes: int, shown_commands: dict[str, str], cold: bool) -> str:
    warmth = "dropped from the page cache before each run" if cold else "warm in the page cache"
    gb = 1e9
    rounds = len(runs["cp"])
    lines = [
        f"Merge of a {input_bytes / gb:.2f} GB fp32 4-rank FSDP2 checkpoint; inputs {warmth}; "
        f"{rounds} rounds; {os.cpu_count()} CPUs. Ratios are per round (runs made side by side), median first. "
        '"others CPU s": CPU time the rest of the machine used during the run (other jobs, kernel writeback).',
        "",
        "| command | wall s, median (min–max) | input GB/s | CPU s | others CPU s | peak RSS | peak RssAnon "
        "| ratio to the floor | ratio to cp |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        secs = [r.seconds for r in rs]
        median = statistics.median(secs)
        dtype = name.split()[0]
        to_floor = ratios(secs, floor_seconds(runs, dtype)) if dtype in DTYPES else "-"
        lines.append(
            f"| {name} | {median:.2f} ({min(secs):.2f}–{max(secs):.2f}) | {input_bytes / median / gb:.2f} "
            f"| {statistics.median(r.cpu_seconds for r in rs):.1f} | {statistics.median(r.others_cpu_seconds for r in rs):.1f} "
            f"| {size(max(r.peak_rss for r in rs))} | {size(max(r.peak_anon for r in rs))} "
            f"| {to_floor} | {ratios(secs, [c.seconds for c in runs['cp']])} |"
        )
    lines += ["", "Engines side by side (per round):", ""]
    for dtype in DTYPES:
        engines = [n.split()[1] for n in runs if n.startswith(dtype) and "floor" not in n.split()[1]]
        if "cpu" in engines and "torch" in engines:
            torch_secs = [r.seconds for r in runs[f"{dtype} torch"]]
            cpu_secs = [r.seconds for r in runs[f"{dtype} cpu"]]
            lines.append(
                f"- {dtype}: torch engine / native cpu engine = {ratios(torch_secs, cpu_secs)}; "
                f"native cpu engine / floor = {ratios(cpu_secs, floor_seconds(runs, dtype))}"
            )
    lines += ["", "Commands:"] + [f"- {name}: `{command}`" for name, command in shown_commands.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=os.path.join(HERE, "work"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="drop the rank files' cached pages before each run")
    parser.add_argument(
        "--engines", default="cpu,torch", help="comma-separated merge engines to run (default cpu,torch)"
    )
    args = parser.parse_args()
    ckpt, out = os.path.join(args.workdir, "ckpt_3gb"), os.path.join(args.workdir, "out")
    start = time.perf_counter()
    if make_checkpoint(ckpt, WORLD_SIZE):
        print(f"generated {ckpt} in {time.perf_counter() - start:.1f} s", flush=True)
    input_bytes = sum(os.path.getsize(f) for f in rank_files(ckpt, WORLD_SIZE))
    cmds = commands(ckpt, out, args.engines.split(","))
    runs = run_all(cmds, out, args.repeat, rank_files(ckpt, WORLD_SIZE) if args.cold else [])
    text = table(runs, input_bytes, {name: shorten(argv, ckpt, out) for name, argv in cmds.items()}, args.cold)
    merges = [n for n in runs if n.startswith("bf16") and "floor" not in n]
    bf16_anon = max(r.peak_anon for n in merges for r in runs[n])
    text += f"\nbf16 merges' peak RssAnon {size(bf16_anon)}: {'under' if bf16_anon < 1e9 else 'NOT under'} 1 GB\n"
    print("\n" + text)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "merge_3gb_cold.md" if args.cold else "merge_3gb.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
