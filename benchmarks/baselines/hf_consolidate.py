"""Baseline, not fsdpfast: torch's own consolidation of HuggingFaceStorageWriter output.

torch.distributed.checkpoint._consolidate_hf_safetensors.consolidate_safetensors_files(CKPT_DIR,
OUT_DIR, fqn_to_index_mapping) with every tensor mapped to one file, as HuggingFaceStorageWriter's
own finish step does when it consolidates (enable_consolidation=True without a mapping): it reads
each shard's header, then for every tensor assembles the whole tensor in a bytearray from the
shards' byte ranges and appends it to OUT_DIR/model-00001-of-00001.safetensors. The dtype is
kept (it cannot cast). huggingface/config.json is copied beside it.

    python benchmarks/baselines/hf_consolidate.py CKPT_DIR OUT_DIR [--threads N]
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil

from safetensors import safe_open
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument(
        "--threads", type=int, default=1, help="num_threads (torch parallelises over output files only)"
    )
    args = parser.parse_args()
    names: dict[str, int] = {}
    for path in sorted(glob.glob(os.path.join(args.ckpt, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), 1))
    os.makedirs(args.out, exist_ok=True)
    consolidate_safetensors_files(args.ckpt, args.out, fqn_to_index_mapping=names, num_threads=args.threads)
    config = os.path.join(args.ckpt, "huggingface", "config.json")
    if os.path.isfile(config):
        shutil.copy(config, args.out)


if __name__ == "__main__":
    main()
