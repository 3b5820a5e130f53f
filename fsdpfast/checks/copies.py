"""Copies a checkpoint holds twice must agree: the merge reads one, so a difference would go unseen.

Every rank of an FSDP checkpoint holds the buffers (and, in a DDP or full-state-dict save, the
whole model); every replica group of an HSDP checkpoint holds the same shards. A merge reads one
copy. If the others differ (files of two steps, replicas out of sync, a damaged file), the
output is one of several models the files describe, chosen silently; so they are compared.

The merge compares a sample of each copy: all of it up to SAMPLE_BYTES * 3, else its first,
middle and last SAMPLE_BYTES. Copies from another step or another replica's trajectory differ
almost everywhere, so the sample finds them; comparing every byte would read every copy in full
(an HSDP checkpoint twice over), which `verify --against` does (full=True).
"""

from __future__ import annotations

from ..dtypes import itemsize
from ..errors import BadInput
from ..io.sources import Source
from ..plan.model import Copy, MergePlan
from .tensor_bytes import first_difference, read_window, sources_for

SAMPLE_BYTES = 64 << 10  # bytes compared at each of a large copy's three places during a merge


def check_copies(plan: MergePlan, full: bool = False, read_mode: str = "auto") -> MergePlan:
    """Refuse the plan if any copy differs from the one the merge reads; `full`: every byte.
    Read as the merge reads (io.read_modes). The plan, with a note when large copies were compared by samples."""
    if not plan.copies:
        return plan
    sampled = 0
    with sources_for(plan.sources, read_mode) as sources:
        for copy in plan.copies:
            where = first_difference(copy.kept, copy.other, sources) if full else _sampled_difference(copy, sources)
            if where is not None:
                raise BadInput(
                    f"{copy.name}: {copy.other_at} differs from {copy.kept_at} "
                    f"(first at element {where}); {copy.problem}"
                )
            sampled += not full and _is_sampled(copy)
    if not sampled:
        return plan
    return plan.noted(
        f"{sampled} of {len(plan.copies)} copies held twice (buffers on every rank, HSDP replicas) "
        f"were compared at their first, middle and last {SAMPLE_BYTES >> 10} KB, the rest in full; "
        "verify --against compares every byte"
    )


def _is_sampled(copy: Copy) -> bool:
    return copy.kept.numel * itemsize(copy.kept.source_dtype) > 3 * SAMPLE_BYTES


def _sampled_difference(copy: Copy, sources: Source) -> int | None:
    a, b = copy.kept, copy.other
    if not _is_sampled(copy) or (a.shape, a.source_dtype) != (b.shape, b.source_dtype):
        return first_difference(a, b, sources)
    step = max(1, SAMPLE_BYTES // itemsize(a.source_dtype))
    for lo in (0, (a.numel - step) // 2, a.numel - step):
        x, y = read_window(a, lo, lo + step, sources), read_window(b, lo, lo + step, sources)
        if x != y:
            size = itemsize(a.source_dtype)
            return lo + next(i for i in range(0, len(x), size) if x[i : i + size] != y[i : i + size]) // size
    return None
