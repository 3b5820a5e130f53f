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


def test_a_watcher_stopped_during_a_merge_by_several_processes_publishes_nothing_partial(tmp_path):
    """SIGTERM while torchrun's processes write: the watcher says `stopped`; no partial output (the
    merge's staging folder at most, which the next merge into that folder removes); a restart publishes it."""
    import signal
    import subprocess
    import sys
    import time

    from helpers import assert_bit_exact, load_reference, read_merged

    sizes = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, vocab_size=16000, num_attention_heads=8)
    write_run(str(tmp_path), RunSpec("torchtitan", steps=1, sizes=sizes), 2)
    run, out, log = tmp_path / "run", tmp_path / "out", tmp_path / "events.jsonl"
    command = [
        sys.executable,
        "-m",
        "fsdpfast",
        "watch",
        str(run),
        "--out",
        str(out),
        "--json",
        "--nproc-per-merge",
        "2",
    ]
    watcher = subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not (out.exists() and any(e.startswith(".step-1.fsdpfast-") for e in os.listdir(out))):
        assert watcher.poll() is None and time.monotonic() < deadline, watcher.stderr.read()
        time.sleep(0.02)
    watcher.send_signal(signal.SIGTERM)
    _, err = watcher.communicate(timeout=600)
    assert watcher.returncode == 0, err
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events[-1]["event"] == "stopped", events
    if "published" not in {e["event"] for e in events}:  # stopped while writing: nothing of it published
        assert not (out / "step-1").exists(), events
    status, events = _watch_once_keep(run, out)
    assert status == 0 and [e["checkpoint"] for e in events if e["event"] in ("published", "skipped")] == ["step-1"]
    reference, tied = load_reference(str(tmp_path / "refs" / "step-1.pt"))
    assert_bit_exact(read_merged(str(out / "step-1")), reference, tied=tied)
    assert not [e for e in os.listdir(out) if e.startswith(".")], os.listdir(out)


def _watch_once_keep(run, out) -> tuple[int, list[dict]]:
    result = run_cli_here("watch", run, "--out", out, "--once", "--json")
    return result.returncode, [json.loads(line) for line in result.stdout.splitlines()]
