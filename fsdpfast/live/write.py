"""Write this rank's runs of a live model's tensors at their final offsets in the shared output files.

Each run is cast where the tensor lives (on the GPU for CUDA tensors, as torch's `.to()` rounds,
the rounding an offline merge uses), copied to host memory, and written with pwrite by a writer
thread while the next tensor is cast: two buffers in flight at most, so host memory stays at
two tensors' shards, never the model. Each run's CRC-32C is returned (a Piece) for the manifest.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import Future, ThreadPoolExecutor

from .. import _ops
from ..dtypes import itemsize, torch_dtype
from ..execute.parts import Piece
from ..plan.layout import OutputFile
from .state import LiveTensor, local_run

IN_FLIGHT = 2  # buffers cast and waiting to be written, at most


def write_runs(files: list[OutputFile], tensors: list[LiveTensor], open_file, rank: int) -> list[Piece]:
    """Write what this rank holds of `tensors` (every rank calls this with the same list: redistribution
    is collective); `open_file(name, size)` gives a writable descriptor of an output file."""

    where = {p.tensor.name: (f, p) for f in files for p in f.tensors}
    fds: dict[str, int] = {}
    pieces: list[Piece] = []
    pending: list[Future] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdpfast-write") as writer:
        try:
            for tensor in tensors:
                run = local_run(tensor.value, rank)
                file, placed = where[tensor.name]
                if run is None or not run[1].numel():
                    continue
                start, data = run
                host = data.to(torch_dtype(placed.tensor.target_dtype)).to("cpu").contiguous()
                if file.name not in fds:
                    fds[file.name] = open_file(file.name, file.size)
                offset = start * itemsize(placed.tensor.target_dtype)
                pending.append(
                    writer.submit(_write, fds[file.name], host, placed.offset + offset, file.name, tensor.name, offset)
                )
                while len(pending) >= IN_FLIGHT:
                    pieces.append(pending.pop(0).result())
            pieces += [future.result() for future in pending]
            for fd in fds.values():
                os.fsync(fd)
        finally:
            for future in pending:
                future.cancel()
            for fd in fds.values():
                os.close(fd)
    return pieces


def _write(fd: int, host, file_offset: int, file: str, tensor: str, tensor_offset: int) -> Piece:
    view = _bytes_of(host)
    written = 0
    while written < len(view):  # pwrite may write less than asked (signals, very large runs)
        written += os.pwrite(fd, view[written:], file_offset + written)
    return Piece(file, tensor, tensor_offset, len(view), _ops.crc32c(view))


def _bytes_of(tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the caller keeps the tensor alive)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
