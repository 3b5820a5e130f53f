"""Recognising Megatron-Core dist_checkpointing folders, and the run folder Megatron-LM wraps them in.

`dist_checkpointing.save` in the torch_dist format writes a DCP folder plus `metadata.json`
({"sharded_backend": "torch_dist", ...}) and `common.pt`. Megatron-LM, NeMo and verl save one per
iteration as `iter_0000100/`, beside `latest_checkpointed_iteration.txt` naming the latest (a number,
or "release").
"""

from __future__ import annotations

import json
import os

from ..errors import BadInput

ITERATION_FILE = "latest_checkpointed_iteration.txt"


def is_torch_dist(folder: str) -> bool:
    """Whether `folder` is a Megatron-Core torch_dist checkpoint (its metadata.json says so)."""
    path = os.path.join(folder, "metadata.json")
    if not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            metadata = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(metadata, dict) and metadata.get("sharded_backend") == "torch_dist"


def latest_iteration(folder: str) -> tuple[str, str] | None:
    """(the iteration folder, a note) when `folder` is a Megatron run folder; None otherwise."""
    path = os.path.join(folder, ITERATION_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            text = f.read(64).strip()
    except OSError as exc:
        raise BadInput(f"{path}: unreadable ({exc.strerror})") from None
    if text == "release":
        name = "release"
    elif text.isdigit():
        name = f"iter_{int(text):07d}"
    else:
        raise BadInput(f"{path}: holds {text[:40]!r}, not an iteration number; merge an iter_NNNNNNN/ folder directly")
    chosen = os.path.join(folder, name)
    if not os.path.isdir(chosen):
        raise BadInput(
            f"{path} names iteration {text}, but {chosen} is missing; merge an existing iter_NNNNNNN/ folder directly"
        )
    others = sorted(e for e in os.listdir(folder) if e != name and (e.startswith("iter_") or e == "release"))
    note = f"Megatron run folder: merged the latest iteration {name}/ ({ITERATION_FILE})" + (
        f"; not merged: {len(others)} other iterations ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})"
        if others
        else ""
    )
    return chosen, note
