"""The one runner: pieces handed to a sink in batches, progress told, input pages released.

Merge runs it with a file sink per output file (part, execute.writer), verify --against with
the compare sink (execute.compare): both get the same batching and the same bounded memory.
A batch's source byte ranges are announced to a Source that reads (io.pread_sources) while
earlier batches are written, as many batches ahead as its `ahead_bytes` allows, so many reads stay
in flight while the engine converts; for such
a Source a tensor larger than a batch is cut into slices (execute.parts), so what is read at once
stays about a batch. So is it for a sink that holds what it fills in memory until it is written (`held`:
an object store's file, remote.object_target), so that what is held stays about a batch too.
"""

from __future__ import annotations

from .. import _ops
from ..dtypes import itemsize
from ..io.sources import Source
from ..plan.layout import PlacedTensor
from .parts import slice_tensor

BATCH_BYTES = 64 << 20  # output bytes handed to the engine at once; their input pages are dropped after


def run(pieces: list[PlacedTensor], sources: Source, sink, progress=None, held: bool = False) -> list[int | None]:
    """Hand the pieces to `sink` a batch at a time; their CRC-32Cs, in order. `held`: the sink holds each
    piece's bytes in memory until they are written (a tensor larger than a batch is then cut, too)."""
    reads = getattr(sources, "reads_announced_ranges", False)  # else (mapped files) nothing to announce
    largest = min(BATCH_BYTES, getattr(sources, "batch_bytes", BATCH_BYTES))
    sliced = [_slices(p, largest) for p in pieces] if reads or held else None
    found = batches([s for group in sliced for s in group] if sliced is not None else pieces, largest)
    ahead = _ReadAhead(sources, found, getattr(sources, "ahead_bytes", 0)) if reads else None
    crcs: list[int | None] = []
    for i, batch in enumerate(found):
        if ahead is not None:
            ahead.announce_past(i)
        crcs += sink.write(batch, sources)
        if progress is not None:
            progress(sum(p.nbytes for p in batch))
        for source in ahead.announced.pop(i) if ahead is not None else sources_used(batch):
            sources.release(source)  # a reading Source: exactly the buffers announced for this batch
    return crcs if sliced is None else _combined(sliced, crcs)


class _ReadAhead:
    """Announces batches to a reading Source in order, as many past the one being written as fit in
    `ahead_bytes` of input (at least one): many reads stay in flight while the engine converts, and
    the input held is bounded by that figure plus the batch being written."""

    def __init__(self, sources: Source, found: list[list[PlacedTensor]], ahead_bytes: int):
        self.sources, self.found, self.ahead_bytes = sources, found, ahead_bytes
        self.announced: dict[int, list[int]] = {}  # batch -> the buffers announced for it, until released
        self._bytes: dict[int, int] = {}  # batch -> the input bytes announced for it
        self._next = 0

    def announce_past(self, current: int) -> None:
        """Batch `current` and the ones after it that fit are announced."""
        while self._next < len(self.found) and (
            self._next <= current + 1 or sum(self._bytes[b] for b in self.announced if b > current) < self.ahead_bytes
        ):
            ranges = source_ranges(self.found[self._next])
            self.sources.read_ahead(ranges)
            self.announced[self._next] = list(ranges)
            self._bytes[self._next] = sum(end - start for wanted in ranges.values() for start, end in wanted)
            self._next += 1


def batches(pieces: list[PlacedTensor], largest: int | None = None) -> list[list[PlacedTensor]]:
    """Consecutive pieces grouped up to `largest` bytes (BATCH_BYTES), so small tensors share one engine call; a
    computed tensor (--merge-lora) alone, since computing it holds several tensors in memory."""
    found, current, size = [], [], 0
    for p in pieces:
        alone = p.tensor.compute is not None
        if current and (alone or size + p.nbytes > (largest or BATCH_BYTES)):
            found.append(current)
            current, size = [], 0
        current.append(p)
        size += p.nbytes
        if alone:
            found.append(current)
            current, size = [], 0
    if current:
        found.append(current)
    return found


def sources_used(pieces: list[PlacedTensor]) -> set[int]:
    used = {e.source for p in pieces for e in p.tensor.extents}
    for p in pieces:
        if p.tensor.compute is not None:
            used |= p.tensor.compute.sources()
    return used


def source_ranges(pieces: list[PlacedTensor]) -> dict[int, list[tuple[int, int]]]:
    """The byte ranges [start, end) of each source buffer the pieces read; a computed tensor's
    sources whole (the Source clips the end to the buffer's)."""
    found: dict[int, list[tuple[int, int]]] = {}
    for p in pieces:
        if p.tensor.compute is not None:
            for source in p.tensor.compute.sources():
                found.setdefault(source, []).append((0, 1 << 62))
            continue
        size = itemsize(p.tensor.source_dtype)
        for e in p.tensor.extents:
            if e.count and e.runs:
                last = e.src_offset + (e.runs - 1) * e.src_stride + e.count
                found.setdefault(e.source, []).append((min(e.src_offset, last - e.count) * size, last * size))
    return found


def _slices(p: PlacedTensor, largest: int) -> list[PlacedTensor]:
    """The piece, or slices of it of at most `largest` bytes, in order (a computed one whole)."""
    size = itemsize(p.tensor.target_dtype)
    if p.nbytes <= largest or p.tensor.compute is not None:
        return [p]
    count, step = p.nbytes // size, max(1, largest // size)
    return [
        PlacedTensor(
            slice_tensor(p.tensor, lo, min(count, lo + step)), p.offset + lo * size, (min(count, lo + step) - lo) * size
        )
        for lo in range(0, count, step)
    ]


def _combined(sliced: list[list[PlacedTensor]], crcs: list[int | None]) -> list[int | None]:
    """Each piece's CRC-32C from its slices' (None if any is None)."""
    found, at = [], 0
    for group in sliced:
        crc = crcs[at]
        for p, more in zip(group[1:], crcs[at + 1 : at + len(group)]):
            crc = None if crc is None or more is None else _ops.crc32c_combine(crc, more, p.nbytes)
        found.append(crc)
        at += len(group)
    return found
