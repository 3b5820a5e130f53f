"""Plan transforms: a feature that changes what a merge writes by changing the plan, never the bytes.

A transform is given the reader's plan (checked, its copies compared) and returns a new one,
before normalisation sets the written names, ties and dtypes. It maps names and extents: a
rename, a split of one tensor into several (experts), a permutation or transpose of a tensor's
pieces, or a tensor computed from others (execute.computed: LoRA's fused weights). The executor
sees only the resulting plan. A transform may also add folders written inside OUT beside the
model (`outputs`: a PEFT adapter), each with its own manifest, and say which part of the plan an
output folder it wrote is checked against (`verified`, for verify --against).

Transforms are found through the pipeline's registry (pipeline.plan.TRANSFORMS), so the stages
below never name a feature.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

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

    def unchecked(self, plan: MergePlan) -> str | None:
        """Why the written names are not checked against a model class (no model is written), else None."""

    def outputs(self, plan: MergePlan, out_dir: str) -> list[ExtraFolder]:
        """The folders written beside the model; refuses (BadInput) one that cannot be written."""

    def verified(self, plan: MergePlan, options: dict) -> MergePlan | None:
        """The plan an output folder is checked against, from its manifest's layout options; None: not one of ours."""

    def describe(self, plan: MergePlan) -> dict:
        """What `inspect` shows of this transform's part of the plan, by key ({} for nothing)."""
