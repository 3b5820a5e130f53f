"""Where input bytes come from: a Source hands out each plan source buffer as a byte view.

SourceFiles is the local Source: input files mapped once, read-only in effect. PreadSources
(io.pread_sources) reads the byte ranges announced with `read_ahead` with large explicit reads,
for network filesystems and FUSE mounts (io.read_modes); a remote store would do the same.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Protocol

from ..plan.model import SourceBuffer
from .mapped_file import map_file


class Source(Protocol):
    """The bytes of a plan's source buffers (MergePlan.sources), by index."""

    def view(self, index: int) -> memoryview:
        """The buffer's bytes; the caller releases the view when done with it."""

    def release(self, index: int) -> None:
        """The buffer has been consumed: its memory may be given back (it can still be viewed again)."""

    def read_ahead(self, ranges: dict[int, list[tuple[int, int]]]) -> None:
        """Byte ranges [start, end) of buffers, by index, that the next views will read (a batch's)."""

    def close(self) -> None: ...


def open_sources(buffers: list[SourceBuffer], read_mode: str = "mmap") -> Source:
    """The Source for a merge's buffers read the way io.read_modes chose (mmap or pread)."""
    if read_mode == "pread":
        from .pread_sources import PreadSources

        return PreadSources(buffers)
    return SourceFiles(buffers)


_FAULT_AROUND = 1 << 16  # Linux's default fault_around_bytes: file pages mapped together on a read fault


class SourceFiles:
    """Maps each input file at most once. Private copy-on-write mappings give writable views
    (so torch.frombuffer stays quiet) while nothing is ever written: no page is copied and
    the files are never modified. No file stays open (io.mapped_file): any number of inputs."""

    drops_pages_as_read = True  # the kernels may madvise pages away as they read: they come back from the file
    reads_announced_ranges = False  # the runner announces nothing: page faults read what is touched

    def __init__(self, buffers: list[SourceBuffer]):
        self.buffers = buffers
        self._maps: dict = {}

    def view(self, index: int) -> memoryview:
        buffer = self.buffers[index]
        mapping = self._maps.get(buffer.path)
        if mapping is None:
            mapping = map_file(buffer.path)
            self._maps[buffer.path] = mapping
        return mapping.view(buffer.byte_offset, buffer.byte_offset + buffer.nbytes)

    def read_ahead(self, ranges: dict[int, list[tuple[int, int]]]) -> None:
        """Nothing: the page faults read (and the kernel reads ahead of them)."""

    def release(self, index: int) -> None:
        """Drop the pages of a consumed buffer from this process (the page cache keeps them).

        Reading a mapped file page makes the kernel map its neighbours too (fault-around: the
        aligned 64 KB window around it), so reading a buffer also maps the tail of the buffer
        before it, already released, and the head of the one after it. The release therefore
        covers the whole windows the buffer touches; otherwise those pages stay mapped until
        the end, a few for every tensor of every rank file, and RSS grows with the tensor count.
        Neighbours dropped early are mapped again from the page cache if still needed.
        """
        buffer = self.buffers[index]
        mapping = self._maps.get(buffer.path)
        if mapping is None:
            return
        start = buffer.byte_offset - buffer.byte_offset % _FAULT_AROUND
        end = min(len(mapping), -(-(buffer.byte_offset + buffer.nbytes) // _FAULT_AROUND) * _FAULT_AROUND)
        if end > start:
            mapping.release(start, end - start)

    def close(self) -> None:
        for mapping in self._maps.values():
            mapping.close()  # a view still alive somewhere keeps its mapping until it goes
        self._maps.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def rebased(buffers: list[SourceBuffer], old_root: str, new_root: str) -> list[SourceBuffer]:
    """The buffers of files inside `old_root` as files inside `new_root` (another process's view of
    one checkpoint folder, perhaps mounted elsewhere); files outside it (a --base folder) unchanged."""
    if os.path.abspath(old_root) == os.path.abspath(new_root):
        return buffers
    old = os.path.abspath(old_root)
    moved = {}
    for path in {b.path for b in buffers}:
        relative = os.path.relpath(os.path.abspath(path), old)
        moved[path] = path if relative.startswith(os.pardir) else os.path.join(new_root, relative)
    return [replace(b, path=moved[b.path]) for b in buffers]
