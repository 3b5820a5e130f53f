"""One DeepSpeed save, not several: what every rank file of a tag folder records must agree.

A save that crashed part way, or files copied in from another tag, leave rank files of two saves in
one folder; merged, they give neither step's model. Each file records which save it is from:
- every optimizer file: the wrapped torch optimizer's step count (Adam's `step`), `ds_version`,
  stage 1/2 the `param_alignment_paddings` of its groups (the same on every rank);
- every model-states file (stage 3: one per rank): `global_steps`, `global_samples`,
  `skipped_steps`, `ds_version`, the shapes the merge is laid out by (`param_shapes`,
  `frozen_param_shapes`, `buffer_names`), and the run's `dp_world_size` and `ds_config` ZeRO stage,
  which must be the optimizer files' `partition_count` and `zero_stage`. Not `shared_params`:
  DeepSpeed 0.19.8's stage 3 records a tie in rank 0's file only (read from there, as zero_to_fp32 does).
Equal counters are required between files of one kind. Across kinds only an inequality holds: the
optimizer steps once per engine step that was not skipped, but restarts at 0 when a run resumed
without its optimizer states, so an optimizer ahead of `global_steps - skipped_steps` is refused and
one behind it is not. Files of two saves that agree on all of this cannot be told apart.
"""

from __future__ import annotations

import os

from ..errors import BadInput
from .deepspeed_files import RankFiles

_SAVE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")
_LAYOUT = ("param_shapes", "frozen_param_shapes", "buffer_names")
_ONE_SAVE = "the folder mixes two saves; point fsdpfast at one save's folder"


def check_one_save(tag_dir: str, files: RankFiles) -> str:
    """Refuse rank files of different saves in one line naming two of them; else a note of the step they agree on."""
    optim_paths = [path for path, _ in files.optim]
    _same(tag_dir, "optimizer step", {p: f.step for p, f in zip(optim_paths, files.optim_files)})
    for counter in _SAVE_COUNTERS:
        _same(tag_dir, counter, {path: model.get(counter) for path, model in files.model})
    for key in _LAYOUT:
        _same(tag_dir, key, {path: _plain(model.get(key)) for path, model in files.model}, layout=True)
    if files.stage < 3:
        paddings = {path: _plain(state.get("param_alignment_paddings")) for path, state in files.optim}
        _same(tag_dir, "param_alignment_paddings", paddings, layout=True)
    versions = {p: f.ds_version for p, f in zip(optim_paths, files.optim_files)}
    _same(tag_dir, "ds_version", {**versions, **{path: model.get("ds_version") for path, model in files.model}})
    _optimizer_not_ahead(tag_dir, files)
    _run_agrees(tag_dir, files)
    step = files.model[0][1].get("global_steps")
    optimizer_step = files.optim_files[0].step
    return (
        f"one save: {len(files.optim) + len(files.model)} rank files agree on global_steps {_count(step)} "
        f"and optimizer step {_count(optimizer_step)}"
    )


def _same(tag_dir: str, what: str, recorded: dict[str, object], layout: bool = False) -> None:
    """Every file that records `what` records the same value (files that record none are not compared)."""
    known = {path: value for path, value in recorded.items() if value is not None}
    if not known:
        return
    (first, value), *rest = known.items()
    for path, other in rest:
        if other != value:
            if layout:
                raise BadInput(
                    f"{tag_dir}: {_name(path)} records {what} {_difference(other, value)}, {_name(first)} "
                    f"{_difference(value, other)}: the folder mixes files of two runs or saves; "
                    "point fsdpfast at one save's folder"
                )
            raise BadInput(
                f"{tag_dir}: {_name(path)} is from {what} {_count(other)}, {_name(first)} from {what} "
                f"{_count(value)}: {_ONE_SAVE}"
            )


def _optimizer_not_ahead(tag_dir: str, files: RankFiles) -> None:
    """The optimizer cannot have stepped more often than the engine took unskipped steps."""
    models = files.model if files.stage == 3 else files.model * files.world
    for (optim_path, _), facts, (model_path, model) in zip(files.optim, files.optim_files, models):
        steps, skipped = model.get("global_steps"), model.get("skipped_steps") or 0
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (facts.step, steps, skipped)):
            continue
        if facts.step > steps - skipped:
            raise BadInput(
                f"{tag_dir}: {_name(optim_path)} is from optimizer step {_count(facts.step)}, {_name(model_path)} "
                f"from global_steps {_count(steps)} ({_count(skipped)} skipped): {_ONE_SAVE}"
            )


def _run_agrees(tag_dir: str, files: RankFiles) -> None:
    """The model states were saved by the run the optimizer files are from: its world size and ZeRO stage."""
    path, model = files.model[0]
    config = model.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    recorded = {
        "dp_world_size": (model.get("dp_world_size"), files.world, "partitioned over {} ranks (partition_count)"),
        "the ZeRO stage": (zero.get("stage") if isinstance(zero, dict) else None, files.stage, "of ZeRO stage {}"),
    }
    for what, (value, expected, optimizer) in recorded.items():
        if _is_whole(value) and value != expected:
            raise BadInput(
                f"{tag_dir}: {_name(path)} records {what} {value}, the optimizer files are {optimizer.format(expected)}: "
                "the folder mixes files of two runs; point fsdpfast at one save's folder"
            )


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Names(tuple):
    """A pickled name -> value map as its (name, value) pairs: the order counts (param_shapes lays out the flat groups)."""


def _plain(value):
    """Pickled containers as comparable values: lists and tuples alike (torch.Size is read as a tuple)."""
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return _Names((k, _plain(v)) for k, v in value.items())
    return value


def _difference(value, other) -> str:
    """`value` where it differs from `other`: the first differing entry of a name map, else the whole (cut short)."""
    if isinstance(value, _Names) and isinstance(other, _Names):
        for (name, a), (other_name, b) in zip(value, other):
            if name != other_name:
                return f"{name} at position {[n for n, _ in value].index(name)}"
            if a != b:
                return f"{name} {_shown(a)}"
        return f"{len(value)} names" if len(value) != len(other) else _shown(value)
    if isinstance(value, tuple) and isinstance(other, tuple) and len(value) == len(other):
        for a, b in zip(value, other):
            if a != b:
                return _difference(a, b)
    return _shown(value)


def _shown(value) -> str:
    text = str(list(value)) if isinstance(value, tuple) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _count(value) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _name(path: str) -> str:
    return os.path.basename(path)
