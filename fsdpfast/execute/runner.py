"""The one runner: pieces handed to a sink in batches, progress told, input pages released.

Merge runs it with a file sink per output file (part, execute.writer), verify --against with
the compare sink (execute.compare): both get the same batching and the same bounded memory.
"""

from __future__ import annotations

from ..io.sources import Source
from ..plan.layout import PlacedTensor

BATCH_BYTES = 64 << 20  # output bytes handed to the engine at once; their input pages are dropped after


def run(pieces: list[PlacedTensor], sources: Source, sink, progress=None) -> list[int | None]:
    """Hand the pieces to `sink` a batch at a time; their CRC-32Cs, in order."""
    crcs: list[int | None] = []
    for batch in batches(pieces):
        crcs += sink.write(batch, sources)
        if progress is not None:
            progress(sum(p.nbytes for p in batch))
        for source in sources_used(batch):
            sources.release(source)
    return crcs


def batches(pieces: list[PlacedTensor]) -> list[list[PlacedTensor]]:
    """Consecutive pieces grouped up to BATCH_BYTES, so small tensors share one engine call; a
    computed tensor (--merge-lora) alone, since computing it holds several tensors in memory."""
    found, current, size = [], [], 0
    for p in pieces:
        alone = p.tensor.compute is not None
        if current and (alone or size + p.nbytes > BATCH_BYTES):
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
