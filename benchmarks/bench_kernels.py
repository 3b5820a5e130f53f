"""Micro-benchmarks of the native gather/convert kernels, per dtype pair and extent shape.

    python -m pytest benchmarks/bench_kernels.py --benchmark-only -p no:cacheprovider

(70 s on a quiet 2-core machine, 2-3 minutes on a busy one; the path must be given, since the project's pytest settings
collect only tests/). Each benchmark times one call that executes a whole plan, through one
of three front ends:

  op     fsdpfast._ops.gather_convert, the torch op: byte-view (uint8) tensors in memory, threads
         from torch's intra-op pool.
  file   fsdpfast._ops.native().gather_convert_to_file, the torch-free module the cpu engine runs:
         sources in memory, the output assembled in 8 MB per-thread chunks and written with pwrite
         into a temporary file that is emptied (ftruncate, untimed) before every round. Its time
         therefore includes the kernel's page-cache cost of allocating and filling new file pages,
         as a merge pays it; nothing is fsynced, so no disk I/O is timed.
  torch  dst.copy_(src) between typed tensors in memory: torch's own conversion, the reference
         for `op` (for many small extents, one copy_ per extent, as a Python merger does it).

Cases:
  PAIR-SIZE    one extent of SIZE source bytes (4 KB, 256 KB, 16 MB, 256 MB) for each dtype pair:
               f32->bf16, f32->f16, bf16->f32, f16->f32, bf16->f16 and copy-f32 (identity, memcpy).
  PAIR-small   10,000 extents of 1 KB of source each, into 10,000 destinations, in one call:
               a model with thousands of small tensors.
  PAIR-shard1  a 4096 x 4096 fp32 tensor sharded on dim 1 over 4 ranks (FSDP2 Shard(1)): four plan
               rows of 4096 strided runs of 1024 elements each.

Source data is N(0, 0.02) noise (weights-like). Destinations are touched before timing; each
benchmark runs one untimed warm-up round, then enough rounds for about 1.5 seconds. The `op`
result is checked against torch's copy_ bit for bit once per case.

GB/s = (bytes read + bytes written) / seconds per call, for the median round ("GB/s" in
extra_info, kept by --benchmark-json) and the fastest round ("GB/s best"; on a shared machine
the least disturbed). Both are printed as a table at the end of the run and written to
benchmarks/results/kernels.md.
"""

from __future__ import annotations

import os
import tempfile
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import pytest
import torch

from fsdpfast import _ops

pytestmark = pytest.mark.skipif(not (_ops.torch_ops() and _ops.native_cpu()), reason="native kernels not built")

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
TORCH_NAMES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}  # as _ops.code() spells them
PAIRS = {
    "f32->bf16": ("f32", "bf16"),
    "f32->f16": ("f32", "f16"),
    "bf16->f32": ("bf16", "f32"),
    "f16->f32": ("f16", "f32"),
    "bf16->f16": ("bf16", "f16"),
    "copy-f32": ("f32", "f32"),
}
SIZES = {"4KB": 4 << 10, "256KB": 256 << 10, "16MB": 16 << 20, "256MB": 256 << 20}
SMALL_EXTENTS, SMALL_EXTENT_BYTES = 10_000, 1 << 10
SHARD1_SIDE, SHARD1_RANKS = 4096, 4
CHUNK_BYTES = 8 << 20  # the cpu engine's per-thread chunk (fsdpfast/execute/cpu.py)
ROUND_SECONDS, MIN_ROUND_SECONDS = 1.5, 1e-4
FRONT_ENDS = ("op", "file", "torch")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "kernels.md")


@dataclass
class Case:
    """One plan: byte sources, destination sizes, kernel rows, and the same work done by torch."""

    sources: list[torch.Tensor]  # uint8
    destination_sizes: list[int]  # bytes
    rows: list[list[int]]  # csrc/plan_rows.h columns
    torch_copy: Callable[[list[torch.Tensor]], None]  # fills uint8 destinations with copy_

    @property
    def bytes_moved(self) -> int:
        return sum(s.numel() for s in self.sources) + sum(self.destination_sizes)


# --- building cases -------------------------------------------------------------------------

_SOURCE_CACHE: dict[tuple[str, int], torch.Tensor] = {}


def weights(dtype: str, nbytes: int) -> torch.Tensor:
    """nbytes of N(0, 0.02) values as a uint8 view, shared between cases."""
    key = (dtype, nbytes)
    if key not in _SOURCE_CACHE:
        if nbytes >= SIZES["256MB"]:
            _SOURCE_CACHE.clear()  # one big source at a time
        generator = torch.Generator().manual_seed(nbytes)
        count = nbytes // DTYPES[dtype].itemsize
        _SOURCE_CACHE[key] = (torch.randn(count, generator=generator) * 0.02).to(DTYPES[dtype]).view(torch.uint8)
    return _SOURCE_CACHE[key]


def plan_row(
    source: int,
    destination: int,
    pair: tuple[str, str],
    src_offset: int,
    count: int,
    dst_offset: int,
    runs: int = 1,
    src_stride: int = 0,
    dst_stride: int = 0,
) -> list[int]:
    src, dst = pair
    same = src == dst
    codes = (0, 0) if same else (_ops.code(TORCH_NAMES[src]), _ops.code(TORCH_NAMES[dst]))
    return [
        source,
        destination,
        *codes,
        DTYPES[src].itemsize,
        DTYPES[dst].itemsize,
        src_offset,
        count,
        dst_offset,
        runs,
        src_stride,
        dst_stride,
    ]


def typed(buffer: torch.Tensor, dtype: str) -> torch.Tensor:
    return buffer.view(DTYPES[dtype])


def one_extent(pair: tuple[str, str], nbytes: int) -> Case:
    src, dst = pair
    source = weights(src, nbytes)
    count = nbytes // DTYPES[src].itemsize

    def torch_copy(destinations):
        typed(destinations[0], dst).copy_(typed(source, src))

    return Case([source], [count * DTYPES[dst].itemsize], [plan_row(0, 0, pair, 0, count, 0)], torch_copy)


def many_small_extents(pair: tuple[str, str]) -> Case:
    src, dst = pair
    source = weights(src, SMALL_EXTENTS * SMALL_EXTENT_BYTES)
    count = SMALL_EXTENT_BYTES // DTYPES[src].itemsize
    rows = [plan_row(0, i, pair, i * count, count, 0) for i in range(SMALL_EXTENTS)]
    pieces = typed(source, src).split(count)

    def torch_copy(destinations):
        for piece, destination in zip(pieces, destinations):
            typed(destination, dst).copy_(piece)

    return Case([source], [count * DTYPES[dst].itemsize] * SMALL_EXTENTS, rows, torch_copy)


def shard1(pair: tuple[str, str]) -> Case:
    """Column blocks of a square tensor, one per rank, as FSDP2 Shard(1) saves them."""
    src, dst = pair
    side, width = SHARD1_SIDE, SHARD1_SIDE // SHARD1_RANKS
    local_bytes = side * width * DTYPES[src].itemsize
    sources = [weights(src, local_bytes + r * DTYPES[src].itemsize)[:local_bytes] for r in range(SHARD1_RANKS)]
    rows = [
        plan_row(r, 0, pair, 0, width, r * width, runs=side, src_stride=width, dst_stride=side)
        for r in range(SHARD1_RANKS)
    ]

    def torch_copy(destinations):
        whole = typed(destinations[0], dst).view(side, side)
        for r, local in enumerate(sources):
            whole[:, r * width : (r + 1) * width].copy_(typed(local, src).view(side, width))

    return Case(sources, [side * side * DTYPES[dst].itemsize], rows, torch_copy)


CASES: dict[str, Callable[[], Case]] = {}
for _pair_name, _pair in PAIRS.items():
    for _size_name, _size in SIZES.items():
        CASES[f"{_pair_name}-{_size_name}"] = lambda p=_pair, s=_size: one_extent(p, s)
for _pair_name in ("f32->bf16", "copy-f32"):
    CASES[f"{_pair_name}-small"] = lambda p=PAIRS[_pair_name]: many_small_extents(p)
    CASES[f"{_pair_name}-shard1"] = lambda p=PAIRS[_pair_name]: shard1(p)


# --- the three front ends -------------------------------------------------------------------


def touched_destinations(case: Case) -> list[torch.Tensor]:
    return [torch.zeros(size, dtype=torch.uint8) for size in case.destination_sizes]


def op_call(case: Case):
    destinations = touched_destinations(case)
    plan = torch.tensor(case.rows, dtype=torch.int64)
    return (lambda: _ops.gather_convert(case.sources, destinations, plan)), None, destinations


def torch_call(case: Case):
    destinations = touched_destinations(case)
    return (lambda: case.torch_copy(destinations)), None, destinations


def file_call(case: Case, fd: int):
    views = [memoryview(s.numpy()) for s in case.sources]
    rows = array("q", [value for row in case.rows for value in row])
    sizes = array("q", case.destination_sizes)
    offsets = array("q", [0, *accumulate(case.destination_sizes)][:-1])  # destinations end to end
    native, threads = _ops.native(), _ops.cpu_threads()

    def call():
        native.gather_convert_to_file(views, rows, offsets, sizes, fd, CHUNK_BYTES, threads)

    return call, (lambda: os.ftruncate(fd, 0)), None


# --- measuring ------------------------------------------------------------------------------


def seconds_per_call(call: Callable[[], None], setup: Callable[[], None] | None) -> float:
    """One untimed-by-the-benchmark trial call, to size the rounds (it also warms the pages)."""
    if setup:
        setup()
    start = time.perf_counter()
    call()
    return max(time.perf_counter() - start, 1e-7)


def measure(benchmark, call, setup) -> None:
    """pedantic rounds adding up to about ROUND_SECONDS; calls grouped into iterations when tiny."""
    per_call = seconds_per_call(call, setup)
    iterations = 1 if setup else max(1, int(MIN_ROUND_SECONDS / per_call))
    rounds = min(2000, max(5, int(ROUND_SECONDS / (per_call * iterations))))
    benchmark.pedantic(call, setup=setup, rounds=rounds, iterations=iterations, warmup_rounds=1)


def assert_matches_torch(case: Case, destinations: list[torch.Tensor]) -> None:
    expected = touched_destinations(case)
    case.torch_copy(expected)
    assert all(torch.equal(got, want) for got, want in zip(destinations, expected)), "op result differs from copy_"


def human_bytes(n: int) -> str:
    return next(
        f"{n / scale:.3g} {unit}" for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB"), (1, "B")) if n >= scale
    )


class KernelSummary:
    """Collects GB/s per case and front end; prints and saves one table when the run ends."""

    def __init__(self):
        self.gbps: dict[str, dict[str, tuple[float, float]]] = {}  # case -> front end -> (best, median)
        self.bytes_moved: dict[str, int] = {}

    def add(self, case: str, front_end: str, best: float, median: float, bytes_moved: int) -> None:
        self.gbps.setdefault(case, {})[front_end] = (best, median)
        self.bytes_moved[case] = bytes_moved

    def table(self) -> str:
        lines = [
            f"Kernel micro-benchmarks, {_ops.cpu_threads()} threads. Each cell: GB/s = (bytes read + written) / "
            "seconds per call, for the fastest round / the median round. file: the torch-free module into a "
            "temporary file (pwrite; page-cache costs included).",
            "",
            "| case | bytes moved | op | file | torch copy_ | op / torch, best |",
            "|---|---|---|---|---|---|",
        ]
        for case, by_front in self.gbps.items():
            cells = [f"{by_front[f][0]:.1f} / {by_front[f][1]:.1f}" if f in by_front else "-" for f in FRONT_ENDS]
            ratio = f"{by_front['op'][0] / by_front['torch'][0]:.2f}" if {"op", "torch"} <= by_front.keys() else "-"
            lines.append(f"| {case} | {human_bytes(self.bytes_moved[case])} | " + " | ".join(cells) + f" | {ratio} |")
        return "\n".join(lines) + "\n"

    def pytest_terminal_summary(self, terminalreporter):
        if not self.gbps:
            return
        text = self.table()
        terminalreporter.write_sep("-", "fsdpfast kernels: GB/s")
        terminalreporter.write(text)
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS, "w") as f:
            f.write(text)


@pytest.fixture(scope="module")
def summary(request):
    plugin = KernelSummary()
    request.config.pluginmanager.register(plugin, "fsdpfast-kernel-summary")
    yield plugin
    _SOURCE_CACHE.clear()


@pytest.fixture(scope="module")
def output_fd():
    with tempfile.TemporaryFile() as f:
        yield f.fileno()


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("case_name", list(CASES))
def test_kernel(benchmark, summary, output_fd, case_name, front_end):
    case = CASES[case_name]()
    if front_end == "file":
        call, setup, destinations = file_call(case, output_fd)
    else:
        call, setup, destinations = (op_call if front_end == "op" else torch_call)(case)
    benchmark.group = case_name
    measure(benchmark, call, setup)
    if front_end == "op":
        assert_matches_torch(case, destinations)
    if benchmark.stats is not None:  # None under --benchmark-disable
        stats = benchmark.stats.stats
        best, median = case.bytes_moved / stats.min / 1e9, case.bytes_moved / stats.median / 1e9
        benchmark.extra_info.update(
            {"bytes_moved": case.bytes_moved, "GB/s": round(median, 3), "GB/s best": round(best, 3)}
        )
        summary.add(case_name, front_end, best, median, case.bytes_moved)
