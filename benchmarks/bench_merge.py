"""Time `fsdpfast merge` on a ~3.8 GB real 4-rank FSDP2 fp32 checkpoint against a plain copy.

Three commands, each run as its own subprocess:
  bf16  python -m fsdpfast merge CKPT --out OUT --dtype bf16 --overwrite   (writes ~1.9 GB)
  keep  python -m fsdpfast merge CKPT --out OUT --dtype keep --overwrite   (writes ~3.8 GB)
  cp    cp RANK_FILES SCRATCH && sync SCRATCH_FILES   (the copy floor; the merge fsyncs too)

Each command runs once untimed as a warm-up, so the inputs are warm in the page cache (it
cannot be dropped without root); then `--repeat` rounds run cp, bf16, keep in turn. Wall time
is time.perf_counter around the subprocess; CPU time is its user + sys (getrusage), and the
CPU time the rest of the machine used meanwhile (psutil.cpu_times) is shown so contention
from other jobs is visible. Every ~20 ms /proc/<pid>/status of the process and all its
children is read; peak RSS and peak RssAnon are the largest sums over that tree. Between
runs the output is deleted and dirty pages are flushed (os.sync), untimed.

    python benchmarks/bench_merge.py [--workdir benchmarks/work] [--repeat 3]
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


def commands(ckpt: str, out: str, engine: str | None) -> dict[str, list[str]]:
    merge = [sys.executable, "-m", "fsdpfast", "merge", ckpt, "--out", out, "--overwrite"]
    merge += ["--engine", engine] if engine else []
    files = rank_files(ckpt, WORLD_SIZE)
    copies = [os.path.join(out, os.path.basename(f)) for f in files]
    copy_and_sync = f"mkdir -p {shlex.quote(out)} && cp {shlex.join(files)} {shlex.quote(out)}/ && sync {shlex.join(copies)}"
    return {
        "cp": ["sh", "-c", copy_and_sync],
        "bf16": merge + ["--dtype", "bf16"],
        "keep": merge + ["--dtype", "keep"],
    }


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


def table(runs: dict[str, list[Run]], input_bytes: int, shown_commands: dict[str, str]) -> str:
    gb = 1e9
    lines = [
        f"Merge of a {input_bytes / gb:.2f} GB fp32 4-rank FSDP2 checkpoint; inputs warm in the page cache; "
        f"{len(runs['cp'])} rounds; {os.cpu_count()} CPUs. \"others CPU s\": CPU time the rest of the machine "
        "used during the run (other jobs and kernel writeback), so contention shows.",
        "",
        "| command | engine | wall s, median (min–max) | input GB/s | CPU s, median | others CPU s, median "
        "| peak RSS | peak RssAnon | ratio to cp, per round |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        secs = [r.seconds for r in rs]
        median = statistics.median(secs)
        ratios = ", ".join(f"{r.seconds / c.seconds:.2f}" for r, c in zip(rs, runs["cp"]))
        engines = ", ".join(sorted({r.engine for r in rs}))
        cpu = statistics.median(r.cpu_seconds for r in rs)
        others = statistics.median(r.others_cpu_seconds for r in rs)
        lines.append(
            f"| {name} | {engines} | {median:.2f} ({min(secs):.2f}–{max(secs):.2f}) | {input_bytes / median / gb:.2f} "
            f"| {cpu:.1f} | {others:.1f} | {size(max(r.peak_rss for r in rs))} | {size(max(r.peak_anon for r in rs))} | {ratios} |"
        )
    lines += ["", "Commands:"] + [f"- {name}: `{command}`" for name, command in shown_commands.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=os.path.join(HERE, "work"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--engine", default=None, help="pass --engine to the merges (default: theirs, auto)")
    args = parser.parse_args()
    ckpt, out = os.path.join(args.workdir, "ckpt_3gb"), os.path.join(args.workdir, "out")
    start = time.perf_counter()
    if make_checkpoint(ckpt, WORLD_SIZE):
        print(f"generated {ckpt} in {time.perf_counter() - start:.1f} s", flush=True)
    input_bytes = sum(os.path.getsize(f) for f in rank_files(ckpt, WORLD_SIZE))
    cmds = commands(ckpt, out, args.engine)
    runs = run_all(cmds, out, args.repeat)
    text = table(runs, input_bytes, {name: shorten(argv, ckpt, out) for name, argv in cmds.items()})
    bf16_anon = max(r.peak_anon for r in runs["bf16"])
    text += f"\nbf16 merge peak RssAnon {size(bf16_anon)}: {'under' if bf16_anon < 1e9 else 'NOT under'} 1 GB\n"
    print("\n" + text)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "merge_3gb.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
