"""Plan a merge from metadata: read -> the layout's conversions -> checks -> copies -> transforms -> normalise
-> model check.

No tensor byte is written here; the copies a checkpoint holds twice are compared (checks.copies)
and config.json's model class is built on the meta device (plan.model_check), in a child process
started first (plan.expected_builds); a merge may wait for it only before publishing (pipeline.model_check).
"""

from __future__ import annotations

import functools
import importlib
import os

from .. import readers
from ..checks.copies import check_copies
from ..checks.ties import check_tied_bytes
from ..errors import BadInput, FsdpfastError
from ..families import keep_fp32
from ..families.plan_config import model_type
from ..fp8.plan import quantize_plan
from ..options import MergeOptions
from ..plan.checks import check_plan
from ..plan.model import MergePlan
from ..plan.normalise import prepare
from ..plan.transform import ExpectedModels, FolderChecks, PlanTransform
from .model_check import DeferredCheck, in_layout, model_checked

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
    plan, _ = planned_merge(src, options, wait=True)
    return plan


def planned_merge(src: str, options: MergeOptions, wait: bool = False) -> tuple[MergePlan, DeferredCheck | None]:
    """(the plan, None) once checked against the model; or, if the model is still being built and not
    `wait`, (the plan prepared without it, the check to finish before publishing: pipeline.model_check)."""
    config = options.config_dir
    if config is not None and not os.path.isfile(os.path.join(config, "config.json")):
        raise BadInput(f"{config}: --config folder has no config.json")
    models = ExpectedModels()
    ties_read = functools.partial(check_tied_bytes, read_mode=options.read_mode)  # as the merge reads
    models.start(config if config is not None else _likely_config(src))  # built while the files are read
    build = deferred = None
    try:
        plan = readers.read_plan(src, options.layout, config, lora_r=options.lora.lora_r, **options.layout_options)
        if config is not None:  # before the conversions: one may need the family config.json names
            plan = plan.but(config_dir=config)
        for conversion in plan.conversions:  # the layout's names and shapes onto the model's, before the checks
            plan = conversion.apply(plan.but(conversions=()), models)
        check_plan(plan)  # every element of every tensor exactly once, inside its file
        plan = check_copies(plan, full=options.full_copy_check, read_mode=options.read_mode)
        transforms = plan_transforms(src, options)
        for transform in transforms:
            plan = transform.apply(plan, models)
        unchecked = next(filter(None, (t.unchecked(plan) for t in transforms)), None)
        build = None if unchecked else models.build(plan)
        before = plan
        keep = kept_in_fp32(plan, options.dtype)
        if build is not None and not wait and not build.done():
            try:  # the ties without the model, checked against it before publishing
                plan = prepare(
                    before, options.dtype, before.config_dir, None, check_tied_bytes=ties_read, kept_in_fp32=keep
                )
                deferred = DeferredCheck(build, before, transforms, options.allow_extra_tensors, options.dtype)
            except FsdpfastError:  # perhaps a tie the model does not make: as the model says
                pass
        if deferred is None:
            expected, why_not = build.result() if build is not None else (None, unchecked)
            expected = in_layout(expected, before, transforms)  # ties and the check by the names written
            plan = prepare(
                before, options.dtype, before.config_dir, expected, check_tied_bytes=ties_read, kept_in_fp32=keep
            )
        if options.allow_extra_tensors:  # recorded with the layout options, so verify --against plans the same way
            plan = plan.but(options={**plan.options, "allow_extra_tensors": True})
        if options.expert_layout != "hub":
            plan = plan.but(options={**plan.options, "expert_layout": options.expert_layout})
        if deferred is not None:
            return _quantized(plan, options), deferred
        checked = model_checked(plan, expected, why_not, unchecked, options.allow_extra_tensors, options.dtype)
        return _quantized(checked, options), None
    finally:
        models.close(keep=deferred.build if deferred is not None else None)


def _quantized(plan: MergePlan, options: MergeOptions) -> MergePlan:
    """--dtype fp8: the linear weights quantized, after the checks against the model (which has none of the scales)."""
    return plan if options.fp8_skip is None else quantize_plan(plan, options.fp8_skip)


def kept_in_fp32(plan: MergePlan, dtype: str | None):
    """name -> whether a cast to `dtype` leaves it in float32, as transformers does for the model's class."""
    lists = keep_fp32.kept_lists(model_type(plan)) if dtype in ("bfloat16", "float16") else None
    return None if lists is None else keep_fp32.matcher(keep_fp32.kept_patterns(lists, dtype))


def _likely_config(src: str) -> str | None:
    """Where a reader will most likely find config.json (verl's huggingface/, a Hugging Face folder)."""
    return next(
        (d for d in (os.path.join(src, "huggingface"), src) if os.path.isfile(os.path.join(d, "config.json"))), None
    )
