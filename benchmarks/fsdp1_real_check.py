"""Real FSDP1 LOCAL_STATE_DICT on a GPU -> fsdpfast merge -> bit for bit against FSDP1's FULL_STATE_DICT.

The tests already run real FSDP1 on the CPU (gloo, `device_id=cpu`); this checks the same on
CUDA, where the rank files hold CUDA storages and ShardedTensor placements name `cuda:N`.
One process per rank (spawned); with fewer GPUs than ranks the ranks share GPUs over gloo
(NCCL refuses two ranks on one GPU), else NCCL.

    python benchmarks/fsdp1_real_check.py --device cuda [--world-size 2] [--workdir DIR]
    python benchmarks/fsdp1_real_check.py --device cpu      # the same on the CPU, gloo

Exit status 0 when every checkpoint merged bit-exact; the failing tensor's name otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from fsdpfast._testing.fsdp1_examples import Fsdp1Spec, write_fsdp1_checkpoints  # noqa: E402

SPECS = [
    Fsdp1Spec("llama", seed=1),
    Fsdp1Spec("llama-tied-orig", model="llama-tied", use_orig_params=True, seed=2),
    Fsdp1Spec("bf16-orig", dtype="bfloat16", use_orig_params=True, seed=3),
    Fsdp1Spec("bert", model="bert", wrap=("BertLayer",), seed=4),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no GPU visible", file=sys.stderr)
        return 1
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    backend = "nccl" if args.device == "cuda" and gpus >= args.world_size else "gloo"
    from helpers import assert_bit_exact, load_reference, read_merged

    import fsdpfast

    with tempfile.TemporaryDirectory(dir=args.workdir) as root:
        write_fsdp1_checkpoints(root, SPECS, args.world_size, args.device, backend)
        for spec in SPECS:
            out = os.path.join(root, spec.name + ".merged")
            report = fsdpfast.merge(spec.folder(root), out, wrap=list(spec.wrap) or None)
            reference, tied = load_reference(spec.reference_path(root))
            assert_bit_exact(read_merged(out), reference, tied=tied)
            print(
                f"{spec.name}: {report.tensors} tensors bit-exact ({args.device}, {backend}, {args.world_size} ranks); "
                f"{report.notes[1]}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
