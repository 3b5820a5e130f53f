"""A Source that reads with large explicit preads, many in flight, instead of mapping the files.

For network filesystems and FUSE mounts (io.read_modes): there a page fault of a mapped file is a
round trip and the kernel keeps few in flight, while reads of megabytes on a pool of threads (the
system call releases the GIL) keep many requests outstanding.

Each source buffer is seen through an anonymous mapping of its size: address space only, no
memory until bytes are read into it. The runner announces the byte ranges of the batches ahead
(`read_ahead`), as many as fit in `ahead_bytes` of input, so they are read while the engine
converts the batch before; `view` waits for the buffer's oldest announced ranges. The file's cached
pages are dropped (posix_fadvise) by the reading thread as soon as its bytes are copied out, and when
a batch is done (`release`) its ranges' memory goes back (madvise): memory stays under ahead_bytes
plus a batch (about 230 MB), whatever the model. (Dropping the file's pages in `release` cost the
merge's own thread 0.2-0.3 s of 1.6-2.9 s on a 2 ms FUSE mount: a lock shared with 128 readers and
a system call per range, in turn with converting; profile in docs/performance.md.)
One read ahead was not enough: a 16 MB batch is only a few requests, and on a mount that answers
each after a round trip the link sat idle while a batch was converted (0.5x of the parallel-read
floor at 2 ms a request; with 128 MB ahead in 1 MB reads, about 0.8x).
A page a later announced range still needs is kept. Bytes outside the announced ranges read as
zeros, so a buffer viewed without an announcement is read whole first.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import out_of_files
from ..manifest import SourceChanged
from ..plan.model import SourceBuffer

BATCH_BYTES = 16 << 20  # output bytes per batch (execute.runner)
AHEAD_BYTES = 128 << 20  # input bytes announced past the batch being converted: the reads kept in flight
READ_BYTES = 1 << 20  # one pread: a round trip costs little at this size, and a batch is many requests in flight
THREADS = 128  # reads in flight: a network filesystem's latency hidden behind many outstanding requests
OPEN_FILES = 64  # descriptors kept open between reads (opening on a network filesystem is a round trip)
_PAGE = mmap.PAGESIZE
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)


class PreadSources:
    """The plan's source buffers (MergePlan.sources), read in byte ranges by a pool of threads."""

    drops_pages_as_read = False  # the kernels must not madvise these buffers: they are memory, not a file's pages
    reads_announced_ranges = True  # the runner cuts tensors larger than a batch, so a read stays about a batch
    batch_bytes = BATCH_BYTES  # output bytes per batch: reading the next ones overlaps converting this one
    ahead_bytes = AHEAD_BYTES  # the runner announces batches up to this many input bytes ahead

    def __init__(self, buffers: list[SourceBuffer], threads: int = THREADS, read_bytes: int = READ_BYTES):
        self.buffers = buffers
        self.read_bytes = read_bytes
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="fsdpfast-pread")
        self._files = _OpenFiles(OPEN_FILES)
        self._memory: dict[int, mmap.mmap] = {}
        self._announced: dict[int, list[_Batch]] = {}  # index -> its ranges and reads, per batch, oldest first

    def read_ahead(self, ranges: dict[int, list[tuple[int, int]]]) -> None:
        """Start reading byte ranges [start, end) of these buffers (a batch's): they are needed next."""
        for index, wanted in ranges.items():
            batch = self.announce(index, wanted)
            memory = self._memory_of(index)
            for start, end in batch.ranges:
                for at in range(start, end, self.read_bytes):
                    batch.reads.append(self._pool.submit(self._read, index, memory, at, min(end, at + self.read_bytes)))

    def announce(self, index: int, wanted: list[tuple[int, int]]) -> _Batch:
        """A batch's ranges of this buffer, merged and queued behind the earlier ones, its memory mapped;
        the caller starts the reads and adds them to `batch.reads` (read_ahead here, RangeSources' GETs)."""
        batch = _Batch(_merged(wanted, self.buffers[index].nbytes))
        self._announced.setdefault(index, []).append(batch)
        self._memory_of(index)
        return batch

    def view(self, index: int) -> memoryview:
        """The buffer, its oldest announced batch's ranges read (the whole buffer when none was announced)."""
        if index not in self._announced:
            self.read_ahead({index: [(0, self.buffers[index].nbytes)]})
        self._announced[index][0].wait()  # a failed read raises here, in the merge's thread
        return memoryview(self._memory_of(index))[: self.buffers[index].nbytes]

    def release(self, index: int) -> None:
        """The oldest announced batch is done with this buffer: give back its ranges' memory, but no
        page a later batch's ranges touch (the file's cached pages went as they were read)."""
        batches = self._announced.get(index)
        if not batches:
            return
        done = batches.pop(0)
        done.wait(raising=False)  # no read may still be landing in pages given back
        later = [r for batch in batches for r in batch.ranges]
        memory = self._memory[index]
        for start, end in done.ranges:
            if _DONTNEED is not None:
                for lo, hi in _pages_outside(start, end, later):
                    memory.madvise(_DONTNEED, lo, hi - lo)
        if not batches:
            del self._announced[index]
            _close(self._memory.pop(index))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for memory in self._memory.values():
            _close(memory)
        self._memory.clear()
        self._announced.clear()
        self._files.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _memory_of(self, index: int) -> mmap.mmap:
        memory = self._memory.get(index)
        if memory is None:
            size = max(1, self.buffers[index].nbytes)  # an empty mapping cannot be made
            flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | getattr(mmap, "MAP_NORESERVE", 0)
            memory = mmap.mmap(-1, size, flags=flags)
            self._memory[index] = memory
        return memory

    def _read(self, index: int, memory: mmap.mmap, start: int, end: int) -> None:
        """Bytes [start, end) of buffer `index` into its memory, with as few preads as the file allows."""
        buffer = self.buffers[index]
        view = memoryview(memory)[start:end]
        try:
            done = 0
            with self._files.open(buffer.path) as fd:
                while done < end - start:
                    try:
                        got = os.preadv(fd, [view[done:]], buffer.byte_offset + start + done)
                    except OSError as exc:  # named as the input's: not taken for the output's
                        raise OSError(exc.errno, exc.strerror, buffer.path) from None
                    if got == 0:
                        raise SourceChanged(
                            f"{buffer.path}: the file ends at {buffer.byte_offset + start + done} bytes, before the "
                            f"{buffer.byte_offset + buffer.nbytes} the merge planned from: it changed during the merge; "
                            "nothing was published; merge again once the checkpoint is complete"
                        )
                    done += got
                _drop_cached(fd, buffer.byte_offset + start, end - start)  # copied out: not kept on our account
        finally:
            view.release()


class _Batch:
    """One batch's ranges of a buffer and the reads filling them."""

    def __init__(self, ranges: list[tuple[int, int]]):
        self.ranges = ranges
        self.reads: list[Future] = []

    def wait(self, raising: bool = True) -> None:
        for read in self.reads:
            error = read.exception()
            if error is not None and raising:
                raise error
        if raising:
            self.reads = []  # read: waiting again costs nothing


def _merged(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The ranges clipped to [0, size), sorted, overlapping or touching ones joined."""
    found: list[tuple[int, int]] = []
    for start, end in sorted((max(0, s), min(size, e)) for s, e in ranges):
        if start >= end:
            continue
        if found and start <= found[-1][1]:
            found[-1] = (found[-1][0], max(found[-1][1], end))
        else:
            found.append((start, end))
    return found


def _drop_cached(fd: int, offset: int, length: int) -> None:
    """The page cache's copy of bytes the merge has read into its own memory: not kept on its account."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:  # advice only
            pass


def _pages_outside(start: int, end: int, kept: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole pages inside [start, end) that no range of `kept` touches, as runs [lo, hi)."""
    lo, hi = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
    runs = [(lo, hi)] if hi > lo else []
    for k_start, k_end in kept:
        k_lo, k_hi = k_start // _PAGE * _PAGE, -(-k_end // _PAGE) * _PAGE  # every page the range touches
        cut = []
        for r_lo, r_hi in runs:
            if k_hi <= r_lo or k_lo >= r_hi:
                cut.append((r_lo, r_hi))
                continue
            if r_lo < k_lo:
                cut.append((r_lo, k_lo))
            if k_hi < r_hi:
                cut.append((k_hi, r_hi))
        runs = cut
    return runs


def _close(memory: mmap.mmap) -> None:
    try:
        memory.close()
    except BufferError:  # a view of it is still alive somewhere: the mapping goes with the last one
        pass


class _OpenFiles:
    """Descriptors of the input files, at most `limit` kept open between reads (any number of inputs).
    The limit is a quarter of the process's open-file limit when that is lower; a read that finds no
    descriptor free waits for another read to give one back."""

    def __init__(self, limit: int):
        self._limit = max(1, min(limit, _soft_open_files() // 4))
        self._lock = threading.Condition()
        self._open: OrderedDict[str, list] = OrderedDict()  # path -> [fd, reads using it], least recent first

    def open(self, path: str) -> _Using:
        with self._lock:
            while path not in self._open:
                self._close_unused(self._limit - 1)
                try:
                    self._open[path] = [os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)), 0]
                except OSError as exc:
                    if exc.errno not in (errno.EMFILE, errno.ENFILE):
                        raise
                    self._close_unused(0)
                    if not any(users for _, users in self._open.values()):
                        raise out_of_files(exc, path) from None
                    self._lock.wait()  # another read gives its descriptor back
            entry = self._open[path]
            self._open.move_to_end(path)
            entry[1] += 1
        return _Using(self, path, entry)

    def done(self, entry: list) -> None:
        with self._lock:
            entry[1] -= 1
            self._close_unused(self._limit)
            self._lock.notify_all()

    def _close_unused(self, keep: int) -> None:
        """Close the least recently used descriptors no read is using, down to `keep` open."""
        for path in list(self._open):
            if len(self._open) <= keep:
                return
            fd, users = self._open[path]
            if users == 0:
                del self._open[path]
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._open.values():
                os.close(fd)
            self._open.clear()


def _soft_open_files() -> int:
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    except (ImportError, OSError, ValueError):
        return 1024


class _Using:
    def __init__(self, files: _OpenFiles, path: str, entry: list):
        self._files, self._entry = files, entry

    def __enter__(self) -> int:
        return self._entry[0]

    def __exit__(self, *exc):
        self._files.done(self._entry)
