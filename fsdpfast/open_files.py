"""The one-line error for a process out of file descriptors.

Planning opens each input file only while reading its metadata, and the merge maps input files
without keeping them open, so fsdpfast needs a handful of descriptors at once whatever the world
size. Running out means the limit is very low, or something else in the process holds the rest.
"""

from __future__ import annotations

import errno

from .errors import FsdpfastError


def out_of_files(exc: OSError, path: str) -> FsdpfastError | None:
    """The error to raise instead of `exc` when it is EMFILE / ENFILE, else None."""
    if exc.errno == errno.EMFILE:
        return FsdpfastError(
            f"{path}: cannot open it: too many open files (this process may have {_soft_limit()} open at "
            "once, ulimit -n); fsdpfast itself keeps only a few open at a time, so something else holds "
            "the rest, or the limit is too low: raise it (ulimit -n 4096)"
        )
    if exc.errno == errno.ENFILE:
        return FsdpfastError(
            f"{path}: cannot open it: the system's table of open files is full; close files elsewhere "
            "or raise fs.file-max"
        )
    return None


def _soft_limit() -> str:
    try:
        import resource

        return str(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    except (ImportError, OSError, ValueError):
        return "a limited number"
