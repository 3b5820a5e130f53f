"""Byte ranges of output files, so several processes can write one merge (and one file) together.

A FilePart is bytes [start, end) of a planned file: the header bytes and tensor bytes inside it.
`share_out` cuts the files, laid end to end, into one run per process of near-equal length:
balanced by bytes, with the fewest cuts (a file is split only where a cut falls inside it).
Cuts fall on ALIGN boundaries of the file, so no two processes write one page (or one stripe
of a parallel filesystem), and never inside a tensor computed by --merge-lora (computed whole).
`share_whole_files` gives each process whole files instead, balanced by bytes: for a target
where one file is one writer's (an object store's multipart upload).

A tensor cut in two is written as two slices (`slice_tensor`: its elements [lo, hi), the
extents clipped); each slice's CRC-32C is recorded with where it starts (a Piece), and
`tensor_checksums` combines them into the CRC of the whole tensor.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

from .. import _ops
from ..dtypes import itemsize
from ..plan.layout import OutputFile, PlacedTensor
from ..plan.model import Extent, TensorPlan

ALIGN = 1 << 20  # Lustre's default stripe size; a multiple of every page size and element size


@dataclass(frozen=True)
class FilePart:
    file: OutputFile
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Piece:
    """The CRC-32C of bytes [start, start + nbytes) of one tensor's data (tensor names repeat
    between PEFT adapter files, so the file is named too)."""

    file: str
    tensor: str
    start: int
    nbytes: int
    crc: int | None


def whole(file: OutputFile) -> FilePart:
    return FilePart(file, 0, file.size)


def share_out(files: list[OutputFile], count: int, align: int = ALIGN) -> list[list[FilePart]]:
    """The parts each of `count` processes writes: every byte of every file exactly once."""
    if not files:
        return [[] for _ in range(count)]
    ends = [0]
    for f in files:
        ends.append(ends[-1] + f.size)
    total = ends[-1]
    cuts = [0] + [_cut(files, ends, total * r // count, align) for r in range(1, count)] + [total]
    for r in range(1, len(cuts)):
        cuts[r] = max(cuts[r], cuts[r - 1])
    shares = []
    for lo, hi in zip(cuts, cuts[1:]):
        share = []
        for i, f in enumerate(files):
            start, end = max(lo, ends[i]), min(hi, ends[i + 1])
            if start < end:
                share.append(FilePart(f, start - ends[i], end - ends[i]))
        shares.append(share)
    return shares


def share_whole_files(files: list[OutputFile], count: int) -> list[list[FilePart]]:
    """Whole files for each of `count` processes, balanced by bytes: the largest file first, each to the
    process with the fewest bytes so far (ties to the lowest rank); each process's files in plan order."""
    owner, loads = {}, [0] * count
    for i in sorted(range(len(files)), key=lambda i: (-files[i].size, i)):
        rank = min(range(count), key=lambda r: (loads[r], r))
        owner[i] = rank
        loads[rank] += files[i].size
    return [[whole(f) for i, f in enumerate(files) if owner[i] == rank] for rank in range(count)]


def _cut(files: list[OutputFile], ends: list[int], at: int, align: int) -> int:
    """The cut nearest `at` (in the files laid end to end) on an `align` boundary of its file,
    moved past a computed tensor it would fall inside."""
    i = min(bisect.bisect_right(ends, at) - 1, len(files) - 1)
    f = files[i]
    offset = min(f.size, (at - ends[i] + align // 2) // align * align)
    for p in f.tensors:
        if p.tensor.compute is not None and p.offset < offset < p.offset + p.nbytes:
            offset = min(f.size, -(-(p.offset + p.nbytes) // align) * align)
    return ends[i] + offset


def tensor_bytes(parts: list[FilePart]) -> int:
    """The tensor bytes (headers left out) inside the parts."""
    return sum(
        max(0, min(part.end, p.offset + p.nbytes) - max(part.start, p.offset))
        for part in parts
        for p in part.file.tensors
    )


def pieces_of(part: FilePart) -> list[tuple[PlacedTensor, int]]:
    """(what to write, where it starts in its tensor's bytes) for every tensor byte in the part."""
    found = []
    for p in part.file.tensors:
        start, end = max(part.start, p.offset), min(part.end, p.offset + p.nbytes)
        if start >= end:
            continue
        if (start, end) == (p.offset, p.offset + p.nbytes):
            found.append((p, 0))
            continue
        size = itemsize(p.tensor.target_dtype)
        if p.tensor.compute is not None or (start - p.offset) % size or (end - p.offset) % size:
            raise ValueError(f"{part.file.name} [{part.start}, {part.end}) cuts {p.tensor.name} where it cannot be cut")
        lo, hi = (start - p.offset) // size, (end - p.offset) // size
        found.append((PlacedTensor(slice_tensor(p.tensor, lo, hi), start, end - start), start - p.offset))
    return found


def slice_tensor(tensor: TensorPlan, lo: int, hi: int) -> TensorPlan:
    """Elements [lo, hi) of the tensor (row-major) as a flat tensor of its own."""
    extents = [clipped for e in tensor.extents for clipped in clip_extent(e, lo, hi)]
    return replace(tensor, shape=(hi - lo,), extents=extents, aliases=[], compute=None)


def clip_extent(e: Extent, lo: int, hi: int) -> list[Extent]:
    """The part of an extent that lands in tensor elements [lo, hi), shifted to start at lo: at most
    a partial first run, the whole runs between (one strided extent), and a partial last run."""
    count = e.count
    if not e.numel or hi <= lo:
        return []
    d_stride = (e.dst_stride or count) if e.runs > 1 else count
    s_stride = (e.src_stride or count) if e.runs > 1 else count
    first = max(0, (lo - e.dst_offset - count) // d_stride + 1)  # the first run ending after lo
    last = min(e.runs - 1, -(-(hi - e.dst_offset) // d_stride) - 1)  # the last run starting before hi
    out: list[Extent] = []
    whole_from, whole_to = first, last  # runs kept whole
    if first > last:
        return out

    def partial(run: int) -> Extent | None:
        dst = e.dst_offset + run * d_stride
        start, end = max(dst, lo), min(dst + count, hi)
        return (
            Extent(e.source, e.src_offset + run * s_stride + (start - dst), end - start, start - lo)
            if start < end
            else None
        )

    if e.dst_offset + first * d_stride < lo:
        out.append(partial(first))
        whole_from = first + 1
    tail = None
    if whole_to >= whole_from and e.dst_offset + last * d_stride + count > hi:
        tail = partial(last)
        whole_to = last - 1
    if whole_to >= whole_from:
        runs = whole_to - whole_from + 1
        out.append(
            Extent(
                e.source,
                e.src_offset + whole_from * s_stride,
                count,
                e.dst_offset + whole_from * d_stride - lo,
                runs,
                s_stride if runs > 1 else 0,
                d_stride if runs > 1 else 0,
            )
        )
    if tail is not None:
        out.append(tail)
    return [x for x in out if x is not None]


def tensor_checksums(files: list[OutputFile], pieces: list[Piece]) -> dict[str, dict[str, int | None]]:
    """Every tensor's CRC-32C by file and name, its pieces combined in order; they must cover its bytes exactly."""
    by_name: dict[tuple[str, str], list[Piece]] = {}
    for piece in pieces:
        by_name.setdefault((piece.file, piece.tensor), []).append(piece)
    checksums: dict[str, dict[str, int | None]] = {}
    for f in files:
        found = checksums.setdefault(f.name, {})
        for p in f.tensors:
            crc, covered = _ops.crc32c(b""), 0
            for piece in sorted(by_name.get((f.name, p.tensor.name), []), key=lambda x: x.start):
                if piece.start != covered:
                    break
                crc = piece.crc if covered == 0 else _ops.crc32c_combine(crc, piece.crc, piece.nbytes)
                covered += piece.nbytes
            if covered != p.nbytes:
                raise ValueError(f"the pieces written of {p.tensor.name} cover {covered} of its {p.nbytes} bytes")
            found[p.tensor.name] = crc
    return checksums
