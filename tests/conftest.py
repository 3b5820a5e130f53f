"""Real FSDP2 checkpoints, written once per test session by spawned gloo ranks.

All checkpoints of one world size are written by one spawned process group the first time
a test asks for any of them.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # DeviceMesh pickling chatter from torch.load in tests
# `--engine auto` follows engine timings recorded on the machine (fsdpfast/execute/measurements.py);
# the tests, and the merges they spawn, must not depend on what a benchmark left there.
os.environ["FSDPFAST_MEASUREMENTS"] = os.devnull
# The model check's cache (plan.model_cache) of this session only, shared with the merges it spawns:
# a test never reads what an earlier session, or the user, left in ~/.cache/fsdpfast.
os.environ["FSDPFAST_CACHE_DIR"] = tempfile.mkdtemp(prefix="fsdpfast-test-cache-")
atexit.register(shutil.rmtree, os.environ["FSDPFAST_CACHE_DIR"], True)

from corpus import SPECS  # noqa: E402
from helpers import CheckpointsByWorld  # noqa: E402

from fsdpfast._testing.fsdp2_writer import write_checkpoints  # noqa: E402

# the session fixtures of the DeepSpeed ZeRO checkpoints and of the frameworks' folders (tests/support)
pytest_plugins = ["deepspeed_checkpoints", "framework_checkpoints"]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> CheckpointsByWorld:
    return CheckpointsByWorld(
        str(tmp_path_factory.mktemp("checkpoints")), SPECS, write_checkpoints, lambda spec, root: spec.folder(root)
    )


def pytest_collection_modifyitems(items):
    """Markers a test's parameters decide: a run of the torch or cuda engine calls the extension's torch
    ops (`torch_ops`), one on a CUDA device needs a GPU (`gpu`)."""
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if params.get("engine") in ("torch", "cuda"):
            item.add_marker(pytest.mark.torch_ops)
        if params.get("device") == "cuda" or params.get("engine") == "cuda":
            item.add_marker(pytest.mark.gpu)
