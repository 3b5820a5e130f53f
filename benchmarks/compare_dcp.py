"""fsdpfast against torch's own DCP conversion, on a real torch.distributed.checkpoint folder.

Generates (once) a ~1 GB fp32 FSDP2 checkpoint saved with `torch.distributed.checkpoint.save`
by 4 gloo ranks (benchmarks/make_checkpoint.py, fmt "dcp"), then runs, each as its own process,
in rounds: fsdpfast with each CPU engine, and benchmarks/baselines/dcp_torch.py (torch's
`dcp_to_torch_save`, then a bf16 safetensors save), all merging to bf16. Wall time, peak RSS and
RssAnon of the process tree (benchmarks/measure.py), and a bit-for-bit check of every output
against torch's own `dcp_to_torch_save` of the same folder, cast with `.to(bfloat16)`.

    python benchmarks/compare_dcp.py [--workdir benchmarks/work] [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_checkpoint import make_checkpoint  # noqa: E402
from measure import clean, ratios, run_measured, size  # noqa: E402

SIZES = dict(hidden=1536, layers=8, intermediate=4096, vocab=32000, heads=12)  # about 1 GB of fp32


def commands(ckpt: str, out: str) -> dict[str, list[str]]:
    merge = [sys.executable, "-m", "fsdpfast", "merge", ckpt, "--out", out, "--dtype", "bf16", "--overwrite", "--engine"]
    return {"fsdpfast-cpu": merge + ["cpu"], "fsdpfast-torch": merge + ["torch"],
            "dcp_to_torch_save + save_file": [sys.executable, os.path.join(HERE, "baselines", "dcp_torch.py"), ckpt, out]}


def check(out: str, oracle: dict) -> str:
    """'ok' when every tensor of the output equals torch's conversion .to(bf16), bit for bit."""
    import glob

    import torch
    from safetensors import safe_open

    found = {}
    for path in glob.glob(os.path.join(out, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            found.update({k: f.get_tensor(k) for k in f.keys()})
    if set(found) != set(oracle):
        return f"FAIL: names differ ({sorted(set(found) ^ set(oracle))[:3]})"
    for name, want in oracle.items():
        want = want.to(torch.bfloat16) if want.is_floating_point() else want
        if not torch.equal(found[name].view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)):
            return f"FAIL: {name} differs"
    return f"ok ({len(oracle)} tensors)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=os.path.join(HERE, "work"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    ckpt, out = os.path.join(args.workdir, "ckpt_1gb_dcp"), os.path.join(args.workdir, "out_dcp")
    make_checkpoint(ckpt, 4, fmt="dcp", **SIZES)
    input_bytes = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.endswith(".distcp"))

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    clean(out)
    dcp_to_torch_save(ckpt, os.path.join(args.workdir, "oracle.pt"))
    oracle = torch.load(os.path.join(args.workdir, "oracle.pt"), weights_only=True, mmap=True)
    cmds = commands(ckpt, out)
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
            checks[name] = check(out, oracle)
    clean(out)
    os.unlink(os.path.join(args.workdir, "oracle.pt"))
    base = [r.seconds for r in runs["fsdpfast-cpu"]]
    lines = [f"DCP folder of {input_bytes / 1e9:.2f} GB (fp32, 4 ranks, torch.distributed.checkpoint.save) merged to bf16; "
             f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs; inputs warm in the page cache; {args.repeat} rounds.", "",
             "| tool | wall s, median | input GB/s | peak RSS | peak RssAnon | bit-exact vs dcp_to_torch_save | time ÷ fsdpfast-cpu |",
             "|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        median = statistics.median(r.seconds for r in rs)
        lines.append(f"| {name} | {median:.2f} | {input_bytes / median / 1e9:.2f} | {size(max(r.peak_rss for r in rs))} "
                     f"| {size(max(r.peak_anon for r in rs))} | {checks[name]} | {ratios([r.seconds for r in rs], base)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(HERE, "results", "compare_dcp.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
