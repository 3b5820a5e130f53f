"""Which checkpoints of a training run's folder are complete, framework by framework.

A checkpoint still being written is never read: each framework leaves a mark once a save is done,
and a folder is listed only once that mark is there.
- verl `global_step_N/` and Megatron `iter_NNNNNNN/` (and `release/`): the run folder's
  latest_checkpointed_iteration.txt, which both write after every rank's files, names N or a
  later step. Without that file no step is complete.
- DeepSpeed tags (`global_stepN/`, any name): the run folder's `latest`, written by
  save_checkpoint once every rank saved, names the tag, or a tag whose trailing number is higher
  (a tag without a number is complete only while `latest` names it).
- a Hugging Face Trainer's `checkpoint-N/`: its trainer_state.json, which the Trainer writes after
  the model, optimizer and RNG states; accelerate's `checkpoint_N/` (save_state): the model's DCP
  folder (`pytorch_model_fsdp_0/`, found by readers.framework_folders) has its `.metadata`. A
  Trainer's FSDP checkpoint-N meets that rule before its trainer_state.json: its model, all a
  merge reads, is complete then.
- torchtitan `step-N/` and any other DCP folder: its `.metadata`, which DCP's finish renames into
  place after every rank's data files are written.
Anything else in the run folder is left alone.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .. import readers
from ..readers.deepspeed_files import is_tag_folder
from ..readers.framework_folders import locate
from ..readers.megatron_folder import ITERATION_FILE

DCP_METADATA = ".metadata"
TRAINER_STATE = "trainer_state.json"
DEEPSPEED_LATEST = "latest"
_STEP = re.compile(r"(global_step_|iter_|checkpoint-|checkpoint_|step-)(\d+)")
_TRAILING = re.compile(r"(\d+)$")


@dataclass(frozen=True)
class Checkpoint:
    name: str  # the folder's name in the run folder, and its output's name in OUT_ROOT
    path: str
    framework: str  # verl, megatron, deepspeed, trainer, accelerate, torchtitan, dcp
    step: int | None  # the number in its name, for the order of publishing and of --keep-last

    @property
    def order(self) -> tuple:
        return publishing_order(self.name)


def publishing_order(name: str) -> tuple:
    """Oldest first: by the step in the name; a name without one (Megatron's `release`, a `final`
    tag) last, as the newest. Publishing and --keep-last both sort by it."""
    step = step_of(name)
    return (step is None, step or 0, name)


def step_of(name: str) -> int | None:
    found = _STEP.fullmatch(name) or _TRAILING.search(name)
    return int(found.groups()[-1]) if found else None


def complete_checkpoints(run_dir: str) -> list[Checkpoint]:
    """The run folder's complete checkpoints, oldest step first."""
    try:
        entries = sorted(e for e in os.listdir(run_dir) if not e.startswith("."))
    except FileNotFoundError:
        return []
    tracked = _tracked_step(run_dir)
    latest_tag = _read_small(os.path.join(run_dir, DEEPSPEED_LATEST))
    found = []
    for name in entries:
        path = os.path.join(run_dir, name)
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        framework = _complete(name, path, tracked, latest_tag)
        if framework:
            found.append(Checkpoint(name, path, framework, step_of(name)))
    return sorted(found, key=lambda c: c.order)


def _complete(name: str, path: str, tracked, latest_tag: str | None) -> str | None:
    """The framework whose mark says `path` is complete; None while it is not (or not a checkpoint)."""
    step = _STEP.fullmatch(name)
    kind = step.group(1) if step else None
    if kind in ("global_step_", "iter_") or name == "release":
        if tracked is None:
            return None
        if name == "release":
            return "megatron" if tracked == "release" else None
        done = isinstance(tracked, int) and int(step.group(2)) <= tracked
        return ("verl" if kind == "global_step_" else "megatron") if done else None
    if latest_tag is not None and is_tag_folder(path):
        return "deepspeed" if _tag_done(name, latest_tag) else None
    if kind == "checkpoint-" and os.path.isfile(os.path.join(path, TRAINER_STATE)):
        return "trainer"
    if kind in ("checkpoint-", "checkpoint_"):
        model = locate(path, _holds_layout).path
        return "accelerate" if model != path and os.path.isfile(os.path.join(model, DCP_METADATA)) else None
    if os.path.isfile(os.path.join(path, DCP_METADATA)):
        return "torchtitan" if kind == "step-" else "dcp"
    return None


def _tag_done(name: str, latest: str) -> bool:
    if name == latest:
        return True
    mine, named = _TRAILING.search(name), _TRAILING.search(latest)
    return bool(mine and named) and int(mine.group(1)) < int(named.group(1))


def _tracked_step(run_dir: str) -> int | str | None:
    """What latest_checkpointed_iteration.txt names: a step number, "release", or None (absent, unreadable)."""
    text = _read_small(os.path.join(run_dir, ITERATION_FILE))
    if text is None:
        return None
    if text == "release":
        return text
    return int(text) if text.isdigit() else None


def _read_small(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(256).strip()
    except OSError:
        return None


def _holds_layout(folder: str) -> bool:
    return any(reader.sniff(folder) for reader in readers.READERS.values())
