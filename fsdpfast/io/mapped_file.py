"""An input file mapped into memory without keeping a file descriptor open for it.

A mapping outlives the descriptor it was made from, so a merge of any number of rank files needs
one descriptor at a time. Python's mmap keeps a duplicate descriptor for as long as the mapping
lives (until Python 3.13, where `trackfd=False` stops it): with it, a merge of more input files
than the open-file limit (`ulimit -n`, 1,024 by default) would fail. Before 3.13 the mapping is
made with the C library's mmap through ctypes and seen through a ctypes array: views of it keep it
alive, and it is unmapped when the last view is gone. Where neither is available, Python's mmap.

Mappings are private and writable (copy-on-write), as mmap.ACCESS_COPY: views are writable so
torch.frombuffer stays quiet, and nothing is ever written, so no page is copied and the file is
never modified.
"""

from __future__ import annotations

import mmap
import os
import sys

from ..errors import out_of_files


class _Mmap:
    """Python's mmap (from 3.13 without a descriptor)."""

    def __init__(self, fd: int, size: int):
        extra = {"trackfd": False} if sys.version_info >= (3, 13) else {}
        self._mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY, **extra)
        self._whole = memoryview(self._mapping)  # sliced for every view: one export, not one per view

    def __len__(self) -> int:
        return len(self._mapping)

    def view(self, start: int, end: int) -> memoryview:
        return self._whole[start:end]

    def release(self, start: int, length: int) -> None:
        if hasattr(mmap, "MADV_DONTNEED"):
            self._mapping.madvise(mmap.MADV_DONTNEED, start, length)

    def close(self) -> None:
        self._whole.release()
        try:
            self._mapping.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass


class _LibcMapping:
    """libc's mmap, seen through a ctypes array that unmaps itself when the last view is gone."""

    def __init__(self, fd: int, size: int):
        libc = _libc()
        address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
        if address in (None, _MAP_FAILED):
            import ctypes

            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        self._array = _owning_array(size).from_address(address)
        self._whole = memoryview(self._array)  # sliced for every view: one export, not one per view
        self._address, self._size = address, size
        self._madvise = libc.madvise  # called once per consumed buffer: looked up once

    def __len__(self) -> int:
        return self._size

    def view(self, start: int, end: int) -> memoryview:
        return self._whole[start:end]

    def release(self, start: int, length: int) -> None:
        if self._array is not None and _DONTNEED is not None:
            self._madvise(self._address + start, length, _DONTNEED)

    def close(self) -> None:
        self._whole.release()
        self._array = None  # unmapped now, or when the last view of it goes


_MAP_FAILED = (1 << 64) - 1  # (void *) -1 as ctypes returns it on a 64-bit platform
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        )
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _LIBC = libc
    return _LIBC


def _owning_array(size: int):
    """A ctypes array type of `size` bytes whose instances unmap their memory when collected."""
    import ctypes

    def unmap(array):
        _libc().munmap(ctypes.addressof(array), size)

    return type("MappedBytes", (ctypes.c_ubyte * size,), {"__del__": unmap})


def _libc_usable() -> bool:
    if sys.version_info >= (3, 13) or os.name != "posix" or sys.maxsize < 1 << 32:
        return False
    try:
        _libc()
    except (ImportError, OSError, AttributeError):
        return False
    return True


_USE_LIBC = _libc_usable()


def map_file(path: str):
    """The whole file, mapped; the descriptor is closed before this returns (see the module doc).
    An empty file gives an empty buffer (nothing to map)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        error = out_of_files(exc, path)
        if error is None:
            raise
        raise error from None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return _Empty()
        return _LibcMapping(fd, size) if _USE_LIBC else _Mmap(fd, size)
    finally:
        os.close(fd)


class _Empty:
    def __len__(self) -> int:
        return 0

    def view(self, start: int, end: int) -> memoryview:
        return memoryview(bytearray())

    def release(self, start: int, length: int) -> None:
        pass

    def close(self) -> None:
        pass
