"""Baseline, not fsdpfast: torch's consolidation with every rank writing some of the output files.

Run under torchrun: each process calls
torch.distributed.checkpoint._consolidate_hf_safetensors.consolidate_safetensors_files_on_every_rank(
CKPT_DIR, OUT_DIR, fqn_to_index_mapping) on the default (gloo) process group. The mapping (tensor
name -> output file index, from 1) is read from MAPPING_JSON, so torch writes the same files as the
fsdpfast merge it is compared with; torch gives file i to rank i % world size, whole. Rank 0 writes
the index file; the dtype is kept (it cannot cast). Rank 0 prints {"seconds": ...}: the call's time.

    torchrun --nproc-per-node W benchmarks/baselines/hf_consolidate_every_rank.py CKPT_DIR OUT_DIR MAPPING_JSON
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch.distributed as dist
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files_on_every_rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("mapping")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with open(args.mapping) as f:
        mapping = json.load(f)
    dist.init_process_group("gloo")
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    consolidate_safetensors_files_on_every_rank(args.ckpt, args.out, mapping, num_threads=args.threads)
    if dist.get_rank() == 0:  # the function ends with a barrier: this is the slowest rank's time
        print(json.dumps({"seconds": time.perf_counter() - start}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
