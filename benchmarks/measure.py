"""Measure one command as its own process: wall time, CPU time, peak memory of its process tree.

Wall time is time.perf_counter around the subprocess; CPU time is its user + sys (getrusage of
the children waited for). The CPU time the rest of the machine used meanwhile (psutil.cpu_times,
less the command's and this process's own) is kept too, so contention from other jobs shows.
Every ~20 ms /proc/<pid>/status of the process and all its descendants is read; peak RSS and
peak RssAnon are the largest sums over that tree, and the machine's lowest MemAvailable is kept
too (what the run really cost in memory, shared pages counted once, other jobs included).
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass

import psutil

SAMPLE_SECONDS = 0.02


@dataclass
class Run:
    seconds: float
    cpu_seconds: float  # user + sys of the process and the children it waited for
    peak_rss: int  # bytes, summed over the process tree
    peak_anon: int  # bytes, summed over the process tree
    others_cpu_seconds: float  # CPU time the rest of the machine used meanwhile (other work, kernel writeback)
    returncode: int
    stdout: str
    stderr: str
    low_available: int = 0  # bytes: the machine's lowest MemAvailable during the run


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
    """Keep in `peaks` the largest summed RSS and RssAnon of `pid`'s tree, and the machine's lowest
    MemAvailable, until `done` is set."""
    while not done.is_set():
        totals = [status_bytes(p) for p in tree_pids(pid)]
        peaks[0] = max(peaks[0], sum(t[0] for t in totals))
        peaks[1] = max(peaks[1], sum(t[1] for t in totals))
        peaks[2] = min(peaks[2], psutil.virtual_memory().available)
        done.wait(SAMPLE_SECONDS)


def cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def machine_busy_seconds() -> float:
    """CPU time all processes and the kernel have used since boot, summed over the CPUs."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def run_measured(argv: list[str]) -> Run:
    """Run `argv` to completion and measure it; a failure is recorded in the Run, not raised."""
    peaks, done = [0, 0, psutil.virtual_memory().available], threading.Event()
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
    used = cpu_seconds(resource.RUSAGE_CHILDREN) - cpu_before
    others = machine_busy_seconds() - busy_before - used - (cpu_seconds(resource.RUSAGE_SELF) - self_before)
    return Run(
        seconds,
        used,
        peaks[0],
        peaks[1],
        others,
        proc.returncode,
        stdout.decode(errors="replace"),
        stderr.decode(errors="replace"),
        peaks[2],
    )


def clean(out: str) -> None:
    """Remove a run's output and flush dirty pages, so the next run starts from the same state."""
    shutil.rmtree(out, ignore_errors=True)
    os.sync()


def busy_cores(seconds: float = 3.0) -> float:
    """How many CPUs the machine kept busy over the next `seconds` (this process is idle meanwhile)."""
    before = machine_busy_seconds()
    time.sleep(seconds)
    return (machine_busy_seconds() - before) / seconds


def wait_for_quiet(max_busy: float = 0.5, max_wait: float = 900.0, poll: float = 15.0) -> float:
    """Wait until the rest of the machine uses under `max_busy` CPUs (at most `max_wait` s).

    Returns the busy CPUs last seen; says what is running while it waits.
    """
    deadline = time.monotonic() + max_wait
    busy = busy_cores()
    while busy >= max_busy and time.monotonic() < deadline:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(
            f"  machine busy ({busy:.2f} CPUs, load {load}): waiting for a quiet spell; busiest: {busiest()}",
            flush=True,
        )
        time.sleep(poll)
        busy = busy_cores()
    if busy >= max_busy:
        print(f"  still busy ({busy:.2f} CPUs) after {max_wait:.0f} s: measuring anyway", flush=True)
    return busy


def busiest(count: int = 3) -> str:
    """The processes that used the most CPU over the last second, as 'pid command'."""
    procs = list(psutil.process_iter(["pid", "cmdline", "name"]))
    for p in procs:
        try:
            p.cpu_percent()
        except psutil.Error:
            pass
    time.sleep(1.0)
    used = []
    for p in procs:
        try:
            used.append((p.cpu_percent(), p.info["pid"], " ".join(p.info["cmdline"] or [p.info["name"] or "?"])[:70]))
        except psutil.Error:
            pass
    return "; ".join(f"{pid} ({pct:.0f}%) {cmd}" for pct, pid, cmd in sorted(used, reverse=True)[:count])


def size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.0f} MB"


def ratios(values: list[float], bases: list[float]) -> str:
    """Per-round ratios, median first: '1.23 (1.20, 1.23, 1.31)'."""
    per_round = [v / b for v, b in zip(values, bases)]
    return f"{statistics.median(per_round):.2f} (" + ", ".join(f"{r:.2f}" for r in per_round) + ")"
