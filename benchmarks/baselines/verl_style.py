"""Baseline, not fsdpfast: verl's published FSDP merge algorithm, written anew from its description.

What it does, step by step, as verl's FSDP model merger does it:
  1. find the world size from `model_world_size_{W}_rank_0.pt` and torch.load rank 0 to read the
     device mesh (verl keeps that state dict referenced until the merge is saved);
  2. torch.load every rank file fully (weights_only=False) in a ThreadPoolExecutor of
     min(32, CPUs) workers;
  3. for each key, pop each rank's piece, take its local tensor and cast it to bfloat16, note
     the DTensor placement; then torch.cat the pieces along the Shard dim (Replicate: rank 0's);
  4. build the model empty (on the meta device, in bfloat16) from huggingface/config.json,
     to_empty(device="cpu"), and model.save_pretrained(OUT, state_dict=merged).

When the `verl` package is importable, benchmarks/compare.py runs verl's own merger instead.

    python benchmarks/baselines/verl_style.py CKPT_DIR OUT_DIR
"""

from __future__ import annotations

import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoConfig, AutoModelForCausalLM


def world_size(ckpt: str) -> int:
    for name in os.listdir(ckpt):
        match = re.fullmatch(r"model_world_size_(\d+)_rank_0\.pt", name)
        if match:
            return int(match[1])
    raise FileNotFoundError(f"no model_world_size_*_rank_0.pt in {ckpt}")


def load_rank(ckpt: str, size: int, rank: int) -> dict:
    return torch.load(
        os.path.join(ckpt, f"model_world_size_{size}_rank_{rank}.pt"), map_location="cpu", weights_only=False
    )


def merge_state_dicts(state_dicts: list[dict]) -> dict[str, torch.Tensor]:
    pieces: dict[str, list[torch.Tensor]] = {}
    placements: dict[str, tuple] = {}
    for key in list(state_dicts[0]):
        pieces[key] = []
        for sd in state_dicts:
            tensor = sd.pop(key)
            if isinstance(tensor, DTensor):
                pieces[key].append(tensor.to_local().bfloat16())
                placements[key] = tuple(tensor.placements)
            else:
                pieces[key].append(tensor.bfloat16())
    merged = {}
    for key in sorted(pieces):
        placement = placements[key][0] if key in placements else Shard(0)
        if isinstance(placement, Shard):
            merged[key] = torch.cat(pieces[key], dim=placement.dim).contiguous()
        else:
            merged[key] = pieces[key][0]
        del pieces[key]
    return merged


def main(ckpt: str, out: str) -> None:
    size = world_size(ckpt)
    rank_zero = load_rank(ckpt, size, 0)  # read for the mesh; stays referenced, as in verl
    mesh = next(t for t in rank_zero.values() if isinstance(t, DTensor)).device_mesh
    assert mesh.ndim == 1, f"this reproduction covers 1-D FSDP meshes, not {mesh}"
    with ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1)) as pool:
        state_dicts = list(pool.map(lambda rank: load_rank(ckpt, size, rank), range(size)))
    merged = merge_state_dicts(state_dicts)
    del state_dicts
    config = AutoConfig.from_pretrained(os.path.join(ckpt, "huggingface"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    model.save_pretrained(out, state_dict=merged)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
