"""The Hub layout as a plan transform (plan.transform): what `save_pretrained` of the model writes.

The family comes from config.json's `model_type` (the plan's config folder, or the config a reader
built); without one the plan passes unchanged (the merge then warns that no config.json was found).
`--expert-layout packed` keeps transformers 5's packed expert tensors as the checkpoint holds them.
The model check compares the written names with the model's state dict in the same layout
(`expected_in_layout`), so a packed tensor whose shape disagrees with config.json is refused as before.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import option
from ..options import MergeOptions
from ..plan.model import MergePlan
from ..plan.model_check import ExpectedModel
from ..plan.normalise import clean_name
from ..plan.transform import ExpectedModels, NamesOnly
from .hub_experts import (
    ExpertNames,
    expert_names,
    has_packed,
    hub_shapes,
    is_transposed,
    split_experts,
    transpose_experts,
    transposed_shapes,
)
from .hub_prefixes import hub_name, renamed, rules_for
from .plan_config import config_of, model_type


def transforms(src: str, options: MergeOptions) -> list:
    """The pipeline's hook (pipeline.plan.TRANSFORMS)."""
    return [HubPrefixes()] + ([] if options.expert_layout == "packed" else [HubLayout()])


def folder_checks() -> list:
    return []  # writes no folder of its own


@dataclass(frozen=True)
class HubPrefixes(NamesOnly):
    """A vision-language model's parts under the prefixes its Hub checkpoints use (families.hub_prefixes)."""

    def apply(self, plan: MergePlan, models: ExpectedModels) -> MergePlan:
        rules = rules_for(config_of(plan))
        if not rules:
            return plan
        return plan.but(tensors=renamed(plan.tensors, rules, clean_name)).noted(
            f"names under the prefixes save_pretrained writes for {model_type(plan)} "
            f"({', '.join(f'{a} as {b}' for a, b in rules)})"
        )

    def expected_in_layout(self, plan: MergePlan, expected: ExpectedModel) -> ExpectedModel:
        rules = rules_for(config_of(plan))
        if not rules:
            return expected
        return replace(
            expected,
            shapes={hub_name(n, rules): shape for n, shape in expected.shapes.items()},
            tied={hub_name(a, rules): hub_name(b, rules) for a, b in expected.tied.items()},
        )


@dataclass(frozen=True)
class HubLayout(NamesOnly):
    def _names(self, plan: MergePlan) -> ExpertNames | None:
        return expert_names(config_of(plan))

    def apply(self, plan: MergePlan, models: ExpectedModels) -> MergePlan:
        names = self._names(plan)
        if is_transposed(config_of(plan)) and has_packed(plan.tensors, clean_name):
            return self._transposed(plan)
        if names is None:
            return plan
        tensors = split_experts(plan.tensors, names, clean_name)
        if len(tensors) == len(plan.tensors) and all(a is b for a, b in zip(tensors, plan.tensors)):
            return plan
        return plan.but(tensors=tensors).noted(
            f"MoE experts written one tensor per expert, as save_pretrained writes {model_type(plan)} "
            "(--expert-layout packed keeps transformers' packed tensors)"
        )

    def _transposed(self, plan: MergePlan) -> MergePlan:
        tensors, square = transpose_experts(plan.tensors, clean_name)
        warnings = ()
        if square:
            warnings = (
                f"{square[0]}{f' and {len(square) - 1} more' if len(square) > 1 else ''}: each expert's matrix is "
                "square, so transformers cannot tell from the shape that the Hub layout holds it transposed and would "
                f"load it untransposed; {option('expert_layout', 'packed')} writes the layout transformers holds",
            )
        return plan.but(tensors=tuple(tensors)).noted(
            f"MoE experts written transposed ([E, H, 2I], [E, I, H]), as {model_type(plan)}'s Hub checkpoints hold "
            "them and vLLM loads them (--expert-layout packed keeps transformers' [E, 2I, H], [E, H, I])",
            warnings=warnings,
        )

    def expected_in_layout(self, plan: MergePlan, expected: ExpectedModel) -> ExpectedModel:
        if is_transposed(config_of(plan)):
            return replace(expected, shapes=transposed_shapes(expected.shapes))
        names = self._names(plan)
        return expected if names is None else replace(expected, shapes=hub_shapes(expected.shapes, names))
