"""Tensors written transposed (plan.model.Transposed): the transposed-copy kernel, one matrix at a time.

A Transposed tensor's extents fill [..., rows, cols]; its bytes are each matrix transposed. Every
engine writes it here: matrix b's elements (extents clipped to it, execute.parts.slice_tensor) are
transposed and cast by csrc/transpose.cpp straight from the source mapping when they are one run
in one source buffer (the common case: a rank holds whole experts), through the torch engine's
gather into a one-matrix buffer otherwise; on the cuda engine's GPU by the op's CUDA kernel. Memory
holds a matrix or two, never the tensor (the native engine writes each matrix at its offset).
"""

from __future__ import annotations

from math import prod

from .. import _ops
from ..dtypes import itemsize, torch_dtype
from ..io.sources import Source
from ..io.target import TargetFile
from ..plan.layout import PlacedTensor
from ..plan.model import TensorPlan, Transposed
from .parts import slice_tensor
from .torch_copy import torch_copy


def is_transposed(tensor: TensorPlan) -> bool:
    return isinstance(tensor.compute, Transposed)


def fill_transposed(tensor: TensorPlan, destination: memoryview, sources: Source, device: str = "cpu") -> None:
    """The whole tensor's bytes (its target dtype) into `destination`."""
    size = _matrix_bytes(tensor)
    for b in range(_matrices(tensor)):
        _matrix_into(tensor, b, destination[b * size : (b + 1) * size], sources, device)


def write_transposed(file: TargetFile, placed: PlacedTensor, sources: Source, device: str = "cpu") -> int | None:
    """Write the tensor a matrix at a time at its offset in `file`; its CRC-32C."""
    tensor, size = placed.tensor, _matrix_bytes(placed.tensor)
    buffer = bytearray(size)
    crc: int | None = _ops.crc32c(b"")
    for b in range(_matrices(tensor)):
        _matrix_into(tensor, b, memoryview(buffer), sources, device)
        file.write_at(buffer, placed.offset + b * size)
        crc = _ops.crc32c_combine(crc, _ops.crc32c(buffer), size) if crc is not None else None
    return crc


def _matrices(tensor: TensorPlan) -> int:
    return prod(tensor.shape[:-2]) if tensor.compute.rows * tensor.compute.cols else 0


def _matrix_bytes(tensor: TensorPlan) -> int:
    return tensor.compute.rows * tensor.compute.cols * itemsize(tensor.target_dtype)


def _matrix_into(tensor: TensorPlan, b: int, out: memoryview, sources: Source, device: str) -> None:
    """Matrix b of the tensor, transposed and cast, into `out`."""
    rows, cols = tensor.compute.rows, tensor.compute.cols
    n = rows * cols
    piece = slice_tensor(tensor, b * n, (b + 1) * n)  # the matrix untransposed: rows x cols
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
