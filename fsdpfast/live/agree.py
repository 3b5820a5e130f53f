"""Every rank must plan the same folder from a model held the same way before any byte is written.

Each rank plans from its own model. A rank whose model differs in names, shapes or dtypes, or is
held differently (FSDP2 on one rank, FSDP1 or a plain model on another) would write at offsets
the others do not use, or leave rows unwritten, and the folder would still be published. So
every rank sends rank 0 a digest of its plan and of how it holds each tensor (small: a hash and
a count per kind), and rank 0 refuses before making the output if any differs from its own.
A plain model on every rank (DDP replicas) agrees: rank 0 writes its copy, as for buffers.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass

from ..errors import BadInput
from .fsdp1 import FlatRun


@dataclass(frozen=True)
class Holding:
    digest: str  # of the plan's tensors and how each is held
    kinds: tuple[tuple[str, int], ...]  # how many tensors are held each way, for the message


def holding(plan, tensors) -> Holding:
    kinds = [_kind(t.value) for t in tensors]
    described = [(t.name, t.shape, t.source_dtype, t.target_dtype, t.aliases) for t in plan.tensors]
    digest = hashlib.sha256(repr((described, [(t.name, k) for t, k in zip(tensors, kinds)])).encode()).hexdigest()
    counts = Counter(k.split("(")[0] for k in kinds)
    return Holding(digest, tuple(sorted(counts.items())))


def agree(holdings: list[Holding]) -> None:
    """Refuse (on rank 0, before anything is made) when a rank's plan or holding differs from rank 0's."""
    first = holdings[0]
    for rank, other in enumerate(holdings):
        if other.digest != first.digest:
            raise BadInput(
                f"save_pretrained: rank {rank} holds a different model from rank 0 ({_shown(other)} there, "
                f"{_shown(first)} on rank 0, or other names, shapes or dtypes); call it on every rank with "
                "the same model, sharded the same way"
            )


def _kind(value) -> str:
    from torch.distributed.tensor import DTensor

    if isinstance(value, FlatRun):
        return "FSDP1"
    if isinstance(value, DTensor):
        return f"DTensor({tuple(value.placements)} on {tuple(value.device_mesh.shape)})"
    return "plain"


def _shown(h: Holding) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in h.kinds)
