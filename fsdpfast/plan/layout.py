"""Assign tensors to output files and fix every byte offset before any data moves.

Files are split the way Hugging Face splits a state dict: walk tensors in order, start a
new file when the next tensor would pass max_shard_size, and give a tensor larger than
the limit a file of its own. Inside a file, tensors are ordered by element size (largest
first) so every tensor starts aligned to its element size.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..dtypes import itemsize, safetensors_code
from ..errors import BadInput, option
from .model import MergePlan, TensorPlan

DEFAULT_MAX_SHARD_SIZE = "5GB"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


@dataclass
class PlacedTensor:
    tensor: TensorPlan
    offset: int  # from the start of the file
    nbytes: int


@dataclass
class OutputFile:
    name: str
    header: bytes = b""  # the 8-byte length and the JSON header, padded
    tensors: list[PlacedTensor] = field(default_factory=list)
    size: int = 0


def parse_size(text: str | int) -> int:
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text), re.IGNORECASE)
        if not match:
            raise BadInput(f"{option('max_shard_size', text)} is not a size like 500MB, 5GB, 2GiB or a number of bytes")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if value <= 0:
        raise BadInput(f"{option('max_shard_size', text)}: the size must be positive")
    return value


def tensor_nbytes(tensor: TensorPlan) -> int:
    return tensor.numel * itemsize(tensor.target_dtype)


def split_into_files(tensors: list[TensorPlan], max_shard_size: int) -> list[list[TensorPlan]]:
    groups: list[list[TensorPlan]] = []
    current: list[TensorPlan] = []
    current_size = 0
    for tensor in tensors:
        size = tensor_nbytes(tensor)
        if size > max_shard_size:
            groups.append([tensor])
            continue
        if current and current_size + size > max_shard_size:
            groups.append(current)
            current, current_size = [], 0
        current.append(tensor)
        current_size += size
    if current or not groups:
        groups.append(current)
    return groups


def plan_files(plan: MergePlan, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE) -> list[OutputFile]:
    groups = split_into_files(plan.tensors, parse_size(max_shard_size))
    if len(groups) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    return [_place(name, group) for name, group in zip(names, groups)]


def _place(name: str, tensors: list[TensorPlan]) -> OutputFile:
    ordered = sorted(tensors, key=lambda t: (-itemsize(t.target_dtype), t.name))
    entries, offset = {}, 0
    for tensor in ordered:
        nbytes = tensor_nbytes(tensor)
        entries[tensor.name] = {
            "dtype": safetensors_code(tensor.target_dtype),
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % 8)  # data starts 8-byte aligned
    prefix = len(header).to_bytes(8, "little") + header
    out = OutputFile(name, prefix)
    for tensor in ordered:
        start, end = entries[tensor.name]["data_offsets"]
        out.tensors.append(PlacedTensor(tensor, len(prefix) + start, end - start))
    out.size = len(prefix) + offset
    return out


def index_json(files: list[OutputFile]) -> dict:
    weight_map = {p.tensor.name: f.name for f in files for p in f.tensors}
    total = sum(p.nbytes for f in files for p in f.tensors)
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
