"""Check a merged folder against the unsharded model, bit for bit, without fsdpfast.

The expected tensors are built here, one at a time so memory stays about one tensor: the rank
files are opened with torch.load(mmap=True, weights_only=True) (torch.distributed.tensor imported
so DTensors load), the ranks' to_local() pieces of a key are concatenated along the dim of its
Shard placement (a Replicate placement or a plain tensor: rank 0's) and cast with .to(bf16).
Each is compared bit for bit with the tensor of the same name in the folder's safetensors files
(safe_open; model.safetensors or an index). Names must match exactly, both ways; config.json
must be there. 1-D meshes only (what benchmarks/make_checkpoint.py writes).

    python benchmarks/check_merged.py CKPT_DIR OUT_DIR   -> "ok: N tensors" (exit 0) or "FAIL: why" (exit 1)
"""

from __future__ import annotations

import glob
import json
import os
import sys

import torch
import torch.distributed.tensor  # noqa: F401  (lets weights_only=True load DTensors)
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard

DTYPE = torch.bfloat16


def rank_files(ckpt: str) -> list[str]:
    files = glob.glob(os.path.join(ckpt, "model_world_size_*_rank_*.pt"))
    return sorted(files, key=lambda f: int(f.rsplit("_", 1)[1].removesuffix(".pt")))


def expected_tensor(pieces: list) -> torch.Tensor:
    first = pieces[0]
    if not isinstance(first, DTensor):
        return first.to(DTYPE)
    shards = [p for p in first.placements if isinstance(p, Shard)]
    if not shards:
        return first.to_local().to(DTYPE)
    return torch.cat([p.to_local() for p in pieces], dim=shards[0].dim).to(DTYPE)


def output_files(out: str) -> dict[str, str]:
    """Tensor name -> safetensors file holding it."""
    index = os.path.join(out, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {name: os.path.join(out, file) for name, file in json.load(f)["weight_map"].items()}
    single = os.path.join(out, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError("no model.safetensors and no index")
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def check(ckpt: str, out: str) -> str:
    if not os.path.isfile(os.path.join(out, "config.json")):
        return "FAIL: no config.json"
    state_dicts = [torch.load(f, mmap=True, weights_only=True, map_location="cpu") for f in rank_files(ckpt)]
    files = output_files(out)
    missing, extra = set(state_dicts[0]) - set(files), set(files) - set(state_dicts[0])
    if missing or extra:
        return f"FAIL: missing {sorted(missing)[:3]} extra {sorted(extra)[:3]}"
    handles = {path: safe_open(path, "pt") for path in set(files.values())}
    for name in state_dicts[0]:
        got = handles[files[name]].get_tensor(name)
        want = expected_tensor([sd[name] for sd in state_dicts])
        if not same_bits(got, want):
            return f"FAIL: {name} differs ({got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)})"
    return f"ok: {len(files)} tensors"


def main() -> int:
    try:
        verdict = check(sys.argv[1], sys.argv[2])
    except Exception as exc:  # any breakage of the output is a failed check, said in one line
        verdict = f"FAIL: {type(exc).__name__}: {exc}"
    print(verdict)
    return 0 if verdict.startswith("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
