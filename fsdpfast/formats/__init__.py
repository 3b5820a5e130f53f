"""Checkpoint layouts: each reader turns a folder into a MergePlan, reading metadata only."""
from __future__ import annotations

import os

from ..errors import BadInput, option
from ..plan import MergePlan
from . import dcp, dcp_hf, deepspeed_zero, fsdp1_flat, fsdp_ranks, guide_ranks

READERS = {reader.NAME: reader for reader in (fsdp_ranks, guide_ranks, dcp, dcp_hf, deepspeed_zero, fsdp1_flat)}

# Options a user may give beyond the folder, and the one layout each belongs to; a reader's
# read(folder, **options) takes its own.
LAYOUT_OPTIONS = {
    "prefix": dcp.NAME,  # the model part of a nested state dict
    "tag": deepspeed_zero.NAME,  # which checkpoint tag
    "exclude_frozen": deepspeed_zero.NAME,  # leave frozen parameters out (zero_to_fp32 --exclude_frozen_parameters)
    "wrap": fsdp1_flat.NAME,  # the module classes FSDP1 wrapped
    "use_orig_params": fsdp1_flat.NAME,  # whether FSDP1 padded each parameter for alignment
    "order_from": fsdp1_flat.NAME,  # not for users: the merge records it, verify --against passes it back
}
CONFIG_READERS = (fsdp1_flat.NAME, dcp_hf.NAME)  # readers that read config.json themselves (`config`: --config)


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
        raise BadInput(f"{folder}: holds files of several layouts ({', '.join(found)}); choose one with {option('layout')}")
    return found[0]


def read_plan(folder: str, layout: str | None = None, config: str | None = None, **options) -> MergePlan:
    """The reader's plan. `options` are layout options (LAYOUT_OPTIONS), None meaning not given;
    one given for another layout is an error. `config` is passed to readers that rebuild the model."""
    given = {name: value for name, value in options.items() if value is not None}
    for name in given:
        if name not in LAYOUT_OPTIONS:
            raise BadInput(f"unknown layout option {name!r}; known: {', '.join(LAYOUT_OPTIONS)}")
    if layout is None:
        layout = detect(folder)
    elif layout not in READERS:
        raise BadInput(f"{option('layout', layout)} is not a known layout; known: {', '.join(READERS)}")
    elif not READERS[layout].matches(folder):
        raise BadInput(f"{folder}: no files of layout {layout} ({READERS[layout].DESCRIPTION})")
    for name in given:
        if LAYOUT_OPTIONS[name] != layout:
            raise BadInput(f"{option(name)} applies to {LAYOUT_OPTIONS[name]} checkpoints; {folder} holds {layout}")
    if layout in CONFIG_READERS:
        given["config"] = config
    plan = READERS[layout].read(folder, **given)
    plan.options = {**given, **plan.options}
    plan.options.pop("config", None)
    return plan
