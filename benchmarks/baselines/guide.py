"""Baseline, not fsdpfast: the merge algorithm of the popular FSDP "merge your shards" guide.

What it does, step by step, as the guide does it:
  1. torch.load every rank file fully into memory (weights_only=False, as in the guide);
  2. for each key, concatenate the ranks' local pieces (DTensor.to_local()) along the dim
     of the Shard placement and cast the whole tensor to bfloat16;
  3. build the model from the checkpoint's huggingface/config.json with transformers
     (real, randomly initialised weights, in bfloat16 so the saved file is bfloat16);
  4. model.load_state_dict(merged) and model.save_pretrained(OUT).

    python benchmarks/baselines/guide.py CKPT_DIR OUT_DIR
"""

from __future__ import annotations

import glob
import os
import sys

import torch
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoConfig, AutoModelForCausalLM


def rank_files(ckpt: str) -> list[str]:
    files = glob.glob(os.path.join(ckpt, "model_world_size_*_rank_*.pt"))
    return sorted(files, key=lambda f: int(f.rsplit("_", 1)[1].removesuffix(".pt")))


def merge_key(pieces: list) -> torch.Tensor:
    first = pieces[0]
    if not isinstance(first, DTensor):
        return first.to(torch.bfloat16)
    shards = [p for p in first.placements if isinstance(p, Shard)]
    if not shards:  # replicated: every rank holds all of it
        return first.to_local().to(torch.bfloat16)
    return torch.cat([p.to_local() for p in pieces], dim=shards[0].dim).to(torch.bfloat16)


def main(ckpt: str, out: str) -> None:
    state_dicts = [torch.load(f, map_location="cpu", weights_only=False) for f in rank_files(ckpt)]
    merged = {key: merge_key([sd[key] for sd in state_dicts]) for key in state_dicts[0]}
    config = AutoConfig.from_pretrained(os.path.join(ckpt, "huggingface"))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(merged)
    model.save_pretrained(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
