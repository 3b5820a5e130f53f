"""The engine named "torch": the pure-torch copy (execute.torch_copy) into a window of the output file."""

from __future__ import annotations

from ..io.sources import Source
from ..io.target import TargetFile
from ..plan.model import TensorPlan
from .sinks import WindowOutput
from .torch_copy import torch_copy


class TorchEngine:
    name = "torch"

    def output(self, file: TargetFile, end: int, start: int = 0) -> WindowOutput:
        return WindowOutput(file.window(start, end), self.execute, "cpu")

    def execute(self, jobs: list[tuple[TensorPlan, memoryview]], sources: Source) -> None:
        """Write each tensor's elements, converted to its target dtype, into its destination bytes."""
        torch_copy(jobs, sources)
