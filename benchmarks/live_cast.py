"""The cast + write of one CPU shard by `fsdpfast.save_pretrained`, the two ways live.write.WriteWays.torch_cast picks between:

  native   the kernel casts fp32 -> bf16 as it writes and checksums (what save_pretrained does)
  torch    torch's .to(bfloat16) first, then the kernel writes and checksums the bf16 copy

One process, one tensor (default: a 32,000 x 1,024 fp32 embedding, 131 MB), written into a file
in /tmp at offset 0, the two ways interleaved for --repeats rounds: min and median milliseconds.
benchmarks/live_save.py times the same choice end to end (--ways fsdpfast fsdpfast-torch-cast),
where other processes on a shared machine blur it more.

    python benchmarks/live_cast.py --rows 32000 --columns 1024 --threads 1 --repeats 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from fsdpfast.live import write

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32000)
    parser.add_argument("--columns", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    shard = torch.randn(args.rows, args.columns)
    runs = write._runs(((0, shard.numel(), 0, 1, 0, 0),))
    fd, path = tempfile.mkstemp(prefix="fsdpfast-live-cast-")
    os.ftruncate(fd, shard.numel() * 2)
    ways = {
        "native": lambda: write._kernel_write(fd, shard, runs, "bfloat16", 0, args.threads),
        "torch": lambda: write._kernel_write(fd, shard.to(torch.bfloat16), runs, "bfloat16", 0, args.threads),
    }
    times = {way: [] for way in ways}
    try:
        for _ in range(args.repeats):
            for way, run in ways.items():
                start = time.perf_counter()
                run()
                times[way].append(time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(path)
    print(f"{args.rows} x {args.columns} fp32 -> bf16, {args.threads} thread(s), {args.repeats} rounds", flush=True)
    print(f"{'cast':<8}{'min ms':>9}{'median ms':>11}")
    for way, seconds in times.items():
        print(f"{way:<8}{min(seconds) * 1e3:>9.1f}{statistics.median(seconds) * 1e3:>11.1f}")


if __name__ == "__main__":
    main()
