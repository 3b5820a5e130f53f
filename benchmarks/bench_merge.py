"""Time `fsdpfast merge` engines on a ~3.8 GB real 4-rank FSDP2 fp32 checkpoint, beside the I/O floor.

For each output dtype (bf16, keep), each run as its own subprocess:
  floor-mmap / floor-pwrite  benchmarks/io_floor.py: python with torch imported, reading every
                             shard byte and writing the merged output's size with one thread per
                             core, output written through a mapping / with pwrite, then fsync.
                             The floor of a round is the faster of the two.
  cpu, torch, ...            python -m fsdpfast merge CKPT --out OUT --dtype D --engine E
and `cp` + `sync` of the same shard files, for reference.

Each command runs once untimed as a warm-up, so the inputs are warm in the page cache (it
cannot be dropped without root); then `--repeat` rounds run every command in turn, so each
ratio compares runs made side by side. Wall time is time.perf_counter around the subprocess;
CPU time is its user + sys (getrusage), and the CPU time the rest of the machine used
meanwhile (psutil.cpu_times) is shown so contention from other jobs is visible. Every ~20 ms
/proc/<pid>/status of the process and all its children is read; peak RSS and peak RssAnon
are the largest sums over that tree. Between runs the output is deleted and dirty pages are
flushed (os.sync), untimed.

    python benchmarks/bench_merge.py [--workdir benchmarks/work] [--repeat 3] [--engines cpu,torch]
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_checkpoint import make_checkpoint, rank_files  # noqa: E402

WORLD_SIZE = 4
SAMPLE_SECONDS = 0.02
HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Run:
    seconds: float
    cpu_seconds: float  # user + sys of the process and the children it waited for
    peak_rss: int  # bytes
    peak_anon: int  # bytes
    engine: str  # as the merge reports it; "-" for cp
    others_cpu_seconds: float  # CPU time the rest of the machine used meanwhile (other work, kernel writeback)


DTYPES = ("bf16", "keep")


def output_bytes(ckpt: str, dtype: str) -> int:
    """Bytes of tensor data a merge writes (from the plan: metadata only)."""
    from fsdpfast import plan_merge
    from fsdpfast.layout import tensor_nbytes

    return sum(tensor_nbytes(t) for t in plan_merge(ckpt, dtype=dtype).tensors)


def commands(ckpt: str, out: str, engines: list[str]) -> dict[str, list[str]]:
    """name -> argv; names are "<dtype> <what>" so the table can pair each merge with its floor."""
    files = rank_files(ckpt, WORLD_SIZE)
    copies = [os.path.join(out, os.path.basename(f)) for f in files]
    copy_and_sync = f"mkdir -p {shlex.quote(out)} && cp {shlex.join(files)} {shlex.quote(out)}/ && sync {shlex.join(copies)}"
    cmds = {"cp": ["sh", "-c", copy_and_sync]}
    floor = [sys.executable, os.path.join(HERE, "io_floor.py"), os.path.join(out, "floor.bin")]
    for dtype in DTYPES:
        size = str(output_bytes(ckpt, dtype))
        for mode in ("mmap", "pwrite"):
            cmds[f"{dtype} floor-{mode}"] = ["sh", "-c", f"mkdir -p {shlex.quote(out)} && exec {shlex.join(floor + [size, *files, '--write', mode])}"]
        for engine in engines:
            cmds[f"{dtype} {engine}"] = [sys.executable, "-m", "fsdpfast", "merge", ckpt, "--out", out, "--overwrite",
                                         "--dtype", dtype, "--engine", engine]
    return cmds


def status_bytes(pid: int) -> tuple[int, int]:
    """VmRSS and RssAnon of one process, in bytes (0, 0 if it is gone)."""
    rss = anon = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return rss, anon


def tree_pids(pid: int) -> list[int]:
    try:
        return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def sample_peaks(pid: int, done: threading.Event, peaks: list[int]) -> None:
    """Keep in `peaks` the largest summed RSS and RssAnon of `pid`'s tree until `done` is set."""
    while not done.is_set():
        totals = [status_bytes(p) for p in tree_pids(pid)]
        peaks[0] = max(peaks[0], sum(t[0] for t in totals))
        peaks[1] = max(peaks[1], sum(t[1] for t in totals))
        done.wait(SAMPLE_SECONDS)


def cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def machine_busy_seconds() -> float:
    """CPU time all processes and the kernel have used since boot, summed over the CPUs."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def run_measured(argv: list[str]) -> Run:
    peaks, done = [0, 0], threading.Event()
    busy_before, cpu_before = machine_busy_seconds(), cpu_seconds(resource.RUSAGE_CHILDREN)
    self_before = cpu_seconds(resource.RUSAGE_SELF)  # this script, the sampler included
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sampler = threading.Thread(target=sample_peaks, args=(proc.pid, done, peaks))
    sampler.start()
    stdout, stderr = proc.communicate()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{stderr.decode()}")
    engine = re.search(r"with the (\S+) engine", stdout.decode())
    used = cpu_seconds(resource.RUSAGE_CHILDREN) - cpu_before
    others = machine_busy_seconds() - busy_before - used - (cpu_seconds(resource.RUSAGE_SELF) - self_before)
    return Run(seconds, used, peaks[0], peaks[1], engine[1] if engine else "-", others)


def clean(out: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    os.sync()


def run_all(cmds: dict[str, list[str]], out: str, repeat: int) -> dict[str, list[Run]]:
    for argv in cmds.values():  # warm-up: page cache, bytecode caches
        clean(out)
        run_measured(argv)
    runs: dict[str, list[Run]] = {name: [] for name in cmds}
    for round_no in range(repeat):
        for name, argv in cmds.items():
            clean(out)
            run = run_measured(argv)
            runs[name].append(run)
            print(f"round {round_no + 1} {name}: {run.seconds:.2f} s, {run.cpu_seconds:.1f} CPU s, engine {run.engine}, "
                  f"others used {run.others_cpu_seconds:.1f} CPU s", flush=True)
    clean(out)
    return runs


def shorten(argv: list[str], ckpt: str, out: str) -> str:
    """A command line with the work folder's paths written as CKPT and OUT."""
    return shlex.join(argv).replace(ckpt, "CKPT").replace(out, "OUT").replace(sys.executable, "python")


def size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.0f} MB"


def floor_seconds(runs: dict[str, list[Run]], dtype: str) -> list[float]:
    """Per round, the faster of the two floor variants."""
    return [min(a.seconds, b.seconds) for a, b in zip(runs[f"{dtype} floor-mmap"], runs[f"{dtype} floor-pwrite"])]


def table(runs: dict[str, list[Run]], input_bytes: int, shown_commands: dict[str, str]) -> str:
    gb = 1e9
    rounds = len(runs["cp"])
    lines = [
        f"Merge of a {input_bytes / gb:.2f} GB fp32 4-rank FSDP2 checkpoint; inputs warm in the page cache; "
        f"{rounds} rounds; {os.cpu_count()} CPUs. Ratios are per round (runs made side by side), median first. "
        "\"others CPU s\": CPU time the rest of the machine used during the run (other jobs, kernel writeback).",
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
            lines.append(f"- {dtype}: torch engine / native cpu engine = {ratios(torch_secs, cpu_secs)}; "
                         f"native cpu engine / floor = {ratios(cpu_secs, floor_seconds(runs, dtype))}")
    lines += ["", "Commands:"] + [f"- {name}: `{command}`" for name, command in shown_commands.items()]
    return "\n".join(lines) + "\n"


def ratios(values: list[float], bases: list[float]) -> str:
    per_round = [v / b for v, b in zip(values, bases)]
    return f"{statistics.median(per_round):.2f} (" + ", ".join(f"{r:.2f}" for r in per_round) + ")"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=os.path.join(HERE, "work"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--engines", default="cpu,torch", help="comma-separated merge engines to run (default cpu,torch)")
    args = parser.parse_args()
    ckpt, out = os.path.join(args.workdir, "ckpt_3gb"), os.path.join(args.workdir, "out")
    start = time.perf_counter()
    if make_checkpoint(ckpt, WORLD_SIZE):
        print(f"generated {ckpt} in {time.perf_counter() - start:.1f} s", flush=True)
    input_bytes = sum(os.path.getsize(f) for f in rank_files(ckpt, WORLD_SIZE))
    cmds = commands(ckpt, out, args.engines.split(","))
    runs = run_all(cmds, out, args.repeat)
    text = table(runs, input_bytes, {name: shorten(argv, ckpt, out) for name, argv in cmds.items()})
    merges = [n for n in runs if n.startswith("bf16") and "floor" not in n]
    bf16_anon = max(r.peak_anon for n in merges for r in runs[n])
    text += f"\nbf16 merges' peak RssAnon {size(bf16_anon)}: {'under' if bf16_anon < 1e9 else 'NOT under'} 1 GB\n"
    print("\n" + text)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "merge_3gb.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
