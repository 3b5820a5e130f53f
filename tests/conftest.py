"""Real FSDP2 checkpoints, written once per test session by spawned gloo ranks.

All checkpoints of one world size are written by one spawned process group the first time
a test asks for any of them.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # DeviceMesh pickling chatter from torch.load in tests
# `--engine auto` follows engine timings recorded on the machine (fsdpfast/execute/measurements.py);
# the tests, and the merges they spawn, must not depend on what a benchmark left there.
os.environ["FSDPFAST_MEASUREMENTS"] = os.devnull

from helpers import CheckpointsByWorld  # noqa: E402

from fsdpfast._testing.fsdp2_writer import CheckpointSpec, write_checkpoints  # noqa: E402

pytest_plugins = ["deepspeed_checkpoints"]  # the DeepSpeed ZeRO checkpoints' session fixture

# name -> (world size, spec). Sizes are tiny; uneven splits are on purpose (vocab 101 over
# 3 or 8 ranks, BERT's 2 token-type rows leave trailing ranks empty).
SPECS: dict[str, tuple[int, CheckpointSpec]] = {}


def _add(world: int, spec: CheckpointSpec) -> None:
    SPECS[spec.name] = (world, spec)


_add(1, CheckpointSpec("w1-plain", fsdp=False))
_add(1, CheckpointSpec("w1-dtensor-tied", model="llama-tied"))
_add(2, CheckpointSpec("w2-llama", seed=1))
_add(2, CheckpointSpec("w2-tied-bf16", model="llama-tied", dtype="bfloat16", seed=2))
_add(2, CheckpointSpec("w2-guide", layout="guide-ranks", seed=3))
# Plain to_local() pieces are placed by the model's shapes: config.json names the class.
_add(2, CheckpointSpec("w2-guide-local", layout="guide-ranks-local", architecture=True, second_save=True, seed=4))
_add(3, CheckpointSpec("w3-llama", seed=5))
_add(3, CheckpointSpec("w3-bert-dim1", model="bert", shard_dim=1, seed=6))
_add(3, CheckpointSpec("w3-wrapped-buffer", model="llama-tied", wrappers=True, buffer=True, seed=7))
_add(3, CheckpointSpec("w3-guide-local", model="bert", layout="guide-ranks-local", architecture=True, seed=8))
_add(2, CheckpointSpec("w2-dcp", layout="dcp", seed=14))
_add(3, CheckpointSpec("w3-dcp-nested-bert-dim1", model="bert", layout="dcp-nested", shard_dim=1, seed=15))
_add(
    3, CheckpointSpec("w3-dcp-safetensors", layout="dcp-safetensors", seed=17)
)  # untied: safetensors refuses shared storage
_add(4, CheckpointSpec("w4-dcp-hsdp-tied-bf16", model="llama-tied", dtype="bfloat16", layout="dcp", hsdp=True, seed=16))
_add(4, CheckpointSpec("w4-hsdp-tied", model="llama-tied", hsdp=True, seed=9))
_add(2, CheckpointSpec("w2-dcp-hf", layout="dcp-hf", seed=18))  # HuggingFaceStorageWriter(save_distributed=True)
_add(2, CheckpointSpec("w2-dcp-hf-split-dim1", layout="dcp-hf-split", shard_dim=1, seed=19))
_add(
    4,
    CheckpointSpec(
        "w4-dcp-hf-hsdp-tied-bf16", model="llama-tied", dtype="bfloat16", layout="dcp-hf", hsdp=True, seed=20
    ),
)
_add(4, CheckpointSpec("w4-bf16", dtype="bfloat16", seed=10))
_add(4, CheckpointSpec("w4-hsdp-bert-dim1", model="bert", hsdp=True, shard_dim=1, seed=11))
# Plain tensors in several ranks' files, and files of two steps (tests/test_rank_checks.py).
_add(2, CheckpointSpec("w2-guide-local-buffer", layout="guide-ranks-local", buffer=True, architecture=True, seed=21))
_add(
    3,
    CheckpointSpec(
        "w3-guide-local-bert-dim1", model="bert", layout="guide-ranks-local", shard_dim=1, architecture=True, seed=22
    ),
)
_add(2, CheckpointSpec("w2-ddp", fsdp=False, seed=23))  # DDP: every rank saves the whole model
_add(2, CheckpointSpec("w2-full-state", full_state=True, architecture=True, seed=24))
_add(2, CheckpointSpec("w2-verl-steps", verl_files=True, second_save=True, seed=25))
_add(8, CheckpointSpec("w8-tied", model="llama-tied", seed=12))
_add(8, CheckpointSpec("w8-hsdp-bert", model="bert", hsdp=True, seed=13))

# Options a spec's merge needs: its probe buffer is not part of the model config.json names.
MERGE_OPTIONS = {"w2-guide-local-buffer": {"allow_extra_tensors": True}}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> CheckpointsByWorld:
    return CheckpointsByWorld(
        str(tmp_path_factory.mktemp("checkpoints")), SPECS, write_checkpoints, lambda spec, root: spec.folder(root)
    )
