"""How engines reach an output file: through a shared mapping, or by writing chunks at offsets."""
from __future__ import annotations

import errno
import mmap
import os

from .. import _ops
from ..plan.layout import PlacedTensor
from ..io.sources import SourceFiles


class MappedOutput:
    """The output file mapped writable; `execute(jobs, sources)` fills (tensor, byte view) jobs."""

    def __init__(self, fd: int, size: int, execute):
        _reserve(fd, size)
        self._mapping = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        self._view = memoryview(self._mapping)
        self._execute = execute

    def write(self, placed: list[PlacedTensor], sources: SourceFiles) -> list[int | None]:
        """Fill the tensors; their CRC-32Cs, taken from the freshly written pages (None without the native module)."""
        views = [self._view[p.offset: p.offset + p.nbytes] for p in placed]
        self._execute(list(zip((p.tensor for p in placed), views)), sources)
        crcs = [_ops.crc32c(view) for view in views]
        for view in views:
            view.release()
        return crcs

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._view.release()
        self._mapping.flush()
        self._mapping.close()


def _reserve(fd: int, size: int) -> None:
    """Allocate the file's blocks before mapping it: storing into a mapped page the disk has no
    room for kills the process with SIGBUS, while posix_fallocate fails cleanly with ENOSPC."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):  # a filesystem without it: map anyway
            raise


def write_through_buffer(fd: int, placed: PlacedTensor, execute, sources: SourceFiles) -> int | None:
    """Fill one tensor in a buffer of its own size, then write it at its offset (rare dtype pairs); its CRC-32C."""
    buffer = bytearray(placed.nbytes)
    execute([(placed.tensor, memoryview(buffer))], sources)
    os.pwrite(fd, buffer, placed.offset)
    return _ops.crc32c(buffer)
