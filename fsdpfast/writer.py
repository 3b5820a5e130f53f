"""Write one planned safetensors file: header first, then every tensor straight to its offset."""
from __future__ import annotations

import os

from . import _ops
from .engine.sources import SourceFiles
from .layout import OutputFile, PlacedTensor

BATCH_BYTES = 64 << 20  # output bytes handed to the engine at once; their input pages are dropped after


def write_file(path: str, planned: OutputFile, engine, sources: SourceFiles, progress=None) -> dict[str, int | None]:
    """Write the file; each tensor's CRC-32C by name. `progress(nbytes)` is told as batches finish."""
    checksums = {p.tensor.name: _ops.crc32c(b"") for p in planned.tensors if not p.nbytes}
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, planned.size)
        os.pwrite(fd, planned.header, 0)
        tensors = [p for p in planned.tensors if p.nbytes]
        if tensors:
            with engine.output(fd, planned.size) as output:
                for batch in _batches(tensors):
                    checksums.update(zip((p.tensor.name for p in batch), output.write(batch, sources)))
                    if progress is not None:
                        progress(sum(p.nbytes for p in batch))
                    for source in {e.source for p in batch for e in p.tensor.extents}:
                        sources.release(source)
        os.fsync(fd)
    finally:
        os.close(fd)
    return checksums


def _batches(placed: list[PlacedTensor]) -> list[list[PlacedTensor]]:
    """Consecutive tensors grouped up to BATCH_BYTES, so small tensors share one engine call."""
    batches, current, size = [], [], 0
    for p in placed:
        if current and size + p.nbytes > BATCH_BYTES:
            batches.append(current)
            current, size = [], 0
        current.append(p)
        size += p.nbytes
    if current:
        batches.append(current)
    return batches
