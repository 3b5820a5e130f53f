"""The frameworks' own checkpoint managers' folders (the session fixtures tests/readers use) are
found complete by the watcher and published as `merge` writes them: a Trainer's output_dir
(`checkpoint-N/`, trainer_state.json), torchtitan's checkpoint folder (`step-N/`, `.metadata`) and
a DeepSpeed root (`latest` names its last tag; an older tag without a number is left)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from framework_checkpoints import needs_accelerate, needs_torchtitan
from refusals import run_cli_here

import fsdpfast

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _watched_once(run_dir: str, out: Path) -> list[dict]:
    result = run_cli_here("watch", run_dir, "--out", out, "--once", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def _assert_as_merge_writes(checkpoint: str, published: Path, tmp_path: Path) -> None:
    fsdpfast.merge(checkpoint, tmp_path / "merged")
    weights = sorted(p.name for p in published.iterdir() if p.suffix == ".safetensors")
    assert weights and weights == sorted(p.name for p in (tmp_path / "merged").iterdir() if p.suffix == ".safetensors")
    for name in weights:
        assert (published / name).read_bytes() == (tmp_path / "merged" / name).read_bytes(), name


@pytest.mark.parametrize(
    "name", [pytest.param("trainer", marks=needs_accelerate), pytest.param("torchtitan", marks=needs_torchtitan)]
)
def test_a_frameworks_run_folder_is_published(frameworks, name, tmp_path):
    _, folder = frameworks.get(name)
    run_dir, step = os.path.split(folder)
    events = _watched_once(run_dir, tmp_path / "out")
    found = {e["checkpoint"]: e["framework"] for e in events if e["event"] == "found"}
    assert found.get(step) == {"trainer": "trainer", "torchtitan": "torchtitan"}[name], events
    assert step in [e["checkpoint"] for e in events if e["event"] == "published"]
    _assert_as_merge_writes(folder, tmp_path / "out" / step, tmp_path)


def test_a_deepspeed_root_publishes_the_tag_latest_names(deepspeed_checkpoints, tmp_path):
    _, root = deepspeed_checkpoints.get("ds-w2-z2-bf16-frozen-tags")
    latest = Path(root, "latest").read_text().strip()
    events = _watched_once(root, tmp_path / "out")
    assert [e["checkpoint"] for e in events if e["event"] == "published"] == [latest]  # not the tag "first"
    _assert_as_merge_writes(os.path.join(root, latest), tmp_path / "out" / latest, tmp_path)


def test_a_megatron_run_publishes_the_iterations_its_tracker_names(tmp_path):
    """Megatron-core's own run folder (tests/data/megatron): iter_0000007, which the tracker names, is
    published; a later iteration it does not name yet (the same files, copied in) is left alone."""
    from helpers import assert_bit_exact, read_merged
    from safetensors.torch import load_file

    data = Path(__file__).parents[1] / "data" / "megatron" / "tp2_pp1"
    run = tmp_path / "run"
    shutil.copytree(data / "run", run)
    shutil.copytree(run / "iter_0000007", run / "iter_0000009")
    result = run_cli_here("watch", run, "--out", tmp_path / "out", "--once", "--json", "--config", data / "hf")
    assert result.returncode == 0, result.stdout + result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(e["checkpoint"], e["framework"]) for e in events if e["event"] == "found"] == [
        ("iter_0000007", "megatron")
    ]
    assert sorted(os.listdir(tmp_path / "out")) == ["iter_0000007"]
    assert_bit_exact(
        read_merged(str(tmp_path / "out" / "iter_0000007")), load_file(str(data / "reference.safetensors"))
    )
