"""Training frameworks' checkpoint folders: which folder holds the model, and where its config.json is.

A framework saves the model beside everything else it needs to resume, and users give the
folder it made. When that folder holds no checkpoint layout itself, the model is looked for
where the framework puts it, and the choice is said in the plan notes:
- accelerate `save_state` and a Hugging Face Trainer's `checkpoint-N/`: `pytorch_model_fsdp_{i}/`
  (a DCP folder), one per prepared model, beside `optimizer_{i}/`, rng states, `trainer_state.json`;
- verl's step folder `global_step_N/`: the rank files are in `actor/` (and `critic/`);
- Megatron-LM's run folder: the latest `iter_N/`, named by latest_checkpointed_iteration.txt.
Several candidates are refused, naming them. torchtitan's `step-N/` is a DCP folder whose model
sits at the top level of the state dict; readers.dcp reads it as it is.

accelerate and the Trainer save no config.json with sharded weights; the user or the Trainer puts
one in the checkpoint folder or the folder above it (the run's output_dir), where it is looked for.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import BadInput
from .megatron_folder import latest_iteration

ACCELERATE_MODEL = re.compile(r"pytorch_model_fsdp_(\d+)")  # accelerate's FSDP_MODEL_NAME + model index
_ACCELERATE_FILE = re.compile(r"pytorch_model_fsdp(_\d+)?_rank\d+\.bin")  # its per-rank files (LOCAL, or use_dcp=False)
_VERL_ROLES = ("actor", "critic")
_SHOWN = 5  # sub-folders or entries named in one line


@dataclass
class ModelFolder:
    path: str  # the folder the reader reads: the one given, or a sub-folder of it
    notes: list[str] = field(default_factory=list)  # what was chosen, and why
    config_dirs: list[str] = field(default_factory=list)  # where config.json may also be, in order

    def relative_to(self, given: str) -> str | None:
        """The model's folder relative to the one given (None: the same)."""
        relative = os.path.relpath(self.path, given)
        return None if relative == os.curdir else relative


def locate(folder: str, holds_layout: Callable[[str], bool]) -> ModelFolder:
    """The folder to read for `folder`. `holds_layout(path)`: some reader matches `path` itself."""
    if not os.path.isdir(folder) or holds_layout(folder):
        return ModelFolder(folder, config_dirs=_accelerate_config_dirs(folder))
    iteration = latest_iteration(folder)  # Megatron-LM's run folder: iter_N/ beside latest_checkpointed_iteration.txt
    if iteration and holds_layout(iteration[0]):
        return ModelFolder(iteration[0], [iteration[1]])
    entries = _entries(folder)
    models = sorted(
        (int(m.group(1)), e)
        for e in entries
        if (m := ACCELERATE_MODEL.fullmatch(e)) and os.path.isdir(os.path.join(folder, e))
    )
    models = [(i, e) for i, e in models if holds_layout(os.path.join(folder, e))]
    if len(models) > 1:
        shown = ", ".join(f"{e}/" for _, e in models[:_SHOWN])
        raise BadInput(
            f"{folder}: an accelerate checkpoint of {len(models)} models ({shown}); merge one: "
            f"fsdpfast merge {os.path.join(folder, models[0][1])} --out OUT"
        )
    if models:
        chosen = models[0][1]
        others = [e for e in entries if e not in (chosen, "config.json", "huggingface") and not e.startswith(".")]
        note = f"accelerate / Trainer checkpoint: the model is {chosen}/" + (
            f"; not merged: {_listed(folder, others)}" if others else ""
        )
        path = os.path.join(folder, chosen)
        return ModelFolder(path, [note], _accelerate_config_dirs(path))
    roles = [r for r in _VERL_ROLES if r in entries and holds_layout(os.path.join(folder, r))]
    if len(roles) > 1:
        raise BadInput(
            f"{folder}: a verl step folder: the rank files are in {' and '.join(f'{r}/' for r in roles)}; "
            f"merge one: fsdpfast merge {os.path.join(folder, roles[0])} --out OUT"
        )
    if roles:
        return ModelFolder(
            os.path.join(folder, roles[0]), [f"verl step folder: the rank files are in {roles[0]}/; merged those"]
        )
    return ModelFolder(folder)


def checkpoints_below(folder: str, holds_layout: Callable[[str], bool]) -> list[str]:
    """Sub-folders (one level down) that hold a checkpoint, for the error that finds none in `folder`."""
    found = []
    for entry in _entries(folder)[:200]:  # a home folder is not walked
        path = os.path.join(folder, entry)
        if os.path.isdir(path) and not entry.startswith("."):
            try:
                if locate(path, holds_layout).path != path or holds_layout(path):
                    found.append(entry)
            except BadInput:  # several models below it: a checkpoint all the same
                found.append(entry)
    return found


def config_dir(model: ModelFolder) -> tuple[str | None, str | None]:
    """(the first of the model's config folders holding config.json, a note saying where it was found)."""
    own = {os.path.abspath(model.path), os.path.abspath(os.path.join(model.path, "huggingface"))}
    for candidate in model.config_dirs:
        if os.path.isfile(os.path.join(candidate, "config.json")):
            outside = candidate not in own
            return candidate, (
                f"config.json from {candidate}, outside the model's folder (accelerate saves none with "
                "sharded weights; --config picks another)"
                if outside
                else None
            )
    return None, None


def in_or_beside(folder: str) -> str | None:
    """The config folder of a checkpoint folder that keeps the model's config.json itself: its
    huggingface/ sub-folder, else the folder, beside the checkpoint files (a DCP folder with
    save_pretrained's config and tokenizer files next to .metadata); a huggingface/ without one
    still (its tokenizer files are copied, and the merge warns that the output has no config.json)."""
    hf = os.path.join(folder, "huggingface")
    if not os.path.isfile(os.path.join(hf, "config.json")) and os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    return hf if os.path.isdir(hf) else None


def _accelerate_config_dirs(path: str) -> list[str]:
    """For an accelerate model folder or a folder of accelerate rank files: huggingface/ or the folder
    itself, then the folder that holds the model (the checkpoint), then the one above (the Trainer's
    output_dir). [] for any other folder: no config is looked for outside a checkpoint otherwise."""
    path = os.path.abspath(path)  # the folder above a relative one is the working directory's business too
    if ACCELERATE_MODEL.fullmatch(os.path.basename(path)):
        checkpoint = os.path.dirname(path)
    elif os.path.isdir(path) and any(_ACCELERATE_FILE.fullmatch(e) for e in _entries(path)):
        checkpoint = path
    else:
        return []
    bases = dict.fromkeys([path, checkpoint, os.path.dirname(checkpoint)])
    return [d for base in bases for d in (os.path.join(base, "huggingface"), base)]


def _entries(folder: str) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except OSError as exc:
        raise BadInput(f"{folder}: cannot list the folder ({exc.strerror})") from None


def _listed(folder: str, entries: list[str]) -> str:
    named = [f"{e}/" if os.path.isdir(os.path.join(folder, e)) else e for e in entries[:_SHOWN]]
    return ", ".join(named) + (f" and {len(entries) - _SHOWN} more" if len(entries) > _SHOWN else "")
