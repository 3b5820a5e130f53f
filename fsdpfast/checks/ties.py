"""Names that config.json ties must hold the same values: transformers loads one under both.

plan.normalise decides from metadata which names are tied and writes each once; it is handed
`check_tied_bytes` to refuse a pair whose bytes differ before the second name is dropped.
"""

from __future__ import annotations

from ..errors import ModelMismatch, option
from ..plan.model import MergePlan, TensorPlan
from .tensor_bytes import first_difference, sources_for


def check_tied_bytes(plan: MergePlan, kept: TensorPlan, other: TensorPlan, read_mode: str = "auto") -> None:
    """Refuse the tie if the checkpoint holds different bytes under `kept` and `other` (one shape and dtype),
    read as the merge reads (io.read_modes)."""
    with sources_for(plan.sources, read_mode) as sources:
        where = first_difference(kept, other, sources)
    if where is not None:
        raise ModelMismatch(
            f"config.json ties {other.name} to {kept.name} (transformers would load {kept.name} under both names), "
            f"but the checkpoint's two differ from element {where} on; if they were trained untied, "
            f"set tie_word_embeddings to false in config.json ({option('config', meta='DIR')})"
        )
