"""Plan a merge from metadata: read -> the layout's conversions -> checks -> copies -> transforms -> normalise
-> model check.

No tensor byte is written here; the copies a checkpoint holds twice are compared (checks.copies)
and config.json's model class is built on the meta device (plan.model_check).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import replace

from .. import readers
from ..checks.copies import check_copies
from ..checks.ties import check_tied_bytes
from ..errors import BadInput, option
from ..options import MergeOptions
from ..plan.checks import check_plan
from ..plan.model import MergePlan
from ..plan.model_check import check_against_model
from ..plan.normalise import clean_name, prepare
from ..plan.transform import ExpectedModels, FolderChecks, PlanTransform

# Modules whose transforms(src, options) give the plan transforms of a merge, applied in this order,
# and whose folder_checks() give what verify checks of the folders they write (plan.transform).
# Named, not imported, so that the pipeline and verify depend on no feature.
TRANSFORMS = ("fsdpfast.lora.transform", "fsdpfast.families.torchtitan", "fsdpfast.families.transform")


def plan_transforms(src: str, options: MergeOptions) -> list[PlanTransform]:
    return [t for module in TRANSFORMS for t in importlib.import_module(module).transforms(src, options)]


def folder_checks() -> list[FolderChecks]:
    return [c for module in TRANSFORMS for c in importlib.import_module(module).folder_checks()]


def plan_merge(src: str, options: MergeOptions) -> MergePlan:
    """The MergePlan of checkpoint folder `src` (fsdpfast.plan_merge, the face, says what is checked)."""
    config = options.config_dir
    if config is not None and not os.path.isfile(os.path.join(config, "config.json")):
        raise BadInput(f"{config}: --config folder has no config.json")
    plan = readers.read_plan(src, options.layout, config, lora_r=options.lora.lora_r, **options.layout_options)
    models = ExpectedModels()
    for conversion in plan.conversions:  # the layout's names and shapes onto the model's, before the checks
        plan = conversion.apply(plan.but(conversions=()), models)
    check_plan(plan)  # every element of every tensor exactly once, inside its file
    plan = check_copies(plan, full=options.full_copy_check)
    if config is not None:
        plan = plan.but(config_dir=config)
    transforms = plan_transforms(src, options)
    for transform in transforms:
        plan = transform.apply(plan, models)
    expected, why_not = models.of(plan)
    unchecked = next(filter(None, (t.unchecked(plan) for t in transforms)), None)
    if unchecked:
        expected, why_not = None, unchecked
    plan = prepare(plan, options.dtype, plan.config_dir, expected, check_tied_bytes=check_tied_bytes)
    if options.allow_extra_tensors:  # recorded with the layout options, so verify --against plans the same way
        plan = plan.but(options={**plan.options, "allow_extra_tensors": True})
    if options.expert_layout != "hub":
        plan = plan.but(options={**plan.options, "expert_layout": options.expert_layout})
    return _model_checked(plan, in_layout(expected, plan, transforms), why_not, unchecked, options.allow_extra_tensors)


def in_layout(expected, plan: MergePlan, transforms: list[PlanTransform]):
    """The model's state dict as the transforms write it (per-expert Hub names): what the plan is checked against."""
    if expected is None:
        return None
    shapes = expected.shapes
    for transform in transforms:
        shapes = transform.expected_shapes(plan, shapes)
    return replace(expected, shapes=shapes)


def _model_checked(plan: MergePlan, expected, why_not: str, unchecked: str | None, allow_extra: bool) -> MergePlan:
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
