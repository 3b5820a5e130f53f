"""Write one planned safetensors file: header first, then every tensor straight to its offset."""
from __future__ import annotations

import mmap
import os

from .engine.sources import SourceFiles
from .layout import OutputFile


def write_file(path: str, planned: OutputFile, engine, sources: SourceFiles) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, planned.size)
        os.pwrite(fd, planned.header, 0)
        data_bytes = planned.size - len(planned.header)
        if data_bytes:
            _write_tensors(fd, planned, engine, sources)
        os.fsync(fd)
    finally:
        os.close(fd)


BATCH_BYTES = 256 << 20  # tensors handed to the engine at once; their input pages are dropped after


def _write_tensors(fd: int, planned: OutputFile, engine, sources: SourceFiles) -> None:
    mapping = mmap.mmap(fd, planned.size, access=mmap.ACCESS_WRITE)
    try:
        view = memoryview(mapping)
        for batch in _batches([p for p in planned.tensors if p.nbytes]):
            engine.execute([(p.tensor, view[p.offset: p.offset + p.nbytes]) for p in batch], sources)
            for source in {e.source for p in batch for e in p.tensor.extents}:
                sources.release(source)
        view.release()
        mapping.flush()
    finally:
        mapping.close()


def _batches(placed: list) -> list[list]:
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
