"""Baseline, not fsdpfast: torch's own DCP conversion, then a safetensors save.

1. torch.distributed.checkpoint.format_utils.dcp_to_torch_save(CKPT_DIR, TMP.pt): torch
   loads every chunk and writes one torch.save file of the whole state dict;
2. torch.load that file, cast floating tensors to bfloat16, and safetensors' save_file
   into OUT_DIR/model.safetensors (with huggingface/config.json copied beside it).

  python benchmarks/baselines/dcp_torch.py CKPT_DIR OUT_DIR
"""

from __future__ import annotations

import os
import shutil
import sys

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def main(ckpt: str, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    whole = os.path.join(out, "whole.pt")
    dcp_to_torch_save(ckpt, whole)
    state = torch.load(whole, weights_only=True)
    os.unlink(whole)
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = os.path.join(ckpt, "huggingface", "config.json")
    if os.path.isfile(config):
        shutil.copy(config, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
