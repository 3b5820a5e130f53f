"""The restricted unpickler on every Python fsdpfast supports (3.10 to 3.13).

safe_load subclasses pickle's pure-Python `_Unpickler` and replaces entries of its `dispatch`
table: private internals that may change between Python releases. So each supported Python this
machine has (CI's machines have them all under pyenv) reads real checkpoints' metadata in a
subprocess, with neither torch nor the native module, and must reach the plan the test's own
Python reaches, and refuse the same malicious pickles with the same error. Set
FSDPFAST_REQUIRE_PYTHONS=1 (CI does) to fail rather than skip when an interpreter is missing.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_unsafe_pickles import HAND_WRITTEN, LIVE_PAYLOADS

pytestmark = [pytest.mark.slow]

VERSIONS = ("3.10", "3.11", "3.12", "3.13")
ROOT = Path(__file__).resolve().parents[2]
# The layouts whose planning needs no torch: every pickle-reading reader but fsdp1-flat (it rebuilds the model).
DEEPSPEED = "ds-w2-z3-fp32-tied-frozen"  # DeepSpeed's optimizer pickles too
CHECKPOINTS = (
    "w2-llama",
    "w3-bert-dim1",
    "w2-guide",
    "w4-hsdp-tied",
    "w2-dcp",
    "w3-dcp-nested-bert-dim1",
    "w2-verl-steps",
)

# Runs under the other interpreter: plans (or refusals) as JSON on stdout.
_SCRIPT = r"""
import dataclasses, json, sys
sys.modules["torch"] = None  # importing torch would fail: proves planning needs none
from fsdpfast import readers
from fsdpfast._parsing.safe_load import safe_unpickle

def plan_of(folder):
    p = readers.read_plan(folder)
    return {"layout": p.layout, "world_size": p.world_size, "notes": list(p.notes),
            "sources": [[s.path, s.byte_offset, s.nbytes, s.dtype] for s in p.sources],
            "tensors": [[t.name, list(t.shape), t.source_dtype, [list(dataclasses.astuple(e)) for e in t.extents]] for t in p.tensors]}

def outcome(path):
    try:
        safe_unpickle(open(path, "rb").read(), path)
        return "read"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

job = json.load(sys.stdin)
print(json.dumps({"version": list(sys.version_info[:2]), "plans": {k: plan_of(v) for k, v in job["folders"].items()},
                  "payloads": {k: outcome(v) for k, v in job["payloads"].items()}}))
"""


def interpreter(version: str) -> str | None:
    """The first `python<version>` that runs: pyenv's installed versions, then PATH (whose pyenv shims may not)."""
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = sorted(glob.glob(os.path.join(pyenv, "versions", f"{version}.*", "bin", "python")), reverse=True)
    candidates += [found for found in [shutil.which(f"python{version}")] if found]
    for python in candidates:
        probe = subprocess.run(
            [python, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True
        )
        if probe.returncode == 0 and probe.stdout.strip() == str(tuple(int(p) for p in version.split("."))):
            return python
    return None


def run_under(python: str, job: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONNOUSERSITE": "1"}
    result = subprocess.run(
        [python, "-S", "-c", _SCRIPT],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def job(checkpoints, deepspeed_checkpoints, tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("payloads")
    marker = folder / "MARKER"
    payloads = {}
    for name, (build, _) in LIVE_PAYLOADS.items():
        for protocol in (2, pickle.HIGHEST_PROTOCOL):
            path = folder / f"{name}-{protocol}.pkl"
            path.write_bytes(build(marker, protocol))
            payloads[f"{name}/{protocol}"] = str(path)
    for name, (data, _) in HAND_WRITTEN.items():
        path = folder / f"hand-{name}.pkl"
        path.write_bytes(data(marker) if callable(data) else data)
        payloads[f"hand/{name}"] = str(path)
    folders = {name: str(checkpoints.get(name)[1]) for name in CHECKPOINTS}
    folders[DEEPSPEED] = str(deepspeed_checkpoints.get(DEEPSPEED)[1])
    return {"folders": folders, "payloads": payloads, "marker": str(marker)}


@pytest.fixture(scope="module")
def here(job) -> dict:
    return run_under(sys.executable, job)


@pytest.mark.parametrize("version", [v for v in VERSIONS if v != f"{sys.version_info[0]}.{sys.version_info[1]}"])
def test_each_python_plans_and_refuses_as_this_one(version, job, here):
    python = interpreter(version)
    if python is None:
        if os.environ.get("FSDPFAST_REQUIRE_PYTHONS"):
            pytest.fail(f"Python {version} is not installed (FSDPFAST_REQUIRE_PYTHONS is set)")
        pytest.skip(f"Python {version} is not installed")
    there = run_under(python, job)
    assert there["version"] == [int(part) for part in version.split(".")]
    assert there["plans"] == here["plans"]
    assert there["payloads"] == here["payloads"]
    assert all(plan["tensors"] for plan in here["plans"].values())
    assert all(outcome.startswith(("UnsafeCheckpoint", "BadInput")) for outcome in here["payloads"].values()), here[
        "payloads"
    ]
    assert not Path(job["marker"]).exists()
