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
  folder (`pytorch_model_fsdp_<i>/`, accelerate's name for it) has its `.metadata`. A Trainer's
  FSDP checkpoint-N meets that rule before its trainer_state.json: its model, all a merge reads,
  is complete then.
- torchtitan `step-N/` and any other DCP folder: its `.metadata` beside `.distcp` files, which
  DCP's finish renames into place after every rank's data files are written.
Anything else in the run folder is left alone.

The same rules read a run in an object store (watch.run_listing). A store has no rename and no
half-written object: an object appears whole once its PUT (or multipart upload) completes, so a
checkpoint still being uploaded is one with objects missing, and the mark, uploaded last, is what
tells it apart. Writers to a store put it last as they do on disk: torch's FsspecWriter writes
`.metadata.tmp` after every rank's data objects, then renames it, which on a store is a server-side
copy: `.metadata` appears whole, last; a trainer writes the tracker or `latest` after the save
returned. A tool that uploads a finished folder (`aws s3 sync`, `s5cmd`) orders nothing: upload the
mark after the rest. The merge then stands behind the mark: it plans from what the mark's files
name (DCP's `.metadata` lists every data object; rank files are checked complete) and refuses what
is missing, and it reads each object pinned to the ETag it listed, so an object replaced midway
fails the merge and nothing is published.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..readers.deepspeed_files import holds_tag_files
from ..readers.framework_folders import ACCELERATE_MODEL
from ..readers.megatron_folder import ITERATION_FILE
from .run_listing import LocalRun, StoreRun, run_listing

DCP_METADATA = ".metadata"
DCP_DATA = ".distcp"
DCP_RENAMING = ".metadata.tmp"
TRAINER_STATE = "trainer_state.json"
DEEPSPEED_LATEST = "latest"
_STEP = re.compile(r"(global_step_|iter_|checkpoint-|checkpoint_|step-)(\d+)")
_TRAILING = re.compile(r"(\d+)$")


@dataclass(frozen=True)
class Checkpoint:
    name: str  # the folder's name in the run folder, and its output's name in OUT_ROOT
    path: str  # its path, or its URL in an object store
    framework: str  # verl, megatron, deepspeed, trainer, accelerate, torchtitan, dcp
    step: int | None  # the number in its name, for the order of publishing and of --keep-last
    listing: LocalRun | StoreRun | None = field(default=None, compare=False, repr=False)

    @property
    def order(self) -> tuple:
        return publishing_order(self.name)

    def signature(self) -> tuple:
        """Its files with their sizes and modification times (ETags in a store): what says it changed."""
        return self.listing.signature(self.name)


def publishing_order(name: str) -> tuple:
    """Oldest first: by the step in the name; a name without one (Megatron's `release`, a `final`
    tag) last, as the newest. Publishing and --keep-last both sort by it."""
    step = step_of(name)
    return (step is None, step or 0, name)


def step_of(name: str) -> int | None:
    found = _STEP.fullmatch(name) or _TRAILING.search(name)
    return int(found.groups()[-1]) if found else None


def complete_checkpoints(run_dir: str) -> list[Checkpoint]:
    """The run folder's (or object-store prefix's) complete checkpoints, oldest step first."""
    run = run_listing(run_dir)
    folders = run.folders()
    if not folders:
        return []
    tracked = _tracked_step(run)
    latest_tag = run.read_small(DEEPSPEED_LATEST)
    found = []
    for name in folders:
        framework = _complete(name, run, tracked, latest_tag)
        if framework:
            found.append(Checkpoint(name, run.path(name), framework, step_of(name), run))
    return sorted(found, key=lambda c: c.order)


def _complete(name: str, run, tracked, latest_tag: str | None) -> str | None:
    """The framework whose mark says folder `name` is complete; None while it is not (or not a checkpoint)."""
    step = _STEP.fullmatch(name)
    kind = step.group(1) if step else None
    if kind in ("global_step_", "iter_") or name == "release":
        if tracked is None:
            return None
        if name == "release":
            return "megatron" if tracked == "release" else None
        done = isinstance(tracked, int) and int(step.group(2)) <= tracked
        return ("verl" if kind == "global_step_" else "megatron") if done else None
    entries = run.entries(name)
    if latest_tag is not None and holds_tag_files(entries):
        return "deepspeed" if _tag_done(name, latest_tag) else None
    if kind == "checkpoint-" and TRAINER_STATE in entries:
        return "trainer"
    if kind in ("checkpoint-", "checkpoint_"):
        models = [e for e in entries if ACCELERATE_MODEL.fullmatch(e)]
        return "accelerate" if any(_dcp_done(run.entries(f"{name}/{m}")) for m in models) else None
    if _dcp_done(entries):
        return "torchtitan" if kind == "step-" else "dcp"
    return None


def _dcp_done(entries: set[str]) -> bool:
    """A DCP folder whose `.metadata` is in place (DCP writes it after every rank's data files), its
    `.metadata.tmp` gone: in a store the writer's rename is a copy, then a delete of the temporary."""
    return DCP_METADATA in entries and DCP_RENAMING not in entries and any(e.endswith(DCP_DATA) for e in entries)


def _tag_done(name: str, latest: str) -> bool:
    if name == latest:
        return True
    mine, named = _TRAILING.search(name), _TRAILING.search(latest)
    return bool(mine and named) and int(mine.group(1)) < int(named.group(1))


def _tracked_step(run) -> int | str | None:
    """What latest_checkpointed_iteration.txt names: a step number, "release", or None (absent, unreadable)."""
    text = run.read_small(ITERATION_FILE)
    if text is None:
        return None
    if text == "release":
        return text
    return int(text) if text.isdigit() else None
