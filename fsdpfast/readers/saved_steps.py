"""Which training step verl's per-rank files record, so files of two saves are not merged as one.

verl's FSDP checkpoint manager saves, beside each rank's model file, that rank's optimizer state
(`optim_world_size_{W}_rank_{r}.pt`) and `extra_state_world_size_{W}_rank_{r}.pt` =
{"lr_scheduler": the scheduler's state_dict() or None, "rng": RNG states}. The model files
record no step; the scheduler's `last_epoch` does (it counts scheduler steps), and an optimizer's
state records a `step` per parameter. A save that crashed part way (or files copied in from
another step) leaves ranks of two steps in one folder: refused, naming the files and steps.
Only small pickles and one 0-d tensor per file are read; a rank whose model file was rewritten
but whose other files were not cannot be told from the files.
"""

from __future__ import annotations

import os
import struct

from .._parsing.safe_load import TensorRef, safe_unpickle
from .._parsing.torch_zip import TorchZip
from ..errors import BadInput, UnsafeCheckpoint

# verl's extra state pickles numpy's RNG state (an ndarray): inert records here, like everything else.
_NUMPY_RECORDS = frozenset(
    {
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",
        "numpy._core.multiarray.scalar",
        "numpy.core.multiarray.scalar",
    }
)
_SCALARS = {"float32": "<f", "float64": "<d", "int64": "<q", "int32": "<i", "float16": "<e"}


def check_same_step(folder: str, world: int) -> str | None:
    """Refuse rank files of two steps; a note saying what was compared (None if nothing records a step)."""
    for kind, read_step in (("extra_state", _scheduler_step), ("optim", _optimizer_step)):
        steps, problems = {}, []
        for rank in range(world):
            path = os.path.join(folder, f"{kind}_world_size_{world}_rank_{rank}.pt")
            if not os.path.isfile(path):
                continue
            try:
                step = read_step(path)
            except (BadInput, UnsafeCheckpoint) as exc:
                problems.append(f"{os.path.basename(path)} ({exc})")
                continue
            if step is not None:
                steps[path] = step
        if len(set(steps.values())) > 1:
            (path_a, a), (path_b, b) = _first_two_different(steps)
            raise BadInput(
                f"{path_a} records {a} but {path_b} records {b}: the rank files come from two saves "
                "(a save that crashed part way?); merge the files of one complete save"
            )
        if steps:
            what = next(iter(steps.values()))
            note = f"the {len(steps)} {kind} files agree on the training step ({what})"
            return note + (f"; unreadable: {problems[0]}" if problems else "")
    return None


def _first_two_different(steps: dict[str, str]):
    items = list(steps.items())
    first = items[0]
    return first, next(item for item in items[1:] if item[1] != first[1])


def _scheduler_step(path: str) -> str | None:
    with TorchZip(path) as archive:
        whole = safe_unpickle(archive.pickle_bytes, path, _NUMPY_RECORDS)
    scheduler = whole.get("lr_scheduler") if isinstance(whole, dict) else None
    if not isinstance(scheduler, dict):
        return None
    last_epoch = scheduler.get("last_epoch")
    return f"lr_scheduler last_epoch {last_epoch!r}" if isinstance(last_epoch, int) else None


def _optimizer_step(path: str) -> str | None:
    """The `step` of the optimizer state's first parameter (a 0-d tensor, or a number)."""
    with TorchZip(path) as archive:
        whole = safe_unpickle(archive.pickle_bytes, path)
        state = whole.get("state") if isinstance(whole, dict) else None
        if not isinstance(state, dict) or not state:
            return None
        first = state[min(state, key=repr)]
        step = first.get("step") if isinstance(first, dict) else None
        step = scalar_value(step, archive, path)
    return f"optimizer step {step:g}" if step is not None else None


def scalar_value(value, archive: TorchZip, path: str) -> int | float | None:
    """A number as pickled: itself, or the one element of a 0-d tensor (read from `archive`'s file); None otherwise."""
    if isinstance(value, TensorRef) and not value.shape and value.dtype in _SCALARS:
        buffer = archive.storage_buffer(value.storage)
        size = struct.calcsize(_SCALARS[value.dtype])
        if (value.offset + 1) * size > buffer.nbytes:
            raise BadInput(f"{path}: the optimizer's step reaches past its storage; the file is corrupt")
        with open(path, "rb") as f:
            f.seek(buffer.byte_offset + value.offset * size)
            data = f.read(size)
        if len(data) != size:  # the file was cut short after its zip directory was read
            raise BadInput(f"{path}: the file ends inside the optimizer's step; it is being written or was cut short")
        value = struct.unpack(_SCALARS[value.dtype], data)[0]
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
