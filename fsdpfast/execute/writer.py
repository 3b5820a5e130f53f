"""Stage 3's face: write output files, or byte ranges of them, into a Target.

`execute` writes any set of planned files or FileParts (execute.parts): the whole merge in one
process, or one process's share of it under torchrun. Each part gets the header bytes in its
range, then every tensor byte in its range at its offset, through the engine's sink
(execute.sinks) fed by the runner (execute.runner).
"""

from __future__ import annotations

import errno
import os
from contextlib import nullcontext

from ..errors import FsdpfastError, out_of_files
from ..io.local_file import LocalFile
from ..io.sources import Source, SourceFiles
from ..io.target import Target, TargetFile
from ..manifest import SourceChanged
from ..plan.layout import OutputFile
from ..plan.model import MergePlan
from .parts import FilePart, Piece, pieces_of, tensor_checksums, whole
from .runner import run


def execute(
    plan: MergePlan,
    files: list[OutputFile | FilePart],
    target: Target,
    *,
    engine,
    sources: Source | None = None,
    progress=None,
    after_file=None,
) -> list[Piece]:
    """Write `files` (whole OutputFiles, or FileParts) into `target` with `engine`; the CRC-32C of
    every tensor byte range written. `progress(nbytes)` is told as batches finish, `after_file(part)`
    after each file (part) is complete and on disk. `sources`: the plan's Source (default: its files mapped)."""
    parts = [f if isinstance(f, FilePart) else whole(f) for f in files]
    written: list[Piece] = []
    with nullcontext(sources) if sources is not None else SourceFiles(plan.sources) as opened:
        for part in parts:
            written += write_part(target, part, engine, opened, progress)
            if after_file is not None:
                after_file(part)
    return written


def write_part(target: Target, part: FilePart, engine, sources: Source, progress=None) -> list[Piece]:
    """Write `part` into the target's file of that name; the CRC-32C of each tensor byte range in it."""
    path = part.file.name  # for messages: the name is all they need
    try:
        file = target.open(part.file.name, part.file.size)
    except OSError as exc:
        raise _os_write_failed(path, exc) from None
    with file:
        return write_into(file, path, part, engine, sources, progress)


def write_file(path: str, planned: OutputFile, engine, sources: Source, progress=None) -> dict[str, int | None]:
    """Write a new local file at `path` whole, outside any Target; each tensor's CRC-32C by name."""
    with LocalFile.create(path, planned.size) as file:
        return tensor_checksums([planned], write_into(file, path, whole(planned), engine, sources, progress))[
            planned.name
        ]


def write_into(file: TargetFile, path: str, part: FilePart, engine, sources: Source, progress=None) -> list[Piece]:
    try:
        return _write(file, part, engine, sources, progress)
    except OSError as exc:  # disk full (ENOSPC), file size limit (EFBIG), quota, I/O error
        if exc.filename:  # an input file, named by the error itself
            raise
        raise _os_write_failed(path, exc) from None
    except SourceChanged:  # an input read short (io.pread_sources): the input's, said as it is
        raise
    except FsdpfastError as exc:  # the native kernels' I/O errors ("writing the output file: ...")
        code = next((c for c in _WHAT_TO_DO if os.strerror(c) in str(exc)), None)  # they carry strerror's words
        raise _write_failed(path, str(exc), code) from None


_WHAT_TO_DO = {  # by errno; anything else: another disk may do
    errno.ENOSPC: "free space on that disk or choose another output folder",
    errno.EDQUOT: "free space within your disk quota or choose another output folder",
    errno.EFBIG: "raise the file size limit (ulimit -f) or use a smaller --max-shard-size",
}


def _os_write_failed(path: str, exc: OSError) -> FsdpfastError:
    return out_of_files(exc, path) or _write_failed(path, exc.strerror or str(exc), exc.errno)


def _write_failed(path: str, reason: str, code: int | None) -> FsdpfastError:
    what_to_do = _WHAT_TO_DO.get(code, "check that disk, or choose another output folder")
    return FsdpfastError(
        f"cannot write {os.path.basename(path)} ({reason}); nothing was published: {what_to_do}, then run again"
    )


def _write(file: TargetFile, part: FilePart, engine, sources: Source, progress) -> list[Piece]:
    header = part.file.header[part.start : part.end]
    if header:
        file.write_at(header, part.start)
    found = pieces_of(part)  # empty tensors have no bytes to write (tensor_checksums knows their CRC)
    crcs = []
    if found:
        placed = [p for p, _ in found]
        with engine.output(file, max(p.offset + p.nbytes for p in placed), min(p.offset for p in placed)) as sink:
            crcs = run(placed, sources, sink, progress, held=file.local_descriptor() is None)  # not local: in memory
    file.sync()
    return [Piece(part.file.name, p.tensor.name, start, p.nbytes, crc) for (p, start), crc in zip(found, crcs)]
