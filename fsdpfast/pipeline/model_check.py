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

from ..errors import FsdpfastError, ModelMismatch, option
from ..families import keep_fp32
from ..families.plan_config import model_type
from ..fp8.plan import unquantized
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
    plan: MergePlan,
    expected: ExpectedModel | None,
    why_not: str,
    unchecked: str | None,
    allow_extra: bool,
    dtype: str | None = None,
) -> MergePlan:
    """The plan with the check's notes (or warning); ModelMismatch for a plan the model refuses,
    or one cast to `dtype` with other tensors kept in float32 than the class keeps."""
    if expected is not None:
        _check_kept_fp32(plan, expected, dtype)
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


def _check_kept_fp32(plan: MergePlan, expected: ExpectedModel, dtype: str | None) -> None:
    """The float32-kept lists the plan was cast with (read from transformers' source: families.keep_fp32)
    must be the built class's own, where the cast makes them matter."""
    if expected.kept_fp32 is None or dtype not in ("bfloat16", "float16"):
        return
    built = {keep_fp32.STRICT: frozenset(expected.kept_fp32[0]), keep_fp32.LOOSE: frozenset(expected.kept_fp32[1])}
    read = keep_fp32.kept_lists(model_type(plan)) or {keep_fp32.STRICT: frozenset(), keep_fp32.LOOSE: frozenset()}
    want, used = keep_fp32.kept_patterns(built, dtype), keep_fp32.kept_patterns(read, dtype)
    if want != used:
        raise ModelMismatch(
            f"{expected.architecture} keeps {sorted(want) or 'nothing'} in float32 when cast to {dtype}, but fsdpfast "
            f"read {sorted(used) or 'nothing'} from its source; nothing was written as the class would: merge with "
            f"{option('dtype', 'keep')} and cast after loading, and report this"
        )


@dataclass
class DeferredCheck:
    """The check of a plan prepared without its model (`before`: the plan normalise was given)."""

    build: ExpectedBuild
    before: MergePlan
    transforms: list[PlanTransform]  # applied to the plan: the model is checked in the layout they write
    allow_extra: bool
    dtype: str | None = None  # the merge's cast (the float32-kept tensors are checked for it)

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
        base = unquantized(plan)  # --dtype fp8: the model has the weights, not their float8 parts
        checked = model_checked(base, expected, why_not, None, self.allow_extra, self.dtype)
        return plan.noted(*checked.notes[len(base.notes) :], warnings=checked.warnings[len(base.warnings) :])

    def cancel(self) -> None:
        self.build.cancel()
