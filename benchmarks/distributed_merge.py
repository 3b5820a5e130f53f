"""fsdpfast under torchrun against torch's every-rank consolidation, and against fsdpfast alone.

One HuggingFaceStorageWriter(save_distributed=True) checkpoint (fp32, written by 4 gloo ranks with
benchmarks/make_checkpoint.py; kept in --workdir) is merged, dtype kept, into files of at most
--max-shard-size by:

  fsdpfast, 1 process       python -m fsdpfast merge CKPT --out OUT --max-shard-size S
  fsdpfast, torchrun W      torchrun --standalone --nproc-per-node W -m fsdpfast merge CKPT --out OUT ...
  torch every-rank, W       torchrun ... benchmarks/baselines/hf_consolidate_every_rank.py: torch's
                            consolidate_safetensors_files_on_every_rank, with fsdpfast's file layout as
                            its fqn_to_index_mapping (the same files; torch gives each rank whole files)

for each W in --processes. Each is one process tree (benchmarks/measure.py: wall time, peak RSS summed
over the tree: the torchrun agent and every worker). Round 0 warms the page cache and is not counted;
then --repeat rounds run every tool in turn. Every output is checked: fsdpfast's byte for byte and
manifest for manifest against the single-process merge, torch's tensor for tensor against it.
fsdpfast fsyncs its output inside the timed run; torch does not.

The planning cost that decides how the processes agree on one layout (every rank plans, or rank 0
plans and broadcasts the plan) is printed too: plan_merge's time against pickling the plan.

    python benchmarks/distributed_merge.py [--processes 2,4] [--size default|0.25|1|3] [--repeat 3]

Table: benchmarks/results/distributed_merge.md (--results: another folder).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import pickle
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare_dcp import SIZES, read_output  # noqa: E402
from make_checkpoint import checkpoint_files, make_checkpoint  # noqa: E402
from measure import clean, ratios, run_measured, size  # noqa: E402

CHECKPOINT_RANKS = 4


def fsdpfast_merge(ckpt: str, out: str, shard: str) -> list[str]:
    return [
        "-m",
        "fsdpfast",
        "merge",
        ckpt,
        "--out",
        out,
        "--max-shard-size",
        shard,
        "--overwrite",
        "--quiet",
        "--json",
    ]


def commands(ckpt: str, out: str, mapping: str, shard: str, processes: list[int]) -> dict[str, list[str]]:
    python = sys.executable
    merge = fsdpfast_merge(ckpt, out, shard)
    found = {"fsdpfast, 1 process": [python, *merge]}
    for w in processes:
        torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(w)]
        found[f"fsdpfast, torchrun {w}"] = [*torchrun, *merge]
        found[f"torch every-rank, torchrun {w}"] = [
            *torchrun,
            os.path.join(HERE, "baselines", "hf_consolidate_every_rank.py"),
            ckpt,
            out,
            mapping,
        ]
    return found


def file_mapping(ckpt: str, shard: str, path: str) -> int:
    """fsdpfast's layout as torch's fqn_to_index_mapping (files numbered from 1); the number of files."""
    import fsdpfast
    from fsdpfast.plan.layout import plan_files

    files = plan_files(fsdpfast.plan_merge(ckpt), shard)
    with open(path, "w") as f:
        json.dump({p.tensor.name: i + 1 for i, planned in enumerate(files) for p in planned.tensors}, f)
    return len(files)


def planning_cost(ckpt: str, shard: str) -> str:
    """What each way of agreeing on the layout costs: planning on every rank, or pickling rank 0's plan."""
    import fsdpfast
    from fsdpfast.plan.layout import plan_files

    start = time.perf_counter()
    plan = fsdpfast.plan_merge(ckpt)
    files = plan_files(plan, shard)
    planned = time.perf_counter() - start
    start = time.perf_counter()
    payload = pickle.dumps((plan.but(copies=()), files), protocol=pickle.HIGHEST_PROTOCOL)
    pickle.loads(payload)
    moved = time.perf_counter() - start
    return (
        f"planning (plan_merge + layout, in a fresh process: the model check's imports included): {planned:.2f} s; the plan pickled and "
        f"unpickled: {len(payload) / 1e3:.0f} KB in {moved * 1e3:.1f} ms"
    )


def inside_seconds(run) -> float:
    """The time the tool itself reports (fsdpfast's report, torch's call on rank 0): the wall time
    less starting the interpreters and importing torch."""
    return json.loads(run.stdout)["seconds"]


def same_as(out: str, reference: str, fsdpfast_output: bool) -> str:
    if fsdpfast_output:
        names = sorted(os.listdir(reference))
        if sorted(os.listdir(out)) != names:
            return "FAIL: other files"
        for name in names:
            if name == "fsdpfast-manifest.json":
                with open(os.path.join(out, name)) as a, open(os.path.join(reference, name)) as b:
                    if json.load(a) != json.load(b):
                        return "FAIL: manifest differs"
            elif not filecmp.cmp(os.path.join(out, name), os.path.join(reference, name), shallow=False):
                return f"FAIL: {name} differs"
        return "ok (bytes, manifest)"
    import torch

    theirs, ours = read_output(out), read_output(reference)
    if set(theirs) != set(ours):
        return "FAIL: names differ"
    for name in ours:
        a, b = theirs[name](), ours[name]()
        if (
            a.dtype != b.dtype
            or a.shape != b.shape
            or not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        ):
            return f"FAIL: {name} differs"
    return f"ok ({len(ours)} tensors)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="2,4", help="comma-separated process counts W (default 2,4)")
    parser.add_argument(
        "--size", default="default", choices=list(SIZES), help="model: default (~1.3 GB of fp32) or 0.25, 1, 3 (GB)"
    )
    parser.add_argument(
        "--max-shard-size", default="200MB", help="output file size (default 200MB: more files than processes)"
    )
    parser.add_argument("--workdir", default=os.path.join(HERE, "work"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    processes = [int(w) for w in args.processes.split(",")]
    label = "1gb" if args.size == "default" else f"{args.size}gb"
    ckpt = os.path.join(args.workdir, f"ckpt_{label}_dcp-hf")  # the folder compare_dcp.py writes, shared
    out, reference = os.path.join(args.workdir, "out_distributed"), os.path.join(args.workdir, "out_distributed_single")
    make_checkpoint(ckpt, CHECKPOINT_RANKS, fmt="dcp-hf", **SIZES[args.size])
    input_bytes = sum(os.path.getsize(f) for f in checkpoint_files(ckpt, CHECKPOINT_RANKS, "dcp-hf"))
    print(planning_cost(ckpt, args.max_shard_size), flush=True)  # first: the imports planning needs are part of it
    mapping = os.path.join(args.workdir, "distributed_mapping.json")
    files = file_mapping(ckpt, args.max_shard_size, mapping)
    cmds = commands(ckpt, out, mapping, args.max_shard_size, processes)
    clean(reference)
    single = run_measured([sys.executable, *fsdpfast_merge(ckpt, reference, args.max_shard_size)])
    if single.returncode:
        raise SystemExit(f"the reference merge failed: {single.stderr.strip()[-500:]}")
    runs = {name: [] for name in cmds}
    checks = {}
    for round_no in range(args.repeat + 1):  # round 0 warms the page cache and is not counted
        for name, argv in cmds.items():
            clean(out)
            run = run_measured(argv)
            if run.returncode != 0:
                raise SystemExit(f"{name} failed: {run.stderr.strip()[-800:]}")
            if round_no:
                runs[name].append(run)
                print(f"  round {round_no} {name}: {run.seconds:.2f} s, peak RSS {size(run.peak_rss)}", flush=True)
            checks[name] = same_as(out, reference, name.startswith("fsdpfast"))
    clean(out)
    clean(reference)
    base = [r.seconds for r in runs["fsdpfast, 1 process"]]
    lines = [
        f"HuggingFaceStorageWriter folder of {input_bytes / 1e9:.2f} GB (fp32, {CHECKPOINT_RANKS} ranks) merged "
        f"into {files} files of at most {args.max_shard_size}, dtype kept; {time.strftime('%Y-%m-%d')}, "
        f"{os.cpu_count()} CPUs, one machine, inputs warm in the page cache; {args.repeat} rounds.",
        "",
        "| tool | wall s, median (min–max) | peak RSS (all processes) | output checked | time ÷ fsdpfast, 1 process |",
        "|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        seconds = [r.seconds for r in rs]
        lines.append(
            f"| {name} | {statistics.median(seconds):.2f} ({min(seconds):.2f}–{max(seconds):.2f}) "
            f"| {size(max(r.peak_rss for r in rs))} | {checks[name]} | {ratios(seconds, base)} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "distributed_merge.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
