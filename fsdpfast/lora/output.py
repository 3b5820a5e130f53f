"""Write each PEFT adapter as a folder peft loads: OUT/lora_adapter (default), OUT/lora_adapter/<name> (others).

Each folder holds `adapter_model.safetensors` (peft's saved names), `adapter_config.json` and
a manifest of its own, in the format of OUT's: tensor names repeat from adapter to adapter, so
one manifest per folder keeps them unambiguous, and an adapter folder copied or uploaded alone
still verifies (`fsdpfast verify OUT/lora_adapter`). The adapter files are executed with the
model's (ExtraFolder.placed, named by their place inside OUT); the merge's finisher
(pipeline.finish) then writes each folder's config and manifest into the merge's target, so OUT
is published with its adapters complete, or not at all. OUT's manifest lists the adapter folders.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

from ..errors import BadInput
from ..plan.layout import OutputFile, plan_files
from ..plan.model import MergePlan
from ..plan.transform import ExtraFolder
from .split import AdapterPlan

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def adapter_folders(plan: MergePlan, out_dir: str) -> list[ExtraFolder]:
    """Each adapter's folder inside OUT (its file, adapter_config.json; pipeline.finish adds its
    manifest), refused before anything is written when an adapter's lora_alpha is recorded nowhere."""
    for adapter in plan.adapters:
        if adapter.problems:
            raise BadInput(adapter.problems[0])
    folders = []
    for adapter in plan.adapters:
        config, notes = dict(adapter.config), ()
        if config.get("base_model_name_or_path") is None:
            config["base_model_name_or_path"], note = _base_path(plan, out_dir, adapter)
            notes = (note,) if note else ()
        folders.append(
            ExtraFolder(adapter.folder, adapter.plan, adapter_file(adapter), ((CONFIG_FILE, config),), notes)
        )
    return folders


def adapter_file(adapter: AdapterPlan) -> OutputFile:
    """peft reads one file per adapter, never an index: no size limit."""
    (planned,) = plan_files(adapter.plan, sys.maxsize)
    return replace(planned, name=ADAPTER_FILE)


def _base_path(plan: MergePlan, out_dir: str, adapter: AdapterPlan) -> tuple[str | None, str | None]:
    """What the adapter applies to: the --base folder, or OUT when OUT holds the unmerged base."""
    if plan.options.get("base"):
        return plan.options["base"], None
    if plan.tensors and not plan.options.get("merge_lora"):
        return os.path.abspath(out_dir), None
    return None, (
        f"{adapter.folder}/{CONFIG_FILE}: base_model_name_or_path is null (not recorded, and no base model "
        "written); set it, or load with PeftModel.from_pretrained(base_model, folder)"
    )
