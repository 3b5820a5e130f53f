"""--dtype fp8 in one pass vs the two-pass way (merge to bf16, then the anchor's quantizer over the folder).

On a real 4-rank FSDP2 fp32 checkpoint (benchmarks/make_checkpoint.py; sizes below), each command its
own subprocess, measured by benchmarks/measure.py (wall time, peak RSS of the process tree):
  one-pass   python -m fsdpfast merge CKPT --out OUT --dtype fp8
  two-pass   python -m fsdpfast merge CKPT --out BF16 --dtype bf16, then
             python benchmarks/fp8_quantize_folder.py BF16 OUT (transformers' Fp8Quantize per file)
One untimed warm-up, then `--repeat` rounds running both ways side by side; the two passes' times add,
their peak is the larger. The outputs of the last round are compared byte for byte (same tensors).

    nice python benchmarks/bench_fp8.py [--workdir benchmarks/work-fp8] [--repeat 3] [--hidden 1024 --layers 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_checkpoint import make_checkpoint  # noqa: E402
from measure import clean, run_measured  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _check(run, what):
    if run.returncode != 0:
        raise SystemExit(f"{what} failed:\n{run.stderr[-2000:]}")
    return run


def _same_outputs(a: str, b: str) -> bool:
    import glob

    import torch
    from safetensors import safe_open

    def tensors(folder):
        out = {}
        for path in glob.glob(os.path.join(folder, "*.safetensors")):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    out[name] = f.get_tensor(name)
        return out

    x, y = tensors(a), tensors(b)
    return sorted(x) == sorted(y) and all(
        x[n].dtype == y[n].dtype and torch.equal(x[n].view(torch.uint8), y[n].view(torch.uint8)) for n in x
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default=os.path.join(HERE, "work-fp8"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=2816)
    args = parser.parse_args()
    ckpt = os.path.join(args.workdir, "ckpt")
    make_checkpoint(ckpt, 4, hidden=args.hidden, layers=args.layers, intermediate=args.intermediate)
    one, bf16, two = (os.path.join(args.workdir, n) for n in ("one-pass", "bf16", "two-pass"))
    py = sys.executable
    rounds = []
    for i in range(args.repeat + 1):
        for folder in (one, bf16, two):
            clean(folder)
        a = _check(run_measured([py, "-m", "fsdpfast", "merge", ckpt, "--out", one, "--dtype", "fp8"]), "one-pass")
        b1 = _check(run_measured([py, "-m", "fsdpfast", "merge", ckpt, "--out", bf16, "--dtype", "bf16"]), "merge")
        b2 = _check(run_measured([py, os.path.join(HERE, "fp8_quantize_folder.py"), bf16, two]), "quantize")
        if i:  # the first round warms the page cache
            rounds.append((a, b1, b2))
    same = _same_outputs(one, two)
    size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.endswith(".pt"))
    print(f"checkpoint: 4 ranks, {size / 1e9:.2f} GB fp32; outputs identical: {same}")
    print("| way | wall s (median) | peak RSS GB (max) |")
    print("|---|---|---|")
    med = lambda xs: statistics.median(xs)  # noqa: E731
    print(
        f"| one pass, --dtype fp8 | {med([a.seconds for a, _, _ in rounds]):.2f} | "
        f"{max(a.peak_rss for a, _, _ in rounds) / 1e9:.2f} |"
    )
    print(
        f"| merge to bf16 | {med([b.seconds for _, b, _ in rounds]):.2f} | "
        f"{max(b.peak_rss for _, b, _ in rounds) / 1e9:.2f} |"
    )
    print(
        f"| then Fp8Quantize over the folder | {med([c.seconds for _, _, c in rounds]):.2f} | "
        f"{max(c.peak_rss for _, _, c in rounds) / 1e9:.2f} |"
    )
    print(
        f"| two passes, total | {med([b.seconds + c.seconds for _, b, c in rounds]):.2f} | "
        f"{max(max(b.peak_rss, c.peak_rss) for _, b, c in rounds) / 1e9:.2f} |"
    )
    ratio = med([(b.seconds + c.seconds) / a.seconds for a, b, c in rounds])
    print(f"two-pass / one-pass wall time, per round: median {ratio:.2f}x")
    for folder in (one, bf16, two):
        clean(folder)


if __name__ == "__main__":
    main()
