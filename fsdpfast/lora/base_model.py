"""--base HF_DIR: the base weights a LoRA-only checkpoint leaves out, read in place from a model folder.

Only the safetensors headers are read here; the bytes are read by the engines like any other
source (each tensor one extent of its file). config.json and the tokenizer come from HF_DIR
too unless the checkpoint or --config has them.
"""

from __future__ import annotations

import os
from math import prod

from ..errors import BadInput
from ..io.safetensors_folder import read_folder
from ..plan.model import Extent, MergePlan, SourceBuffer, TensorPlan


def add_base(plan: MergePlan, base_dir: str) -> MergePlan:
    """The plan with the base model's tensors added; new sources go after the checkpoint's, so the
    adapters' plans (which index the checkpoint's sources) stay valid."""
    if not os.path.isdir(base_dir):
        raise BadInput(f"--base {base_dir}: no such folder; give the Hugging Face model folder the LoRA was trained on")
    stored = read_folder(base_dir)
    sources, tensors = list(plan.sources), list(plan.tensors)
    for name, tensor in stored.items():
        source = len(sources)
        sources.append(SourceBuffer(tensor.path, tensor.byte_offset, tensor.nbytes, tensor.dtype))
        numel = prod(tensor.shape)
        extents = [Extent(source, 0, numel, 0)] if numel else []
        tensors.append(TensorPlan(name, tuple(tensor.shape), tensor.dtype, tensor.dtype, extents))
    has_config = plan.config_dir is None and os.path.isfile(os.path.join(base_dir, "config.json"))
    return plan.but(sources=sources, tensors=tensors, config_dir=base_dir if has_config else plan.config_dir).noted(
        f"base weights: {len(stored)} tensors from --base {base_dir}"
    )
