"""Pieces laid end to end as one flat vector (DeepSpeed's partitions, FSDP1's shards), cut into extents."""

from __future__ import annotations

import bisect

from ..plan.model import Extent


class FlatRuns:
    """A flat vector made of (source, element offset, length) pieces in order; a run of it becomes extents."""

    def __init__(self, pieces: list[tuple[int, int, int]]):
        self.pieces = pieces
        self.starts = [0]
        for _, _, length in pieces:
            self.starts.append(self.starts[-1] + length)

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def extents(self, start: int, count: int, dst: int) -> list[Extent]:
        """Extents copying elements [start, start + count) of the vector to element `dst` onwards.

        The caller checks start + count <= numel (each reader words that error its own way).
        """
        out = []
        index = bisect.bisect_right(self.starts, start) - 1
        while count > 0:
            source, offset, length = self.pieces[index]
            skip = start - self.starts[index]
            take = min(count, length - skip)
            if take > 0:
                out.append(Extent(source, offset + skip, take, dst))
                start, count, dst = start + take, count - take, dst + take
            index += 1
        return out
