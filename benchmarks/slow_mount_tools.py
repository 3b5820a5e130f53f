"""fsdpfast beside the other mergers, every tool reading its checkpoint through one slowfs FUSE mount
(benchmarks/slowfs.c: each read request answered after a fixed latency, as on a network filesystem or
an object-store mount), beside the parallel-read floor of the same mount (N threads of 8 MB preads,
the best N).

Two cases, each checkpoint written by real gloo ranks (benchmarks/make_checkpoint.py):

  ranks    verl's rank files (`model_world_size_4_rank_*.pt` + huggingface/), to bf16: fsdpfast
           (`--read-mode auto`, which reads FUSE mounts with preads), fsdpfast `--read-mode mmap`,
           and benchmarks/baselines/verl_style.py (verl's merge algorithm: torch.load of every rank
           file, torch.cat, save_pretrained).
  dcp-hf   HuggingFaceStorageWriter(save_distributed=True) shards, dtype kept: fsdpfast (auto) and
           benchmarks/baselines/hf_consolidate.py (torch's `consolidate_safetensors_files`).

Every run starts cold: the pages of the mount's files and of their backing files are dropped with
posix_fadvise(DONTNEED) first. Each round runs every tool in turn, so the ratios compare runs made
side by side; the model check's cache is warmed before the first round (the check is on, as users
run it). Needs /dev/fuse, fusermount3 and the fuse3 headers, like benchmarks/read_modes.py.

    python benchmarks/slow_mount_tools.py --ranks CKPT_DIR [--dcp-hf DIR] [--latency-ms 2] [--repeat 2]

A --dcp-hf folder that holds no shards is written first (about 1.3 GB).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare_dcp import SIZES  # noqa: E402
from make_checkpoint import make_checkpoint  # noqa: E402
from measure import busy_cores, run_measured  # noqa: E402
from read_modes import SlowMount, best_floor, built_slowfs, drop_cached  # noqa: E402


def data_files(folder: str) -> list[str]:
    """The files a merge reads in bulk: rank files or safetensors shards (not the config's)."""
    found = glob.glob(os.path.join(folder, "*.pt")) + glob.glob(os.path.join(folder, "*.safetensors"))
    return sorted(found)


def tools(case: str, ckpt: str, out: str) -> dict[str, list[str]]:
    python = sys.executable
    merge = [python, "-m", "fsdpfast", "merge", ckpt, "--out", out, "--overwrite", "--quiet"]
    if case == "ranks":
        return {
            "fsdpfast (auto: pread)": merge + ["--dtype", "bf16"],
            "fsdpfast --read-mode mmap": merge + ["--dtype", "bf16", "--read-mode", "mmap"],
            "verl's merge algorithm": [python, os.path.join(HERE, "baselines", "verl_style.py"), ckpt, out],
        }
    return {
        "fsdpfast (auto: pread)": merge + ["--dtype", "keep"],
        "consolidate_safetensors_files": [python, os.path.join(HERE, "baselines", "hf_consolidate.py"), ckpt, out],
    }


def measure_case(case: str, backing: str, binary: str, latency: float, args) -> str:
    work = tempfile.mkdtemp(prefix="fsdpfast-slow-tools-", dir=args.workdir)
    out = os.path.join(work, "out")
    mount = SlowMount(binary, os.path.dirname(backing), os.path.join(work, "mount"), latency, [])
    try:
        through = os.path.join(mount.mount, os.path.basename(backing))
        files = data_files(through)
        every_page = files + data_files(backing)
        total = sum(os.path.getsize(p) for p in files)
        floor, threads = best_floor(files, True, 1)
        commands = tools(case, through, out)
        first = next(iter(commands.values()))
        if run_measured(first).returncode != 0:  # warms the model check's cache
            raise SystemExit(f"{case}: the first merge failed")
        runs: dict[str, list] = {name: [] for name in commands}
        for round_no in range(1, args.repeat + 1):
            for name, argv in commands.items():
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                drop_cached(every_page)
                run = run_measured(argv)
                if run.returncode != 0:
                    raise SystemExit(f"{case} {name} failed: {run.stderr.strip().splitlines()[-1:]}")
                runs[name].append(run)
                print(f"  {case} {latency:g} ms round {round_no} {name}: {run.seconds:.2f} s", flush=True)
    finally:
        mount.close()
        shutil.rmtree(work, ignore_errors=True)
    lines = [
        f"\n{case}: {len(files)} files, {total / 1e6:.0f} MB through slowfs at {latency:g} ms per request; "
        f"parallel-read floor {floor:.2f} s ({threads} threads, {total / floor / 1e6:.0f} MB/s)",
        "",
        "| tool | wall s, median (min-max) | input MB/s | peak RSS | floor / wall | wall / fsdpfast, per round |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    ours = [r.seconds for r in next(iter(runs.values()))]
    for name, found in runs.items():
        seconds = [r.seconds for r in found]
        median = statistics.median(seconds)
        per_round = ", ".join(f"{s / o:.2f}" for s, o in zip(seconds, ours))
        lines.append(
            f"| {name} | {median:.2f} ({min(seconds):.2f}-{max(seconds):.2f}) | {total / median / 1e6:.0f} | "
            f"{max(r.peak_rss for r in found) / 1e6:.0f} MB | {floor / median:.2f} | {per_round} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--ranks", help="a verl rank-file checkpoint folder with huggingface/ (benchmarks/make_checkpoint.py)"
    )
    parser.add_argument("--dcp-hf", help="a HuggingFaceStorageWriter folder (written first if it holds no shards)")
    parser.add_argument("--latency-ms", default="2", help="slowfs latencies per read request, comma-separated")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="where the mounts and outputs go (default: the temp dir)")
    args = parser.parse_args()
    binary, why_not = built_slowfs(tempfile.mkdtemp(prefix="fsdpfast-slowfs-"))
    if binary is None:
        raise SystemExit(f"no slowfs: {why_not}")
    if args.dcp_hf and not data_files(args.dcp_hf):
        make_checkpoint(args.dcp_hf, 4, fmt="dcp-hf", **SIZES["default"])
    print(f"load before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; busy CPUs {busy_cores():.2f}", flush=True)
    tables = []
    for latency in (float(x) for x in args.latency_ms.split(",") if x.strip()):
        for case, folder in (("ranks", args.ranks), ("dcp-hf", args.dcp_hf)):
            if folder:
                tables.append(measure_case(case, os.path.abspath(folder), binary, latency, args))
    print("\n".join(tables))
    print(f"\nload after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
