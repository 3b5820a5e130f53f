"""The checksums of tensors whose bytes several ranks write interleaved (live.write.settle).

A rank holding a column block writes one run per row; it sends the CRC-32C of the tensor with
its bytes in place and zeros elsewhere (a Spread), or its runs' own CRCs (Pieces) when they are
few. Joined, they must give the CRC-32C of the whole tensor's bytes, as the offline merge records it.
"""

from __future__ import annotations

import random

import pytest

from fsdpfast import _ops
from fsdpfast.errors import FsdpfastError
from fsdpfast.execute.parts import Piece, tensor_checksums
from fsdpfast.live.write import MAX_PIECES, Spread, _image_crc, settle
from fsdpfast.plan.layout import plan_files
from fsdpfast.plan.model import MergePlan, TensorPlan

pytestmark = pytest.mark.skipif(not _ops.native_cpu(), reason="checksums need the native module")

ROWS, COLUMNS, ITEM = 37, 24, 4  # a float32 tensor


def sent(file: str, data: bytes, ranges: list[tuple[int, int]]) -> list[Piece | Spread]:
    """What one rank sends for the byte ranges it wrote, as live.write._write sends it."""
    runs = [(start, length, _ops.crc32c(data[start : start + length])) for start, length in ranges]
    if len(runs) <= MAX_PIECES:
        return [Piece(file, "w", *run) for run in runs]
    starts, lengths, crcs = zip(*runs)
    return [Spread(file, "w", sum(lengths), _image_crc(starts, lengths, crcs, len(data)))]


def column_block(rows: range, columns: range) -> list[tuple[int, int]]:
    width = COLUMNS * ITEM
    return [(r * width + columns.start * ITEM, len(columns) * ITEM) for r in rows]


LAYOUTS = {
    # FSDP2 Shard(1) over 2 and 3 ranks (an even and an odd number of Spreads)
    "2 column blocks": [column_block(range(ROWS), range(0, 12)), column_block(range(ROWS), range(12, 24))],
    "3 column blocks": [column_block(range(ROWS), range(a, b)) for a, b in ((0, 8), (8, 16), (16, 24))],
    # (Shard(0), Shard(1)) over a 2 x 2 mesh, uneven rows: 19 runs (a Spread) and 18 (a Spread)
    "2 x 2 blocks": [
        column_block(rows, cols)
        for rows in (range(0, 19), range(19, ROWS))
        for cols in (range(0, 12), range(12, COLUMNS))
    ],
    # one rank's rows in one run (a Piece) beside two column blocks of the rest (Spreads)
    "rows beside blocks": [
        [(0, 20 * COLUMNS * ITEM)],
        column_block(range(20, ROWS), range(0, 5)),
        column_block(range(20, ROWS), range(5, COLUMNS)),
    ],
    # few runs each: Pieces only, joined in order as always
    "few rows": [column_block(range(0, 3), range(COLUMNS)), [(3 * COLUMNS * ITEM, (ROWS - 3) * COLUMNS * ITEM)]],
}


@pytest.mark.parametrize("way", ["native", "python"])  # crc32c_spread, or the combines of a build without it
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_joined_checksum_is_the_whole_tensors(layout, way, monkeypatch):
    if way == "python":
        monkeypatch.setattr(_ops, "native", lambda: None)
    elif not hasattr(_ops.native(), "crc32c_spread"):
        pytest.skip("fsdpfast._native was built before crc32c_spread")
    files = plan_files(MergePlan("live", 1, (), [TensorPlan("w", (ROWS, COLUMNS), "float32", "float32", ())]), "5GB")
    data = random.Random(layout).randbytes(ROWS * COLUMNS * ITEM)
    ranks = LAYOUTS[layout]
    covered = sorted(r for ranges in ranks for r in ranges)
    assert sum(length for _, length in covered) == len(data)  # the layout covers the tensor once
    pieces = [p for ranges in ranks for p in sent(files[0].name, data, ranges)]
    checksums = tensor_checksums(files, settle(files, pieces))
    assert checksums[files[0].name]["w"] == _ops.crc32c(data)


def test_pieces_that_miss_bytes_are_refused():
    files = plan_files(MergePlan("live", 1, (), [TensorPlan("w", (ROWS, COLUMNS), "float32", "float32", ())]), "5GB")
    data = bytes(ROWS * COLUMNS * ITEM)
    pieces = sent(files[0].name, data, column_block(range(ROWS), range(0, 12)))  # the other half never written
    with pytest.raises(FsdpfastError, match="cover"):
        settle(files, pieces)
