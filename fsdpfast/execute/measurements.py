"""Engine timings recorded on this machine, which `--engine auto` follows.

For an offline merge the native cpu engine is the fastest unless a measurement on this machine
says otherwise: the cuda engine moves every byte disk -> pinned -> GPU -> pinned -> file for a cast
that costs the CPU about one instruction per byte. benchmarks/gpu_bench.py (run by
benchmarks/gpu_check.sh) times whole merges with every engine and records here, per kind of
job, the engine that won; `auto` takes it when the record is of this machine and that engine can
run here, and the cpu engine otherwise.

The record is a JSON file: $FSDPFAST_MEASUREMENTS, else $XDG_CACHE_HOME/fsdpfast/engine-measurements.json
(~/.cache/...). A job's kind is the dtype conversion that moves most of its bytes: "copy"
(--dtype keep, or a cast to the dtype already stored) or "float32->bfloat16" and the like.
"""

from __future__ import annotations

import json
import os
import time

from .. import _ops
from ..dtypes import itemsize

VERSION = 1
ENV = "FSDPFAST_MEASUREMENTS"
MARGIN = 0.05  # another engine replaces cpu only when measured this much faster: closer is noise


def path() -> str:
    if os.environ.get(ENV):
        return os.environ[ENV]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "fsdpfast", "engine-measurements.json")


def job_kind(tensors) -> str | None:
    """The conversion moving the most input bytes among the plan's tensors, or None for no data."""
    moved: dict[str, int] = {}
    for t in tensors:
        kind = "copy" if t.source_dtype == t.target_dtype else f"{t.source_dtype}->{t.target_dtype}"
        moved[kind] = moved.get(kind, 0) + t.numel * itemsize(t.source_dtype)
    return max(moved, key=moved.get) if moved else None


def this_machine(gpu: str | None = None) -> dict:
    return {"cpus": _ops.cpu_threads(), "gpu": gpu}


def fastest(seconds: dict[str, float]) -> str:
    """The engine to record for one kind of job: the quickest, cpu unless beaten by MARGIN."""
    best = min(seconds, key=seconds.get)
    if "cpu" in seconds and seconds[best] > (1 - MARGIN) * seconds["cpu"]:
        return "cpu"
    return best


def record(seconds: dict[str, dict[str, float]], gpu: str | None, where: str | None = None) -> str:
    """Write the record: `seconds[kind][engine]` measured on this machine (with the GPU named `gpu`)."""
    where = where or path()
    data = {
        "version": VERSION,
        "recorded": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": this_machine(gpu),
        "seconds": seconds,
        "fastest": {kind: fastest(times) for kind, times in seconds.items() if times},
    }
    os.makedirs(os.path.dirname(os.path.abspath(where)), exist_ok=True)
    temporary = f"{where}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(temporary, where)  # a reader sees the old record or the new one, never half of one
    return where


def recorded_engine(kind: str | None) -> str | None:
    """The engine recorded fastest for this kind of job on this machine, or None (no record, another
    machine's, or an unreadable one: auto must never fail a merge over a cache file)."""
    if kind is None:
        return None
    try:
        with open(path()) as f:
            data = json.load(f)
        machine = data["machine"]
        engine = data["fastest"].get(kind)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if data.get("version") != VERSION or not isinstance(machine, dict) or machine.get("cpus") != _ops.cpu_threads():
        return None
    if engine == "cuda" and gpu_name() not in (None, machine.get("gpu")):
        return None  # measured with another GPU (with none usable now, auto says so and takes cpu)
    return engine if engine in ("cpu", "cuda", "torch") else None


def gpu_name() -> str | None:
    """The visible GPU's name when the cuda engine can run here (imports torch then), else None."""
    if not _ops.native_cuda():
        return None
    import torch

    try:
        return torch.cuda.get_device_name(torch.cuda.current_device())
    except Exception:  # CUDA failing to start is the cuda engine's to report, not auto's
        return None
