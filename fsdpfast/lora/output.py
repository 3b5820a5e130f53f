"""Write each PEFT adapter as a folder peft loads: OUT/lora_adapter (default), OUT/lora_adapter/<name> (others).

Each folder holds `adapter_model.safetensors` (peft's saved names), `adapter_config.json` and
a manifest of its own, in the format of OUT's: tensor names repeat from adapter to adapter, so
one manifest per folder keeps them unambiguous, and an adapter folder copied or uploaded alone
still verifies (`fsdpfast verify OUT/lora_adapter`). The adapter files are executed with the
model's (`adapter_outputs`, named by their place inside OUT); `write_adapter_files` then writes
each folder's config and manifest into the merge's target, so OUT is published with its
adapters complete, or not at all. OUT's manifest lists the adapter folders.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

from ..errors import BadInput
from ..manifest import MANIFEST_NAME, build_manifest
from ..plan.layout import OutputFile, plan_files
from ..plan.model import MergePlan
from .split import AdapterPlan

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def check_writable(plan: MergePlan) -> None:
    """Refuse before anything is written: an adapter whose lora_alpha is recorded nowhere."""
    for adapter in plan.adapters:
        if adapter.problems:
            raise BadInput(adapter.problems[0])


def adapter_file(adapter: AdapterPlan) -> OutputFile:
    """peft reads one file per adapter, never an index: no size limit."""
    (planned,) = plan_files(adapter.plan, sys.maxsize)
    return replace(planned, name=ADAPTER_FILE)


def adapter_outputs(plan: MergePlan) -> list[OutputFile]:
    """Each adapter's file, named by its place in the output folder (lora_adapter/adapter_model.safetensors)."""
    return [replace(adapter_file(adapter), name=f"{adapter.folder}/{ADAPTER_FILE}") for adapter in plan.adapters]


def write_adapter_files(
    plan: MergePlan,
    target,
    checksums: dict[str, dict],
    checkpoint: str,
    identity: list[dict],
    engine: str,
    dtype: str | None,
    out_dir: str,
) -> tuple[list[str], list[str]]:
    """Each adapter folder's config and manifest, once its file is written (`checksums`: by output file
    name, then tensor name); (folders written, notes)."""
    folders, notes = [], []
    for adapter in plan.adapters:
        planned = adapter_file(adapter)
        config = dict(adapter.config)
        if config.get("base_model_name_or_path") is None:
            config["base_model_name_or_path"], note = _base_path(plan, out_dir, adapter)
            if note:
                notes.append(note)
        target.write_json(f"{adapter.folder}/{CONFIG_FILE}", config)
        target.write_json(
            f"{adapter.folder}/{MANIFEST_NAME}",
            build_manifest(
                checkpoint,
                adapter.plan,
                [planned],
                checksums[f"{adapter.folder}/{ADAPTER_FILE}"],
                identity,
                engine,
                dtype,
            ),
        )
        folders.append(adapter.folder)
    return folders, notes


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


def written_files(folders: list[str]) -> list[str]:
    return [f"{folder}/{name}" for folder in folders for name in (ADAPTER_FILE, CONFIG_FILE)]


def dry_run_files(plan: MergePlan) -> list[tuple[str, OutputFile]]:
    return [(f.name, f) for f in adapter_outputs(plan)]
