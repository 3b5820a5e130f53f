"""`watch --nproc-per-merge 2`: each checkpoint merged by two `fsdpfast merge` processes torchrun
starts, with the watcher's merge options (--dtype bf16 here): the same files, byte for byte, as
the watcher's own in-process merge; a refused checkpoint is `refused` with the merge's one line."""

from __future__ import annotations

import json
import os

import pytest
from refusals import run_cli_here

from fsdpfast._testing.watch_job import RunSpec, write_run

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl")
    write_run(str(root), RunSpec("verl", steps=2), 2)
    actor = root / "run" / "global_step_0" / "actor"  # complete by the tracker, but not a torch.save archive
    actor.mkdir(parents=True)
    for rank in range(2):
        (actor / f"model_world_size_2_rank_{rank}.pt").write_bytes(b"not a torch.save archive")
    return root / "run"


def _watch_once(run, out, *options) -> tuple[int, list[dict]]:
    result = run_cli_here("watch", run, "--out", out, "--once", "--json", "--dtype", "bf16", *options)
    return result.returncode, [json.loads(line) for line in result.stdout.splitlines()]


def test_several_processes_publish_what_the_watchers_own_merge_does(verl_run, tmp_path):
    status, events = _watch_once(verl_run, tmp_path / "two", "--nproc-per-merge", "2")
    assert status == 2, events  # global_step_0 refused
    refused = [e for e in events if e["event"] == "refused"]
    assert [e["checkpoint"] for e in refused] == ["global_step_0"] and "\n" not in refused[0]["reason"]
    published = [e for e in events if e["event"] == "published"]
    assert [e["checkpoint"] for e in published] == ["global_step_1", "global_step_2"]
    assert all(e["bytes"] > 0 and e["files"] for e in published)

    status, _ = _watch_once(verl_run, tmp_path / "one")
    assert status == 2
    for name in ("global_step_1", "global_step_2"):
        files = sorted(f for f in os.listdir(tmp_path / "one" / name) if f.endswith(".safetensors"))
        assert files and files == sorted(f for f in os.listdir(tmp_path / "two" / name) if f.endswith(".safetensors"))
        for file in files:
            assert (tmp_path / "two" / name / file).read_bytes() == (tmp_path / "one" / name / file).read_bytes()

    status, events = _watch_once(verl_run, tmp_path / "two", "--nproc-per-merge", "2")  # published already
    assert [e["checkpoint"] for e in events if e["event"] == "skipped"] == ["global_step_1", "global_step_2"]
