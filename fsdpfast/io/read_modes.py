"""How a merge reads its sources: mapped (page faults from the page cache) or with explicit reads.

mmap:  each input file mapped; the kernels read it through page faults. The fastest from a local
       disk or the page cache, and what a merge always did.
pread: large reads, many in flight, of the byte ranges the next pieces need (io.pread_sources).
       On a network filesystem or a FUSE mount a fault is a round trip with few in flight; reads
       this size keep the link busy.
auto:  pread when a source folder is on such a filesystem (io.filesystems), else mmap.
"""

from __future__ import annotations

import os

from ..errors import BadInput, option
from ..plan.model import SourceBuffer
from .filesystems import remote_filesystem

READ_MODES = ("auto", "mmap", "pread")


def check_read_mode(name: str) -> None:
    if name not in READ_MODES:
        raise BadInput(f"{option('read_mode', name)} is not one of {', '.join(READ_MODES)}")


def chosen_read_mode(name: str, buffers: list[SourceBuffer]) -> tuple[str, str | None]:
    """(mmap or pread, the filesystem that made auto choose pread); the folders are asked once each."""
    check_read_mode(name)
    if name != "auto":
        return name, None
    for folder in sorted({os.path.dirname(os.path.realpath(b.path)) for b in buffers}):  # where links lead
        found = remote_filesystem(folder)
        if found is not None:
            return "pread", found
    return "mmap", None


def read_mode_note(mode: str, because: str | None) -> str | None:
    """The report's line where the sources were not read the local default way; None where they were."""
    if mode == "mmap":
        return None
    return f"sources read with large parallel reads ({'the checkpoint is on ' + because if because else '--read-mode pread'})"
