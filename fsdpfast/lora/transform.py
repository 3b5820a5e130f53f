"""PEFT LoRA as a plan transform (plan.transform): split the adapters off, check them, fuse or write them.

On any layout's plan: the names are split into the base model and one plan per adapter
(lora.plan.read_adapters, with --base's weights added), each adapted module is checked against
the model (lora.targets), --merge-lora attaches the fused computations (lora.fuse), and each
adapter plan gets the merge's dtype. Adapters not fused become folders inside OUT
(lora.output). A checkpoint without LoRA tensors passes unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..checks.ties import check_tied_bytes
from ..options import MergeOptions
from ..plan.model import MergePlan
from ..plan.normalise import prepare
from ..plan.transform import ExpectedModels, ExtraFolder
from .output import adapter_folders
from .plan import describe, fuse_chosen, read_adapters
from .targets import check_targets
from .verify import ADAPTER_FOLDERS


def transforms(src: str, options: MergeOptions) -> list[LoraTransform]:
    """The pipeline's hook (pipeline.plan.TRANSFORMS)."""
    return [LoraTransform(src, options)]


def folder_checks() -> list:
    """What verify checks of the adapter folders (pipeline.plan.folder_checks)."""
    return [ADAPTER_FOLDERS]


@dataclass(frozen=True)
class LoraTransform:
    src: str
    options: MergeOptions

    def apply(self, plan: MergePlan, models: ExpectedModels) -> MergePlan:
        lora = asdict(self.options.lora)
        plan = read_adapters(plan, self.src, **lora)
        # --base may have brought the config folder; waited for only if there are adapters to check
        expected, why_not = models.of(plan) if plan.adapters else (None, "")
        plan = check_targets(plan, expected, why_not)  # each adapted module the model's, written or fused
        plan = fuse_chosen(plan, self.src, **lora)
        # PEFT's own names: not checked against the model class
        return plan.but(
            adapters=[
                replace(a, plan=prepare(a.plan, self.options.dtype, None, check_tied_bytes=check_tied_bytes))
                for a in plan.adapters
            ]
        )

    def expected_in_layout(self, plan: MergePlan, expected):
        return expected  # the base model keeps its names; the adapters are checked by check_targets

    def unchecked(self, plan: MergePlan) -> str | None:
        return "a LoRA-only checkpoint" if not plan.tensors and plan.adapters else None

    def outputs(self, plan: MergePlan, out_dir: str) -> list[ExtraFolder]:
        return adapter_folders(plan, out_dir)

    def describe(self, plan: MergePlan) -> dict:
        """What inspect shows."""
        return {"adapters": describe(plan)}
