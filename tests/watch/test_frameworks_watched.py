"""The frameworks' own checkpoint managers' folders (the session fixtures tests/readers use) are
found complete by the watcher and published as `merge` writes them: a Trainer's output_dir
(`checkpoint-N/`, trainer_state.json), torchtitan's checkpoint folder (`step-N/`, `.metadata`) and
a DeepSpeed root (`latest` names its last tag; an older tag without a number is left)."""

from __future__ import annotations

import json
import os
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
