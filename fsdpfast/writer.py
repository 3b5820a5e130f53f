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


def _write_tensors(fd: int, planned: OutputFile, engine, sources: SourceFiles) -> None:
    mapping = mmap.mmap(fd, planned.size, access=mmap.ACCESS_WRITE)
    try:
        view = memoryview(mapping)
        for placed in planned.tensors:
            if placed.nbytes == 0:
                continue
            engine.execute([(placed.tensor, view[placed.offset: placed.offset + placed.nbytes])], sources)
            for extent_source in {e.source for e in placed.tensor.extents}:
                sources.release(extent_source)
        view.release()
        mapping.flush()
    finally:
        mapping.close()
