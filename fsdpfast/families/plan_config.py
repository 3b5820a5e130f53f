"""The config.json a plan's family rules read (the --config folder's, else the one a reader built), read once
per file as it is now. Kept apart from the transforms so that readers can ask for the family without
importing the transforms' options."""

from __future__ import annotations

import functools
import os

from ..hf.config import load_config
from ..plan.model import MergePlan


def config_of(plan: MergePlan) -> dict:
    """The plan's config.json (read once per file as it is now: every family rule asks for it). Read-only."""
    path = os.path.join(plan.config_dir, "config.json") if plan.config_dir is not None else None
    if path is not None and os.path.isfile(path):
        found = os.stat(path)
        return _config_at(path, found.st_mtime_ns, found.st_size)
    return plan.built_config or {}


@functools.lru_cache(maxsize=8)
def _config_at(path: str, mtime_ns: int, size: int) -> dict:
    return load_config(path)


def model_type(plan: MergePlan) -> str | None:
    found = config_of(plan).get("model_type")
    return found if isinstance(found, str) else None
