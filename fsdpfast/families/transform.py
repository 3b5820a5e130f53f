"""The Hub layout as a plan transform (plan.transform): what `save_pretrained` of the model writes.

The family comes from config.json's `model_type` (the plan's config folder, or the config a reader
built); without one the plan passes unchanged (the merge then warns that no config.json was found).
`--expert-layout packed` keeps transformers 5's packed expert tensors as the checkpoint holds them.
The model check compares the written names with the model's state dict in the same layout
(`expected_shapes`), so a packed tensor whose shape disagrees with config.json is refused as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..hf.config import load_config
from ..options import MergeOptions
from ..plan.model import MergePlan
from ..plan.normalise import clean_name
from ..plan.transform import ExpectedModels
from .hub_experts import PER_EXPERT, ExpertNames, hub_shapes, split_experts

EXPERT_LAYOUTS = ("hub", "packed")


def transforms(src: str, options: MergeOptions) -> list:
    """The pipeline's hook (pipeline.plan.TRANSFORMS)."""
    return [] if options.expert_layout == "packed" else [HubLayout()]


def folder_checks() -> list:
    return []  # writes no folder of its own


def model_type(plan: MergePlan) -> str | None:
    if plan.config_dir is not None and os.path.isfile(os.path.join(plan.config_dir, "config.json")):
        config = load_config(os.path.join(plan.config_dir, "config.json"))
    else:
        config = plan.built_config or {}
    found = config.get("model_type")
    return found if isinstance(found, str) else None


@dataclass(frozen=True)
class HubLayout:
    def _names(self, plan: MergePlan) -> ExpertNames | None:
        return PER_EXPERT.get(model_type(plan) or "")

    def apply(self, plan: MergePlan, models: ExpectedModels) -> MergePlan:
        names = self._names(plan)
        if names is None:
            return plan
        tensors = split_experts(plan.tensors, names, clean_name)
        if len(tensors) == len(plan.tensors) and all(a is b for a, b in zip(tensors, plan.tensors)):
            return plan
        return plan.but(tensors=tensors).noted(
            f"MoE experts written one tensor per expert, as save_pretrained writes {model_type(plan)} "
            "(--expert-layout packed keeps transformers' packed tensors)"
        )

    def expected_shapes(self, plan: MergePlan, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        names = self._names(plan)
        return shapes if names is None else hub_shapes(shapes, names)

    def unchecked(self, plan: MergePlan) -> str | None:
        return None

    def outputs(self, plan: MergePlan, out_dir: str) -> list:
        return []

    def describe(self, plan: MergePlan) -> dict:
        return {}
