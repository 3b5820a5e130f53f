"""The plan checked against the model config.json describes, at once or just before publishing.

On a cold cache the model takes seconds to build (plan.expected_builds: a child process imports
transformers). A merge does not wait for it to move its bytes: it plans with the ties config.json's
`tie_word_embeddings` gives (what plan.normalise does without a model), writes, and waits for the
model before the output is published (`DeferredCheck.checked`). A mismatch then refuses the merge
as the check at plan time does (ModelMismatch, one line; the staging folder is discarded, nothing
is published). A model that ties other names than the plan wrote once means the plan was not
the model's: TiesChanged, and the merge is planned and written again with the model (once per
config; the cache answers the next time).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import FsdpfastError, option
from ..plan.expected_builds import ExpectedBuild
from ..plan.model import MergePlan
from ..plan.model_check import ExpectedModel, check_against_model
from ..plan.normalise import clean_name, planned_ties
from ..plan.transform import PlanTransform


class TiesChanged(FsdpfastError):
    """The model ties other names than the plan written without it (api.merge plans and writes again)."""


def in_layout(expected: ExpectedModel | None, plan: MergePlan, transforms: list[PlanTransform]):
    """The model's state dict as the transforms write it (per-expert Hub names, Hub prefixes): what ties
    are found by and the plan is checked against."""
    for transform in transforms:
        expected = expected if expected is None else transform.expected_in_layout(plan, expected)
    return expected


def model_checked(
    plan: MergePlan, expected: ExpectedModel | None, why_not: str, unchecked: str | None, allow_extra: bool
) -> MergePlan:
    """The plan with the check's notes (or warning); ModelMismatch for a plan the model refuses."""
    if expected is not None:
        shapes = {name: t.shape for t in plan.tensors for name in (t.name, *t.aliases)}
        left_out = tuple(map(clean_name, plan.left_out))
        return plan.noted(*check_against_model(shapes, expected, allow_extra, left_out))
    if why_not == "no config.json":
        return plan.noted(
            warnings=(
                "the output has no config.json, so from_pretrained cannot load it until one is added: "
                f"pass {option('config', meta='DIR')} (a folder with the model's config.json), or copy it in",
            )
        )
    if not unchecked:
        return plan.noted(f"the names and shapes were not checked against the model: {why_not}")
    return plan


@dataclass
class DeferredCheck:
    """The check of a plan prepared without its model (`before`: the plan normalise was given)."""

    build: ExpectedBuild
    before: MergePlan
    transforms: list[PlanTransform]  # applied to the plan: the model is checked in the layout they write
    allow_extra: bool

    def ready(self) -> bool:
        return self.build.done()

    def checked(self, plan: MergePlan) -> MergePlan:
        """`plan` with the check's notes, once the model is built; ModelMismatch or TiesChanged."""
        expected, why_not = self.build.result()
        expected = in_layout(expected, self.before, self.transforms)
        config_dir = self.before.config_dir
        if planned_ties(self.before, config_dir, expected) != planned_ties(self.before, config_dir, None):
            raise TiesChanged(
                f"{expected.architecture} ties other names than config.json's tie_word_embeddings says; "
                "the merge is planned again with the model"
            )
        return model_checked(plan, expected, why_not, None, self.allow_extra)

    def cancel(self) -> None:
        self.build.cancel()
