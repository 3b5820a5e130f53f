"""Checkpoint layouts: each reader turns a folder into a MergePlan, reading metadata only."""
from __future__ import annotations

import os

from ..errors import BadInput
from ..plan import MergePlan
from . import dcp, dcp_hf, fsdp1_flat, fsdp_ranks, guide_ranks

READERS = {reader.NAME: reader for reader in (fsdp_ranks, guide_ranks, dcp, dcp_hf, fsdp1_flat)}


def detect(folder: str) -> str:
    """The name of the one layout `folder` holds; an error if none or several match."""
    if not os.path.exists(folder):
        raise BadInput(f"{folder}: no such folder")
    if not os.path.isdir(folder):
        raise BadInput(f"{folder}: not a folder; give the folder that holds the rank files")
    if not os.listdir(folder):
        raise BadInput(f"{folder}: the folder is empty")
    found = [name for name, reader in READERS.items() if reader.matches(folder)]
    if not found:
        known = "; ".join(reader.DESCRIPTION for reader in READERS.values())
        raise BadInput(f"{folder}: no known checkpoint layout found (looked for {known})")
    if len(found) > 1:
        raise BadInput(f"{folder}: holds files of several layouts ({', '.join(found)}); choose one with --layout")
    return found[0]


def read_plan(folder: str, layout: str | None = None, prefix: str | None = None, fsdp1: dict | None = None) -> MergePlan:
    """The reader's plan; `prefix` picks the model part of a nested checkpoint (DCP); `fsdp1`
    holds fsdp1-flat's options (wrap, use_orig_params, config)."""
    if layout is None:
        layout = detect(folder)
    elif layout not in READERS:
        raise BadInput(f"--layout {layout!r} is not a known layout; known: {', '.join(READERS)}")
    elif not READERS[layout].matches(folder):
        raise BadInput(f"{folder}: no files of layout {layout} ({READERS[layout].DESCRIPTION})")
    if prefix is not None:
        if layout != dcp.NAME:
            raise BadInput(f"--prefix applies to {dcp.NAME} checkpoints; {folder} holds {layout}")
        return dcp.read(folder, prefix)
    fsdp1 = fsdp1 or {}
    if layout == fsdp1_flat.NAME:
        return fsdp1_flat.read(folder, **fsdp1)
    if fsdp1.get("wrap") is not None or fsdp1.get("use_orig_params") is not None:
        raise BadInput(f"--wrap and --use-orig-params apply to {fsdp1_flat.NAME} checkpoints; {folder} holds {layout}")
    return READERS[layout].read(folder)
