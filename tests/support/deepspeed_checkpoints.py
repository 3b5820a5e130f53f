"""Real DeepSpeed ZeRO checkpoints, written once per test session by DeepSpeed itself (gloo ranks on the CPU).

All checkpoints of one world size are written by one spawned process group the first time a test asks
for any of them. The tests skip only where deepspeed is not installed (CI installs it with the test extra).
"""

from __future__ import annotations

import importlib.util

import pytest
from helpers import CheckpointsByWorld

from fsdpfast._testing.deepspeed_examples import DeepSpeedSpec, write_deepspeed_checkpoints

# name -> (world size, spec): every stage at world sizes 2 to 4, bf16 and fp32 training, tied
# embeddings, frozen parameters, buffers and a second tag (two saves of one run, at stages 2 and 3).
# World size 3 leaves stage 1/2 padding at the end of the last rank's partition and stage 3 padding
# in pieces of odd-sized parameters.
DS_SPECS: dict[str, tuple[int, DeepSpeedSpec]] = {}


def _add(world: int, spec: DeepSpeedSpec) -> None:
    DS_SPECS[spec.name] = (world, spec)


_add(2, DeepSpeedSpec("ds-w2-z1-fp32-tied-frozen", 1, tied=True, frozen=True, buffer=True, seed=20))
_add(2, DeepSpeedSpec("ds-w2-z2-bf16-frozen-tags", 2, dtype="bfloat16", frozen=True, extra_tag="first", seed=21))
_add(2, DeepSpeedSpec("ds-w2-z3-fp32-tied-frozen", 3, tied=True, frozen=True, buffer=True, extra_tag="first", seed=22))
_add(3, DeepSpeedSpec("ds-w3-z1-bf16", 1, dtype="bfloat16", seed=23))
_add(3, DeepSpeedSpec("ds-w3-z2-fp32-tied", 2, tied=True, seed=24))
_add(3, DeepSpeedSpec("ds-w3-z3-bf16-frozen", 3, dtype="bfloat16", frozen=True, buffer=True, seed=25))
_add(4, DeepSpeedSpec("ds-w4-z1-bf16-tied-frozen", 1, dtype="bfloat16", tied=True, frozen=True, seed=26))
_add(4, DeepSpeedSpec("ds-w4-z2-fp32-frozen", 2, frozen=True, buffer=True, seed=27))
_add(4, DeepSpeedSpec("ds-w4-z3-bf16-tied", 3, dtype="bfloat16", tied=True, seed=28))


@pytest.fixture(scope="session")
def deepspeed_checkpoints(tmp_path_factory) -> CheckpointsByWorld:
    if importlib.util.find_spec("deepspeed") is None:  # not imported here: merging must never need it
        pytest.skip("deepspeed is not installed (pip install -e '.[test]' installs it)")
    return CheckpointsByWorld(
        str(tmp_path_factory.mktemp("deepspeed")),
        DS_SPECS,
        write_deepspeed_checkpoints,
        lambda spec, base: spec.root(base),
    )
