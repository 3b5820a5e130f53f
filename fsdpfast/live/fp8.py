"""save_pretrained(dtype="fp8"): block-scaled float8 written from each rank's own pieces, no gather.

A 128x128 block can straddle the ranks' pieces (FSDP2's rows, FSDP1's flat runs, column shards).
Each rank takes the amax of its own elements of every block (0 where it holds none: zeros change
no amax), one all-reduce MAX over the group gives every rank every block's amax (exact: a max does
not depend on the order it is taken in), and each rank quantizes its own elements with that
block's scale by the rule of csrc/fp8_block.h, in float32 torch ops. The bytes are those of the
whole tensor quantized (the offline --dtype fp8 merge); rank 0 writes the scale_inv tensors.
Memory: the amaxes (one float per block, 1/16384 of the weights) and one piece at a time.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..fp8.plan import Fp8Weight, quantize_plan
from ..fp8.select import BLOCK, scale_shape
from .plan import LiveTensor, extent_runs, hub_piece, local_piece

FP8_MAX = 448.0
CHUNK = 1 << 22  # elements quantized or reduced at once


def plan_fp8(plan, live: list[LiveTensor], skip: tuple[str, ...], packed: bool = False):
    """The plan with its linear weights quantized (as the offline merge plans them) and the live tensors
    to write: each quantized weight marked with its plan, and its scale_inv as a tensor still to compute."""
    import torch

    plan = quantize_plan(plan, skip, packed)
    quantized = {t.name: t for t in plan.tensors if isinstance(t.compute, Fp8Weight)}
    out = []
    for tensor in live:
        weight = quantized.get(tensor.name)
        if weight is None:
            out.append(tensor)
            continue
        scale = next(
            t
            for t in plan.tensors
            if t.compute is not None and t.compute.base is weight.compute.base and t.compute.part == "scale"
        )
        out.append(replace(tensor, fp8=weight.compute.base))
        placeholder = torch.empty(scale.shape, dtype=torch.float32, device="meta")  # computed by `exchange`
        out.append(LiveTensor(scale.name, tensor.key, placeholder, fp8_scale_of=tensor.name))
    return plan, out


def exchange(live: list[LiveTensor], rank: int, group, redistribute: bool = False) -> list[LiveTensor]:
    """Every block's amax agreed over the group (a collective: every rank calls it with the same list):
    the live tensors with each weight's scales and each scale_inv tensor's value."""
    import torch

    weights = [t for t in live if t.fp8 is not None]
    amaxes = [_local_amax(t, rank, redistribute) for t in weights]
    if amaxes and group is not None:
        import torch.distributed as dist

        flat = torch.cat([a.reshape(-1) for a in amaxes])
        if "nccl" in str(dist.get_backend(group)) and "gloo" not in str(dist.get_backend(group)):
            flat = flat.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        flat, at = flat.cpu(), 0
        for i, a in enumerate(amaxes):
            amaxes[i], at = flat[at : at + a.numel()].view(a.shape), at + a.numel()
    scales = {t.name: _scale(a) for t, a in zip(weights, amaxes)}
    out = []
    for t in live:
        if t.fp8 is not None:
            out.append(replace(t, fp8_scale=scales[t.name]))
        elif t.fp8_scale_of is not None:
            out.append(replace(t, value=(1.0 / scales[t.fp8_scale_of]).contiguous()))  # scale_inv = 1 / scale
        else:
            out.append(t)
    return out


def quantized_piece(tensor: LiveTensor, piece):
    """This rank's piece of a quantized weight as float8 (same elements, same extents)."""
    import torch

    data = _as_planned(tensor, piece.data.reshape(-1))
    scale = tensor.fp8_scale.to(data.device).reshape(-1)
    out = torch.zeros(data.numel(), dtype=torch.float8_e4m3fn, device=data.device)
    for src, dst in _element_chunks(extent_runs(piece.extents).to(data.device)):
        x = data[src].float()
        s = scale[_block_of(dst, tensor.fp8.shape)]
        out[src] = (x * s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return replace(piece, data=out)


def _local_amax(tensor: LiveTensor, rank: int, redistribute: bool):
    """The amax of this rank's elements of each block of the weight (float32, CPU; 0 where it holds none)."""
    import torch

    shape = scale_shape(tensor.fp8.shape)
    amax = torch.zeros(math.prod(shape), dtype=torch.float32)
    piece = hub_piece(tensor, local_piece(tensor.value, rank, tensor.key, redistribute))
    if piece is None or not piece.data.numel():
        return amax.view(shape)
    data = _as_planned(tensor, piece.data.reshape(-1))
    amax = amax.to(data.device)
    for src, dst in _element_chunks(extent_runs(piece.extents).to(data.device)):
        amax.scatter_reduce_(0, _block_of(dst, tensor.fp8.shape), data[src].float().abs(), "amax")
    return amax.view(shape).cpu()


def _as_planned(tensor: LiveTensor, data):
    """The elements as the plan converts the weight before quantizing it (bfloat16, or float32 kept)."""
    import torch

    return data.to(getattr(torch, tensor.fp8.target_dtype))


def _scale(amax):
    """csrc/fp8_block.h's scale: (1 / amax) * 448 where amax > 0, else 1."""
    import torch

    return torch.where(amax > 0, (1.0 / amax) * FP8_MAX, torch.ones_like(amax))


def _block_of(dst, shape: tuple[int, ...]):
    """The flat index in the scales (per matrix of the last two dims, 128x128 blocks) of each element
    at flat tensor index `dst`."""
    rows, cols = shape[-2:]
    block_rows, block_cols = scale_shape(shape)[-2:]
    matrix, within = dst // (rows * cols), dst % (rows * cols)
    return (matrix * block_rows + within // cols // BLOCK[0]) * block_cols + (within % cols) // BLOCK[1]


def _element_chunks(runs):
    """(source indices, tensor indices) of the runs' elements (source, count, tensor start per run),
    at most about CHUNK elements at a time."""
    import torch

    if not len(runs):
        return
    parts = -(-runs[:, 1] // CHUNK)  # long runs split into pieces of CHUNK elements
    run = torch.repeat_interleave(torch.arange(len(runs), device=runs.device), parts)
    first = torch.arange(len(run), device=runs.device) - torch.repeat_interleave(torch.cumsum(parts, 0) - parts, parts)
    skip = first * CHUNK
    count = torch.minimum(runs[run, 1] - skip, torch.full_like(skip, CHUNK))
    src, dst = runs[run, 0] + skip, runs[run, 2] + skip
    start = 0
    while start < len(run):
        end, total = start, 0
        while end < len(run) and (end == start or total + int(count[end]) <= CHUNK):
            total += int(count[end])
            end += 1
        n = count[start:end]
        offsets = torch.arange(total, device=runs.device) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        yield (
            torch.repeat_interleave(src[start:end], n) + offsets,
            torch.repeat_interleave(dst[start:end], n) + offsets,
        )
        start = end
