"""Stage 1, the readers: each turns a checkpoint folder of its layout into a MergePlan, reading metadata only.

This module is the registry (READERS), detection, and the one entry point `read_plan`."""

from __future__ import annotations

import contextlib
import gc
import os

from ..errors import BadInput, option
from ..plan.model import MergePlan
from . import (
    accelerate_ranks,
    dcp,
    dcp_hf,
    deepspeed_zero,
    framework_folders,
    fsdp1_flat,
    fsdp_ranks,
    guide_ranks,
    megatron,
)
from .reader import Reader, ReaderOption

# The registry: every layout fsdpfast reads, in the order detection tries them.
READERS: dict[str, Reader] = {
    module.READER.name: module.READER
    for module in (fsdp_ranks, guide_ranks, dcp, dcp_hf, deepspeed_zero, fsdp1_flat, accelerate_ranks, megatron)
}

# Options a user may give beyond the folder, and the one layout each belongs to.
LAYOUT_OPTIONS: dict[str, str] = {opt.name: reader.name for reader in READERS.values() for opt in reader.options}


def user_options() -> list[tuple[Reader, ReaderOption]]:
    """The layout options the command line offers, with the reader each belongs to."""
    return [(reader, opt) for reader in READERS.values() for opt in reader.options if not opt.internal]


def detect(folder: str) -> str:
    """The name of the one layout `folder` holds; an error if none or several match."""
    if not os.path.exists(folder):
        raise BadInput(f"{folder}: no such folder")
    if not os.path.isdir(folder):
        raise BadInput(f"{folder}: not a folder; give the folder that holds the rank files")
    if not os.listdir(folder):
        raise BadInput(f"{folder}: the folder is empty")
    found = _layouts_in(folder)
    if not found:
        below = framework_folders.checkpoints_below(folder, _holds_layout)
        if below:
            shown = ", ".join(f"{entry}/" for entry in below[:5]) + (
                f" and {len(below) - 5} more" if len(below) > 5 else ""
            )
            what = (
                f"sub-folder {shown} holds a checkpoint" if len(below) == 1 else f"sub-folders {shown} hold checkpoints"
            )
            raise BadInput(
                f"{folder}: no checkpoint files here, but its {what}: merge "
                f"{'it' if len(below) == 1 else 'one'} (fsdpfast merge {os.path.join(folder, below[-1])} --out OUT)"
            )
        known = "; ".join(reader.description for reader in READERS.values())
        raise BadInput(f"{folder}: no known checkpoint layout found (looked for {known})")
    if len(found) > 1:
        raise BadInput(
            f"{folder}: holds files of several layouts ({', '.join(found)}); choose one with {option('layout')}"
        )
    return found[0]


def _layouts_in(folder: str) -> list[str]:
    return [name for name, reader in READERS.items() if reader.sniff(folder)]


def _holds_layout(folder: str) -> bool:
    return bool(_layouts_in(folder))


@contextlib.contextmanager
def collector_paused():
    """Reading a checkpoint of many ranks makes millions of small objects and no garbage cycles
    worth collecting: the cyclic garbage collector would walk them over and over (a sixth of the
    planning time at 1,024 ranks)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def check_layout(layout: str | None, options: dict) -> None:
    """A forced layout is a registered one, and every option given (not None) is a layout option."""
    for name, value in options.items():
        if value is not None and name not in LAYOUT_OPTIONS:
            raise unknown_layout_option(name)
    if layout is not None and layout not in READERS:
        raise BadInput(f"{option('layout', layout)} is not a known layout; known: {', '.join(READERS)}")


def unknown_layout_option(name: str) -> BadInput:
    return BadInput(f"unknown layout option {name!r}; known: {', '.join(LAYOUT_OPTIONS)}")


def read_plan(
    folder: str, layout: str | None = None, config: str | None = None, lora_r: int | None = None, **options
) -> MergePlan:
    """The reader's plan. `options` are layout options (LAYOUT_OPTIONS), None meaning not given;
    one given for another layout is an error. `config` is passed to readers that rebuild the model,
    `lora_r` to those that rebuild a PEFT model (elsewhere lora.plan uses it)."""
    check_layout(layout, options)
    given = {name: value for name, value in options.items() if value is not None}
    model = framework_folders.locate(folder, _holds_layout)  # the folder itself, or where a framework put the model
    source = model.path
    if layout is None:
        layout = detect(source)
    elif not READERS[layout].sniff(source):
        found = _layouts_in(source)  # a Megatron folder is a DCP folder too, but read as megatron only
        holds = f"; it holds a {' and '.join(found)} checkpoint" if found else ""
        raise BadInput(f"{source}: no files of layout {layout} ({READERS[layout].description}){holds}")
    for name in given:
        if LAYOUT_OPTIONS[name] != layout:
            raise BadInput(f"{option(name)} applies to {LAYOUT_OPTIONS[name]} checkpoints; {folder} holds {layout}")
    found_config, config_note = (None, None) if config else framework_folders.config_dir(model)
    if READERS[layout].reads_config:
        given["config"] = config or found_config
    extra = {"lora_r": lora_r} if READERS[layout].takes_lora_r and lora_r is not None else {}
    with collector_paused():
        plan = READERS[layout].read(source, **given, **extra)
    if found_config and (plan.config_dir is None or READERS[layout].reads_config):
        plan = plan.but(config_dir=found_config)
    if config_note and plan.config_dir == found_config:
        plan = plan.noted(config_note)
    plan = plan.noted(*model.notes, first=True)
    plan = plan.but(model_folder=model.relative_to(folder))
    options = {**given, **plan.options}
    options.pop("config", None)
    plan = plan.but(options=options)
    return plan
