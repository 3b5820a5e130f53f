"""Engines execute a plan's extents into destination bytes; all of them are byte-identical."""
from __future__ import annotations

from ..errors import BadInput
from .torch_ref import TorchEngine

ENGINES = ("auto", "torch")


def select_engine(name: str = "auto"):
    if name not in ENGINES:
        raise BadInput(f"--engine {name!r} is not one of {', '.join(ENGINES)}")
    return TorchEngine()
