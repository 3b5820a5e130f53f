"""The second pass of the two-pass way: quantize a bf16 Hugging Face folder to block FP8 with the anchor's quantizer.

What the RL frameworks' converters do (slime's convert_hf_to_fp8 and the like): each safetensors file is
loaded, each linear weight fsdpfast --dtype fp8 would quantize (fsdpfast.fp8.select) goes through
transformers' own Fp8Quantize (weight_block_size 128x128; partial-block shapes zero-padded, as the
tests compare), and the file is written again with the float8 weights and their scale_inv. Used by
benchmarks/bench_fp8.py; not part of fsdpfast.

    python benchmarks/fp8_quantize_folder.py BF16_DIR OUT_DIR
"""

from __future__ import annotations

import glob
import os
import shutil
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.integrations.finegrained_fp8 import Fp8Quantize

from fsdpfast.fp8.select import quantized


class _Config:
    weight_block_size = (128, 128)
    scale_fmt = None


class _Quantizer:
    quantization_config = _Config()


def main(src: str, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    quantize = Fp8Quantize(_Quantizer())
    for path in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        result = {}
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if quantized(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")):
                    rows, cols = t.shape
                    padded = torch.nn.functional.pad(t, (0, -cols % 128, 0, -rows % 128))
                    q = quantize._quantize_one(name, padded)
                    result[name] = q[name][:rows, :cols].contiguous()
                    result[f"{name}_scale_inv"] = q[f"{name}_scale_inv"]
                else:
                    result[name] = t
        save_file(result, os.path.join(out, os.path.basename(path)), metadata={"format": "pt"})
    for other in os.listdir(src):
        if not other.endswith(".safetensors") and os.path.isfile(os.path.join(src, other)):
            shutil.copy(os.path.join(src, other), out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
