"""Folders the training frameworks' own saving code writes on gloo ranks (fsdpfast._testing.framework_examples),
written once per test session on first use (a pytest plugin: the `frameworks` fixture)."""

from __future__ import annotations

import importlib.util

import pytest
from helpers import CheckpointsByWorld, load_reference

HAVE_ACCELERATE = importlib.util.find_spec("accelerate") is not None
HAVE_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
needs_accelerate = pytest.mark.skipif(not HAVE_ACCELERATE, reason="accelerate (the test extra) is not installed")
needs_torchtitan = pytest.mark.skipif(not HAVE_TORCHTITAN, reason="torchtitan (installed by .ci/run) is not installed")


def _specs():
    from fsdpfast._testing.framework_examples import FrameworkSpec

    specs = []
    if HAVE_ACCELERATE:
        specs += [
            (2, FrameworkSpec("acc-state", "accelerate-state", seed=41)),
            (3, FrameworkSpec("acc-state-fsdp1", "accelerate-state", fsdp_version=1, seed=42)),
            (2, FrameworkSpec("acc-two-models", "accelerate-two-models", seed=43)),
            (2, FrameworkSpec("acc-ranks", "accelerate-ranks", seed=45)),
            (3, FrameworkSpec("acc-ranks-fsdp1", "accelerate-ranks", fsdp_version=1, seed=46)),
            (2, FrameworkSpec("trainer", "trainer-checkpoint", seed=47)),
            (
                2,
                FrameworkSpec(
                    "trainer-local-fsdp1",
                    "trainer-checkpoint",
                    fsdp_version=1,
                    state_dict_type="LOCAL_STATE_DICT",
                    seed=48,
                ),
            ),
        ]
    if HAVE_TORCHTITAN:
        specs.append((3, FrameworkSpec("torchtitan", "torchtitan", seed=49)))
    return {spec.name: (world, spec) for world, spec in specs}


class FrameworkCheckpoints(CheckpointsByWorld):
    def __init__(self, root: str):
        from fsdpfast._testing.framework_examples import write_framework_checkpoints

        super().__init__(root, _specs(), write_framework_checkpoints, lambda spec, root: spec.folder(root))

    def reference(self, name: str, model: int = 0):
        spec = self.get(name)[0]
        return load_reference(spec.reference_path(self.root, model))


@pytest.fixture(scope="session")
def frameworks(tmp_path_factory) -> FrameworkCheckpoints:
    return FrameworkCheckpoints(str(tmp_path_factory.mktemp("frameworks")))
