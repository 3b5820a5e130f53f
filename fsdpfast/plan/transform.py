"""Plan transforms: a feature that changes what a merge writes by changing the plan, never the bytes.

A transform is given the reader's plan (checked, its copies compared) and returns a new one,
before normalisation sets the written names, ties and dtypes. It maps names and extents: a
rename, a split of one tensor into several (experts), a permutation or transpose of a tensor's
pieces, or a tensor computed from others (execute.computed: LoRA's fused weights). The executor
sees only the resulting plan. A transform may also add folders written inside OUT beside the
model (`outputs`: a PEFT adapter), each with its own manifest. What `verify` checks of those
folders (each against its own manifest, the checkpoint or a reference; which part of the
checkpoint's plan a folder holds, for --against; `--smoke`) the transform's module gives as
FolderChecks.

Transforms and their folder checks are found through the pipeline's registry
(pipeline.plan.TRANSFORMS), so no stage, verify included, names a feature. A layout whose names
and shapes are not the model's has a transform of its own, its conversion (readers.megatron_names):
its reader attaches it to the plan (MergePlan.conversions) and the pipeline applies it first,
before the plan's checks, so the checks, the feature transforms and verify --against (which plans
again) see the model's tensors. A conversion maps names and extents only (plan.windows): no
folders, nothing of its own to verify.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ..errors import BadInput
from .expected_builds import ExpectedBuild, start_build
from .layout import OutputFile
from .model import MergePlan
from .model_check import ExpectedModel


class ExpectedModels:
    """The model config.json names (plan.model_check), built once for the config a plan points at:
    a transform may change where that is (a base model folder), so it is looked up on demand. Each
    build starts when first asked for (`start`, `build`) and runs beside planning and writing; `of`
    waits for it. `close` stops the builds nobody waited for."""

    def __init__(self):
        self._builds: dict[tuple, ExpectedBuild] = {}

    def start(self, config_dir: str | None) -> None:
        """Begin building config_dir's model before the plan says it is the one (a guess: a wrong
        one costs a child process's CPU, stopped at `close`). Nothing for a config that cannot be read."""
        try:
            self._build(config_dir, None)
        except BadInput:  # said again, in its turn, when the plan's own config is read
            pass

    def build(self, plan: MergePlan) -> ExpectedBuild:
        """The build of the plan's model, started (or done): `done()`, `result()`."""
        return self._build(plan.config_dir, plan.built_config)

    def of(self, plan: MergePlan) -> tuple[ExpectedModel | None, str]:
        return self.build(plan).result()

    def close(self, keep: ExpectedBuild | None = None) -> None:
        for build in self._builds.values():
            if build is not keep:
                build.cancel()

    def _build(self, config_dir: str | None, built: dict | None) -> ExpectedBuild:
        key = (config_dir, id(built))
        if key not in self._builds:
            self._builds[key] = start_build(config_dir, built)
        return self._builds[key]


@dataclass(frozen=True)
class ExtraFolder:
    """A folder written inside OUT beside the model: one weights file executed with the model's,
    JSON files beside it, and a manifest of its own (pipeline.finish)."""

    folder: str  # inside OUT, e.g. lora_adapter
    plan: MergePlan  # its tensors, over the checkpoint plan's sources
    weights: OutputFile  # named inside the folder
    json_files: tuple[tuple[str, dict], ...] = ()  # (name inside the folder, content)
    notes: tuple[str, ...] = ()  # for the report

    @property
    def placed(self) -> OutputFile:
        """The weights file, named by its place in OUT (what the executor writes)."""
        return replace(self.weights, name=f"{self.folder}/{self.weights.name}")

    def written(self) -> list[str]:
        return [f"{self.folder}/{name}" for name in (self.weights.name, *(name for name, _ in self.json_files))]


class PlanTransform(Protocol):
    def apply(self, plan: MergePlan, models: ExpectedModels) -> MergePlan:
        """The new plan (names and extents only); `models` gives the model the plan describes."""

    def expected_in_layout(self, plan: MergePlan, expected: ExpectedModel) -> ExpectedModel:
        """The model config.json's class describes (its state dict's names, shapes and ties) as this
        transform writes it: what ties are found by and the plan is checked against (`expected` itself
        for a transform that keeps the model's names)."""

    def unchecked(self, plan: MergePlan) -> str | None:
        """Why the written names are not checked against a model class (no model is written), else None."""

    def outputs(self, plan: MergePlan, out_dir: str) -> list[ExtraFolder]:
        """The folders written beside the model; refuses (BadInput) one that cannot be written."""

    def describe(self, plan: MergePlan) -> dict:
        """What `inspect` shows of this transform's part of the plan, by key ({} for nothing)."""


class FolderChecks(Protocol):
    """What verify checks of the folders a transform wrote beside the model (ExtraFolder)."""

    what: str  # what the folders hold, for the report ("peft adapters")
    recorded: tuple[str, ...]  # the layout options a folder's manifest records for this transform, not a reader's

    def verified(self, plan: MergePlan, recorded: dict) -> MergePlan | None:
        """The part of the checkpoint's plan a folder holds, from its manifest's `recorded` options; None: not one."""

    def listed(self, manifest: dict | None) -> list:
        """The folders OUT's manifest lists as this transform's (each checked by `check`)."""

    def model_less(self, out_dir: str) -> bool:
        """Whether `out_dir` holds only this transform's folders and a manifest, no model files."""

    def is_own_folder(self, folder: str) -> bool:
        """Whether `folder` is one of this transform's folders, given to verify alone."""

    def check(self, report, out_dir: str, folders: list, *, verify_folder: Callable[..., Any], **checks) -> None:
        """Each folder checked with `verify_folder` (verify itself) and the same checks, into `report`."""

    def smoke(self, base_dir: str, folders: list, notes: list[str], load_base) -> list[str]:
        """Problems found using the folders with the model in `base_dir` (load_base: verify.smoke's loader)."""

    def smoke_folder(self, folder: str, notes: list[str], load_base) -> list[str]:
        """--smoke of one of the folders given alone."""


class NamesOnly:
    """The parts of PlanTransform a transform that only maps names and extents leaves as they are:
    the model's names are checked as written, no folders of its own, nothing for inspect."""

    def expected_in_layout(self, plan: MergePlan, expected: ExpectedModel) -> ExpectedModel:
        return expected

    def unchecked(self, plan: MergePlan) -> str | None:
        return None

    def outputs(self, plan: MergePlan, out_dir: str) -> list[ExtraFolder]:
        return []

    def describe(self, plan: MergePlan) -> dict:
        return {}
