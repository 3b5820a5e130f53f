"""Write one planned safetensors file: header first, then every tensor straight to its offset."""
from __future__ import annotations

import os

from .. import _ops
from ..io.sources import SourceFiles
from ..errors import FsdpfastError
from ..plan.layout import OutputFile, PlacedTensor

BATCH_BYTES = 64 << 20  # output bytes handed to the engine at once; their input pages are dropped after


def write_file(path: str, planned: OutputFile, engine, sources: SourceFiles, progress=None) -> dict[str, int | None]:
    """Write the file; each tensor's CRC-32C by name. `progress(nbytes)` is told as batches finish."""
    checksums = {p.tensor.name: _ops.crc32c(b"") for p in planned.tensors if not p.nbytes}
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)  # less the umask, as open() gives
    try:
        _write(fd, planned, engine, sources, checksums, progress)
    except OSError as exc:  # disk full (ENOSPC), file size limit (EFBIG), quota, I/O error
        if exc.filename:  # an input file, named by the error itself
            raise
        raise _write_failed(path, exc.strerror or str(exc)) from None
    except FsdpfastError as exc:  # the native kernels' I/O errors ("writing the output file: ...")
        raise _write_failed(path, str(exc)) from None
    finally:
        os.close(fd)
    return checksums


def _write_failed(path: str, reason: str) -> FsdpfastError:
    return FsdpfastError(f"cannot write {os.path.basename(path)} ({reason}); nothing was published: "
                         "free space on that disk (or raise the file size limit) or choose another output folder, then run again")


def _write(fd: int, planned: OutputFile, engine, sources: SourceFiles, checksums: dict, progress) -> None:
    os.ftruncate(fd, planned.size)
    os.pwrite(fd, planned.header, 0)
    tensors = [p for p in planned.tensors if p.nbytes and p.tensor.compute is None]
    if tensors:
        with engine.output(fd, planned.size) as output:
            for batch in _batches(tensors):
                checksums.update(zip((p.tensor.name for p in batch), output.write(batch, sources)))
                if progress is not None:
                    progress(sum(p.nbytes for p in batch))
                for source in {e.source for p in batch for e in p.tensor.extents}:
                    sources.release(source)
    computed = [p for p in planned.tensors if p.nbytes and p.tensor.compute is not None]
    if computed:  # --merge-lora: fused weights are computed, not copied
        from ..lora.fuse import write_computed

        checksums.update(write_computed(fd, computed, sources, engine.name, progress))
    os.fsync(fd)


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
