"""Tensors written transposed (plan.model.Transposed): the transposed-copy kernel, one matrix at a time.

A Transposed tensor's extents fill [..., rows, cols]; its bytes are each matrix transposed. Every
engine writes it here: matrix b's elements (extents clipped to it, _pieces) are
transposed and cast by csrc/transpose.cpp straight from the source mapping when they are one run
in one source buffer (the common case: a rank holds whole experts); when its rows are a few blocks' rows
dealt out in turn (gpt-oss's gate_up_proj from Megatron's fc1: gate row j at 2j, up row j at 2j + 1), by a
transposed copy per block into a buffer and one across the blocks (interleaved_block); through the torch
engine's gather into a one-matrix buffer otherwise; on the cuda engine's GPU by the op's CUDA kernel. Memory
holds a matrix or two, never the tensor (the native engine writes each matrix at its offset).
"""

from __future__ import annotations

from dataclasses import replace
from math import prod

from .. import _ops
from ..dtypes import itemsize, torch_dtype
from ..io.sources import Source
from ..io.target import TargetFile
from ..plan.layout import PlacedTensor
from ..plan.model import Extent, TensorPlan, Transposed
from .parts import clip_extent
from .torch_copy import torch_copy


def is_transposed(tensor: TensorPlan) -> bool:
    return isinstance(tensor.compute, Transposed)


def fill_transposed(tensor: TensorPlan, destination: memoryview, sources: Source, device: str = "cpu") -> None:
    """The whole tensor's bytes (its target dtype) into `destination`."""
    size = _matrix_bytes(tensor)
    for b, piece in enumerate(_pieces(tensor)):
        _matrix_into(tensor, piece, destination[b * size : (b + 1) * size], sources, device)


def write_transposed(file: TargetFile, placed: PlacedTensor, sources: Source, device: str = "cpu") -> int | None:
    """Write the tensor a matrix at a time at its offset in `file`; its CRC-32C."""
    tensor, size = placed.tensor, _matrix_bytes(placed.tensor)
    buffer = bytearray(size)
    crc: int | None = _ops.crc32c(b"")
    for b, piece in enumerate(_pieces(tensor)):
        _matrix_into(tensor, piece, memoryview(buffer), sources, device)
        file.write_at(buffer, placed.offset + b * size)
        crc = _ops.crc32c_combine(crc, _ops.crc32c(buffer), size) if crc is not None else None
    return crc


def _matrices(tensor: TensorPlan) -> int:
    return prod(tensor.shape[:-2]) if tensor.compute.rows * tensor.compute.cols else 0


def _matrix_bytes(tensor: TensorPlan) -> int:
    return tensor.compute.rows * tensor.compute.cols * itemsize(tensor.target_dtype)


def _pieces(tensor: TensorPlan) -> list[TensorPlan]:
    """Each matrix of the tensor untransposed (rows x cols) as a flat tensor of its own (execute.parts.slice_tensor),
    every extent visited once: an extent inside one matrix is shifted to it, one across matrices clipped to each.
    (Slicing the whole extent list per matrix costs matrices x extents, and a plan may hold many: gpt-oss's
    gate_up_proj from Megatron had an extent per fc1 row and expert before its windows took a step.)"""
    n, count = tensor.compute.rows * tensor.compute.cols, _matrices(tensor)
    extents: list[list[Extent]] = [[] for _ in range(count)]
    for e in tensor.extents:
        if not e.numel:
            continue
        first = e.dst_offset // n
        last = (e.dst_offset + (e.runs - 1) * (e.dst_stride or e.count) + e.count - 1) // n
        if first == last:
            extents[first].append(replace(e, dst_offset=e.dst_offset - first * n))
            continue
        for b in range(first, last + 1):
            extents[b] += clip_extent(e, b * n, (b + 1) * n)
    return [replace(tensor, shape=(n,), extents=found, aliases=[], compute=None) for found in extents]


def _matrix_into(tensor: TensorPlan, piece: TensorPlan, out: memoryview, sources: Source, device: str) -> None:
    """One matrix of the tensor (`piece`, from _pieces), transposed and cast, into `out`."""
    rows, cols = tensor.compute.rows, tensor.compute.cols
    n = rows * cols
    same = piece.source_dtype == piece.target_dtype
    codes = (0, 0) if same else (_ops.code(piece.source_dtype), _ops.code(piece.target_dtype))
    native = device == "cpu" and _ops.native_cpu() and (same or 0 not in codes)
    single = len(piece.extents) == 1 and piece.extents[0].numel == n and (piece.extents[0].runs == 1 or n == 0)
    if native and single:  # straight from the source mapping: one pass, no buffer
        e, size = piece.extents[0], itemsize(piece.source_dtype)
        view = sources.view(e.source)[e.src_offset * size : (e.src_offset + n) * size]
        try:
            _transpose_native(view, out, rows, cols, piece, codes)
        finally:
            view.release()
        return
    blocks = interleaved_block(piece, rows, cols) if native else None
    if blocks:  # gpt-oss's gate/up: native transposes, no gather of a row at a time
        _transpose_interleaved(piece, out, rows, cols, codes, sources, blocks)
        return
    # Gathered first (cast on the way, as the torch engine casts), then transposed without a cast.
    gathered = bytearray(len(out))
    torch_copy([(piece, memoryview(gathered))], sources)
    if native:
        _transpose_native(gathered, out, rows, cols, piece, (0, 0), cast=False)
        return
    import torch

    dtype = torch_dtype(piece.target_dtype)
    matrix = torch.frombuffer(gathered, dtype=dtype).view(rows, cols)
    result = torch.frombuffer(out, dtype=dtype)
    if _ops.torch_ops() and (device == "cpu" or _ops.native_cuda()):
        result.copy_(torch.ops.fsdpfast.transposed(matrix.to(device)).reshape(-1).cpu())
    else:  # no extension: torch's own transposed copy, the same bytes
        result.copy_(matrix.t().contiguous().reshape(-1))


def _transpose_native(source, out, rows: int, cols: int, piece: TensorPlan, codes, cast: bool = True) -> None:
    size_in = itemsize(piece.source_dtype if cast else piece.target_dtype)
    _ops.native().transpose_convert(
        source, out, 1, rows, cols, codes[0], codes[1], size_in, itemsize(piece.target_dtype), _ops.cpu_threads()
    )


def interleaved_block(piece: TensorPlan, rows: int, cols: int) -> list[tuple[int, int]] | None:
    """(source, first element) of each of `groups` blocks of rows / groups rows, when the matrix's rows are
    the blocks' dealt out in turn: row j * groups + k is block k's row j (gpt-oss's gate_up_proj from
    Megatron's fc1: groups 2, gate row j at 2j, up row j at 2j + 1; megatron-core saves gate and up as
    chunks of their own). None otherwise."""
    starts: list[tuple[int, int] | None] = [None] * rows
    for e in piece.extents:
        if e.count % cols or e.dst_offset % cols:
            return None
        for run in range(e.runs):
            dst = e.dst_offset + run * ((e.dst_stride or e.count) if e.runs > 1 else e.count)
            src = e.src_offset + run * ((e.src_stride or e.count) if e.runs > 1 else e.count)
            for r in range(e.count // cols):
                row = dst // cols + r
                if row >= rows or starts[row] is not None:
                    return None
                starts[row] = (e.source, src + r * cols)
    if rows < 4 or None in starts:
        return None
    second = (starts[0][0], starts[0][1] + cols)  # block 0's second row: row `groups`
    groups = next((i for i in range(1, rows // 2 + 1) if starts[i] == second), 0)
    if not groups or rows % groups:
        return None
    blocks = starts[:groups]
    if any(starts[i] != (blocks[i % groups][0], blocks[i % groups][1] + (i // groups) * cols) for i in range(rows)):
        return None
    return blocks


def _transpose_interleaved(piece, out, rows: int, cols: int, codes, sources: Source, blocks: list[tuple[int, int]]):
    """Each block transposed and cast into its place in a buffer of (groups, cols, per) elements (per = rows /
    groups), then that buffer, as (groups, cols * per), transposed: element (c, j, k) is block k's (j, c)."""
    size_in, size_out = itemsize(piece.source_dtype), itemsize(piece.target_dtype)
    per = rows // len(blocks)
    staged = memoryview(bytearray(len(out)))
    for k, (source, base) in enumerate(blocks):
        view = sources.view(source)[base * size_in : (base + per * cols) * size_in]
        try:
            _transpose_native(
                view, staged[k * per * cols * size_out : (k + 1) * per * cols * size_out], per, cols, piece, codes
            )
        finally:
            view.release()
    _ops.native().transpose_convert(
        staged, out, 1, len(blocks), cols * per, 0, 0, size_out, size_out, _ops.cpu_threads()
    )
