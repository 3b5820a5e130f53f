"""The CPU FP8 block quantization kernel, vectorised vs the scalar one it replaced, side by side.

    nice python benchmarks/bench_fp8_kernel.py [--rounds 5]

Both are ops of one build (torch.ops.fsdpfast.fp8_block_quantize and fp8_block_quantize_scalar,
csrc/fp8_block.cpp), timed in alternating rounds on the same N(0, 1) weights; the outputs are
checked equal first. Prints a table of the median seconds per call, GB/s (bytes read + written)
and the ratio, per weight shape and dtype, at torch's thread count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fsdpfast import _ops

CASES = [((4096, 4096), torch.bfloat16), ((4096, 4096), torch.float32), ((8, 1536, 1024), torch.bfloat16)]


def timed(op, weight) -> float:
    start = time.perf_counter()
    op(weight, 128, 128)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    assert _ops.torch_ops(), _ops.torch_ops_error()
    ops = {"scalar": torch.ops.fsdpfast.fp8_block_quantize_scalar, "vectorised": torch.ops.fsdpfast.fp8_block_quantize}
    print(f"threads: {torch.get_num_threads()}; median of {rounds} alternating rounds")
    print("| weight | dtype | scalar s | vectorised s | scalar GB/s | vectorised GB/s | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for shape, dtype in CASES:
        weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        a, b = (op(weight, 128, 128) for op in ops.values())
        assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
        times = {name: [] for name in ops}
        for _ in range(rounds):
            for name, op in ops.items():
                times[name].append(timed(op, weight))
        median = {name: statistics.median(t) for name, t in times.items()}
        moved = weight.numel() * (weight.element_size() + 1)
        print(
            f"| {'x'.join(map(str, shape))} | {str(dtype).removeprefix('torch.')} | {median['scalar']:.3f} | "
            f"{median['vectorised']:.3f} | {moved / median['scalar'] / 1e9:.2f} | {moved / median['vectorised'] / 1e9:.2f} | "
            f"{median['scalar'] / median['vectorised']:.2f}x |"
        )


if __name__ == "__main__":
    main()
