"""The transposed copy (csrc/transpose.cpp) beside torch's own, on one batch of expert matrices:

  torch        x.transpose(-2, -1).contiguous()            (then .to(dtype) when casting)
  op           torch.ops.fsdpfast.transposed(x[, dtype])   (the kernel, torch's threads)
  native       _native.transpose_convert                   (the kernel, its own threads: the cpu engine's)

Default: Qwen3-VL-30B-A3B's gate_up_proj of 16 experts, [16, 1536, 2048] bf16 (100 MB), bf16 -> bf16
and fp32 -> bf16; interleaved rounds, min and median milliseconds and GB/s of output. Run under nice on
a shared machine; only the ratios in one run count.

    nice python benchmarks/transpose_kernel.py --experts 16 --rows 1536 --columns 2048 --threads 2 --repeats 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fsdpfast import _ops  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--rows", type=int, default=1536)
    parser.add_argument("--columns", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not (_ops.torch_ops() and _ops.native_cpu()):
        raise SystemExit(f"the extension is not built: {_ops.torch_ops_error() or _ops.NATIVE_ERROR}")
    shape = (args.experts, args.rows, args.columns)
    print(f"{list(shape)}, {args.threads} threads, {args.repeats} rounds")
    print(f"{'cast':<22} {'way':<8} {'min ms':>8} {'median ms':>10} {'GB/s out':>9}")
    for source, target in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)):
        measure(shape, source, target, args)


def measure(shape, source, target, args) -> None:
    x = torch.randn(shape).to(source)
    out = torch.empty((args.experts, args.columns, args.rows), dtype=target)
    want = x.transpose(-2, -1).contiguous().to(target)
    same = source == target
    codes = (0, 0) if same else (_ops.code("float32"), _ops.code("bfloat16"))

    def native():
        _ops.native().transpose_convert(
            x.view(-1).view(torch.uint8).numpy(),
            out.view(-1).view(torch.uint8).numpy(),
            *shape,
            *codes,
            source.itemsize,
            target.itemsize,
            args.threads,
        )
        return out

    ways = {
        "torch": lambda: x.transpose(-2, -1).contiguous().to(target),
        "op": lambda: torch.ops.fsdpfast.transposed(x, target),
        "native": native,
    }
    times = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, way in ways.items():
            start = time.perf_counter()
            got = way()
            times[name].append(time.perf_counter() - start)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    nbytes = out.numel() * target.itemsize
    for name, found in times.items():
        label = f"{str(source)[6:]} -> {str(target)[6:]}"
        print(
            f"{label:<22} {name:<8} {min(found) * 1e3:>8.1f} {statistics.median(found) * 1e3:>10.1f} "
            f"{nbytes / min(found) / 1e9:>9.2f}"
        )


if __name__ == "__main__":
    main()
