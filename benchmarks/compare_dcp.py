"""fsdpfast against torch's own DCP converters, on real torch.distributed.checkpoint folders.

Two cases, each on a fp32 FSDP2 checkpoint saved with `torch.distributed.checkpoint.save` by 4
gloo ranks (benchmarks/make_checkpoint.py; generated once, kept in --workdir):

  dcp     the default FileSystemWriter (.metadata + .distcp files), merged to bf16 by fsdpfast
          with each CPU engine and by benchmarks/baselines/dcp_torch.py (torch's
          `dcp_to_torch_save`, then a bf16 safetensors save); every output is checked bit for
          bit against torch's own `dcp_to_torch_save` of the folder, cast with `.to(bfloat16)`.
  dcp-hf  HuggingFaceStorageWriter(save_distributed=True) (one safetensors file per rank, the
          chunks' offsets in its header), merged with the dtype kept by fsdpfast and by
          benchmarks/baselines/hf_consolidate.py (torch's `consolidate_safetensors_files`,
          which cannot cast); every output is checked bit for bit against the tensors
          assembled here from the shard files (safetensors slices placed at their offsets).

Each tool runs as its own process (benchmarks/measure.py: wall time, peak RSS and RssAnon of the
process tree); round 0 warms the page cache and is not counted, then --repeat rounds run every
tool in turn, so the ratios compare runs made side by side. fsdpfast fsyncs its output inside the
timed run; torch's converters do not.

    python benchmarks/compare_dcp.py [--cases dcp,dcp-hf] [--size default|0.25|1|3] [--repeat 3] [--workdir benchmarks/work]

Tables: benchmarks/results/compare_dcp.md and compare_dcp_hf.md (--results: another folder).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare import MODELS  # noqa: E402
from make_checkpoint import checkpoint_files, make_checkpoint  # noqa: E402
from measure import clean, ratios, run_measured, size  # noqa: E402

SIZES = {"default": dict(hidden=1536, layers=8, intermediate=4096, vocab=32000, heads=12), **MODELS}  # default: ~1.3 GB
WORLD_SIZE = 4


def commands(case: str, ckpt: str, out: str) -> dict[str, list[str]]:
    python = sys.executable
    if case == "dcp":
        merge = [python, "-m", "fsdpfast", "merge", ckpt, "--out", out, "--dtype", "bf16", "--overwrite", "--engine"]
        return {
            "fsdpfast-cpu": merge + ["cpu"],
            "fsdpfast-torch": merge + ["torch"],
            "dcp_to_torch_save + save_file": [python, os.path.join(HERE, "baselines", "dcp_torch.py"), ckpt, out],
        }
    merge = [python, "-m", "fsdpfast", "merge", ckpt, "--out", out, "--dtype", "keep", "--overwrite", "--engine"]
    return {
        "fsdpfast-cpu": merge + ["cpu"],
        "fsdpfast-torch": merge + ["torch"],
        "consolidate_safetensors_files": [python, os.path.join(HERE, "baselines", "hf_consolidate.py"), ckpt, out],
    }


def load_later(path: str, name: str):
    """A function returning tensor `name` of a safetensors file, so only one tensor is held at a time."""

    def load():
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            return f.get_tensor(name)

    return load


def read_output(out: str) -> dict:
    from safetensors import safe_open

    found = {}
    for path in glob.glob(os.path.join(out, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            found.update({k: load_later(path, k) for k in f.keys()})
    return found


def check(out: str, expected) -> str:
    """'ok' when every tensor of the output equals the expected one bit for bit (names equal both ways)."""
    import torch

    found = read_output(out)
    names = list(expected)
    if set(found) != set(names):
        return f"FAIL: names differ ({sorted(set(found) ^ set(names))[:3]})"
    for name in names:
        want, got = expected[name](), found[name]()
        if (
            got.dtype != want.dtype
            or got.shape != want.shape
            or not torch.equal(got.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8))
        ):
            return f"FAIL: {name} differs"
    return f"ok ({len(names)} tensors)"


def dcp_oracle(ckpt: str, workdir: str) -> dict:
    """torch's dcp_to_torch_save of the folder, cast to bf16, one tensor at a time (mmap)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(workdir, "oracle.pt")
    if not os.path.isfile(path):
        dcp_to_torch_save(ckpt, path)
    whole = torch.load(path, weights_only=True, mmap=True)
    return {k: (lambda v=v: v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in whole.items()}


def hf_oracle(ckpt: str) -> dict:
    """Each tensor assembled from the shard files: every chunk (a safetensors slice) at its saved offsets."""
    import torch
    from safetensors import safe_open

    chunks: dict[str, list] = {}
    for path in sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            offsets = json.loads(f.metadata()["DCP_SHARDING_INFO"])
            for name in f.keys():
                chunks.setdefault(name, []).append(
                    (path, offsets[name]["saved_offsets"], f.get_slice(name).get_shape(), load_later(path, name))
                )

    def assemble(pieces):
        shape = [max(o[d] + s[d] for _, o, s, _ in pieces) for d in range(len(pieces[0][1]))]
        whole = None
        for _path, offsets, sizes, load in pieces:
            piece = load()
            whole = torch.empty(shape, dtype=piece.dtype) if whole is None else whole
            whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = piece
        return whole

    return {name: (lambda p=pieces: assemble(p)) for name, pieces in chunks.items()}


def measure_case(case: str, model: str, args) -> str:
    label = "1gb" if model == "default" else f"{model}gb"  # the default model's folder keeps its old name
    ckpt, out = os.path.join(args.workdir, f"ckpt_{label}_{case}"), os.path.join(args.workdir, f"out_{case}")
    fmt = "dcp-hf" if case == "dcp-hf" else "dcp"
    make_checkpoint(ckpt, WORLD_SIZE, fmt=fmt, **SIZES[model])
    input_bytes = sum(os.path.getsize(f) for f in checkpoint_files(ckpt, WORLD_SIZE, fmt))
    clean(out)
    expected = dcp_oracle(ckpt, args.workdir) if case == "dcp" else hf_oracle(ckpt)
    cmds = commands(case, ckpt, out)
    runs = {name: [] for name in cmds}
    checks = {}
    for round_no in range(args.repeat + 1):  # round 0 warms the page cache and is not counted
        for name, argv in cmds.items():
            clean(out)
            run = run_measured(argv)
            if run.returncode != 0:
                raise SystemExit(f"{name} failed: {run.stderr.strip().splitlines()[-1:]}")
            if round_no:
                runs[name].append(run)
                print(
                    f"  {case} round {round_no} {name}: {run.seconds:.2f} s, peak RSS {size(run.peak_rss)}, "
                    f"RssAnon {size(run.peak_anon)}",
                    flush=True,
                )
            checks[name] = check(out, expected)
    clean(out)
    if case == "dcp" and os.path.isfile(os.path.join(args.workdir, "oracle.pt")):
        os.unlink(os.path.join(args.workdir, "oracle.pt"))
    return table(case, input_bytes, runs, checks, args.repeat)


def table(case: str, input_bytes: int, runs: dict, checks: dict, repeat: int) -> str:
    if case == "dcp":
        title = (
            f"DCP folder of {input_bytes / 1e9:.2f} GB (fp32, {WORLD_SIZE} ranks, torch.distributed.checkpoint.save) "
            "merged to bf16"
        )
        oracle = "dcp_to_torch_save"
    else:
        title = (
            f"HuggingFaceStorageWriter folder of {input_bytes / 1e9:.2f} GB (fp32, {WORLD_SIZE} ranks, "
            "save_distributed=True) merged, dtype kept"
        )
        oracle = "the shards"
    base = [r.seconds for r in runs["fsdpfast-cpu"]]
    lines = [
        f"{title}; {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs; inputs warm in the page cache; {repeat} rounds.",
        "",
        f"| tool | wall s, median (min–max) | input GB/s | peak RSS | peak RssAnon | bit-exact vs {oracle} | time ÷ fsdpfast-cpu |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        seconds = [r.seconds for r in rs]
        median = statistics.median(seconds)
        lines.append(
            f"| {name} | {median:.2f} ({min(seconds):.2f}–{max(seconds):.2f}) | {input_bytes / median / 1e9:.2f} "
            f"| {size(max(r.peak_rss for r in rs))} | {size(max(r.peak_anon for r in rs))} | {checks[name]} "
            f"| {ratios(seconds, base)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="dcp,dcp-hf", help="comma-separated: dcp, dcp-hf (default both)")
    parser.add_argument(
        "--size",
        default="default",
        choices=list(SIZES),
        help="model: default (~1.3 GB of fp32) or compare.py's 0.25, 1, 3 (GB)",
    )
    parser.add_argument("--workdir", default=os.path.join(HERE, "work"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--results",
        default=os.path.join(HERE, "results"),
        help="folder for the tables: compare_dcp.md (dcp) and compare_dcp_hf.md (dcp-hf)",
    )
    args = parser.parse_args()
    cases = args.cases.split(",")
    for case in cases:
        if case not in ("dcp", "dcp-hf"):
            raise SystemExit(f"--cases: unknown case {case!r} (dcp, dcp-hf)")
    os.makedirs(args.results, exist_ok=True)
    for case in cases:
        text = measure_case(case, args.size, args)
        print(text)
        with open(os.path.join(args.results, f"compare_{case.replace('-', '_')}.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
