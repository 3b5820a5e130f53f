"""A local output file as a TargetFile (io.target): writes at offsets, windows mapped from the file.

The descriptor stays inside: the native kernels get it through `local_descriptor`, everything else
writes through `write_at` and `window`, the calls a remote target's file has too.
"""

from __future__ import annotations

import errno
import mmap
import os

from .target import Bytes


class LocalFile:
    """An open local output file (a descriptor owned by this object, closed by `close`)."""

    def __init__(self, fd: int):
        self._fd = fd

    @classmethod
    def create(cls, path: str, size: int) -> LocalFile:
        """A new file at `path` (it must not exist), `size` bytes long."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)  # less the umask, as open() gives
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd)

    def write_at(self, data: Bytes, offset: int) -> None:
        view, written = memoryview(data), 0
        while written < len(view):  # pwrite may write less than asked (signals, very large runs)
            written += os.pwrite(self._fd, view[written:], offset + written)

    def window(self, start: int, end: int) -> MappedRange:
        return MappedRange(self._fd, start, end)

    def local_descriptor(self) -> int:
        return self._fd

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> LocalFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MappedRange:
    """Bytes [start, end) of a local file mapped writable and shared (a Window, io.target)."""

    def __init__(self, fd: int, start: int, end: int):
        base = start - start % mmap.ALLOCATIONGRANULARITY  # a mapping starts at a page boundary
        _reserve(fd, start, end)
        self._mapping = mmap.mmap(fd, end - base, access=mmap.ACCESS_WRITE, offset=base)
        self._view = memoryview(self._mapping)
        self._base = base

    def at(self, offset: int, nbytes: int) -> memoryview:
        return self._view[offset - self._base : offset - self._base + nbytes]

    def close(self) -> None:
        self._view.release()
        self._mapping.flush()
        self._mapping.close()


def _reserve(fd: int, start: int, end: int) -> None:
    """Allocate the range's blocks before mapping it: storing into a mapped page the disk has no
    room for kills the process with SIGBUS, while posix_fallocate fails cleanly with ENOSPC."""
    try:
        os.posix_fallocate(fd, start, end - start)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):  # a filesystem without it: map anyway
            raise
