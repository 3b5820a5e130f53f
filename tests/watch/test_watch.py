"""`fsdpfast watch`: a real gloo FSDP2 job saves several steps while the watcher runs in another
process; every step is published once, bit for bit, never while it is being written; a refused
checkpoint does not stop it; a restart publishes nothing twice; --keep-last; --then; kill -9."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import assert_bit_exact, load_reference, read_merged
from refusals import run_cli_here

from fsdpfast._testing.watch_job import RunSpec, write_run

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
STEPS = 3
_PATIENCE_S = 600  # a watcher that hangs fails the test instead of the suite


def _start_watcher(run: Path, out: Path, log: Path, *options) -> subprocess.Popen:
    command = [sys.executable, "-m", "fsdpfast", "watch", str(run), "--out", str(out), "--json", *map(str, options)]
    return subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.PIPE, text=True)


def _events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []


def _of(events: list[dict], kind: str) -> list[str]:
    return [e["checkpoint"] for e in events if e["event"] == kind]


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + _PATIENCE_S
    while not condition():
        assert time.monotonic() < deadline, f"waited {_PATIENCE_S} s for {what}"
        time.sleep(0.05)


def _stop(watcher: subprocess.Popen) -> str:
    watcher.send_signal(signal.SIGTERM)
    _, err = watcher.communicate(timeout=_PATIENCE_S)
    assert watcher.returncode == 0, err
    return err


def _assert_is_the_model(out: Path, refs: Path, name: str) -> None:
    reference, tied = load_reference(str(refs / f"{name}.pt"))
    assert_bit_exact(read_merged(str(out / name)), reference, tied=tied)


def _break_step_zero(run: Path) -> None:
    """global_step_0: complete by verl's tracker (an earlier step), but its rank file is not a torch.save archive."""
    actor = run / "global_step_0" / "actor"
    actor.mkdir(parents=True)
    (actor / "model_world_size_2_rank_0.pt").write_bytes(b"not a torch.save archive")
    (actor / "model_world_size_2_rank_1.pt").write_bytes(b"not a torch.save archive")


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """Two runs written while a watcher each runs: verl's step folders (with a broken step 0 the
    watcher must refuse and get past) and torchtitan's DCP steps, each step's files a second
    before the mark that it is complete."""
    root = tmp_path_factory.mktemp("watched")
    found = {}
    for framework in ("verl", "torchtitan"):
        job = root / framework
        run, out, log = job / "run", job / "out", job / "events.jsonl"
        run.mkdir(parents=True)
        if framework == "verl":
            _break_step_zero(run)
        then_log = job / "then.log"
        then = f"{sys.executable} -c \"import sys; open({str(then_log)!r}, 'a').write(sys.argv[1] + '\\n')\""
        watcher = _start_watcher(run, out, log, "--interval", "0.2", "--then", then)
        try:
            write_run(str(job), RunSpec(framework, steps=STEPS, pause=1.0 if framework == "verl" else 0.0), 2)
            names = [RunSpec(framework).checkpoint(step) for step in range(1, STEPS + 1)]
            done = lambda f=log: len([e for e in _events(f) if e["event"] == "then"]) == STEPS  # noqa: E731
            _wait_for(done, f"{framework}'s steps published and --then run on each")
        finally:
            if watcher.poll() is None:
                _stop(watcher)
        found[framework] = (job, names, _events(log), then_log)
    return found


@pytest.mark.parametrize("framework", ["verl", "torchtitan"])
def test_every_step_is_published_once_bit_for_bit(watched, framework):
    job, names, events, then_log = watched[framework]
    assert _of(events, "published") == names  # once each, in step order
    for name in names:
        _assert_is_the_model(job / "out", job / "refs", name)
    published = [e for e in events if e["event"] == "published"]
    assert all(e["bytes"] > 0 and e["seconds"] >= 0 and e["files"] for e in published)
    assert then_log.read_text().splitlines() == [str(job / "out" / name) for name in names]
    assert [e["status"] for e in events if e["event"] == "then"] == [0] * len(names)
    assert events[-1]["event"] == "stopped"
    assert not [e for e in os.listdir(job / "out") if e.startswith(".")], "staging folders or locks left"


def test_a_refused_checkpoint_does_not_stop_the_watcher(watched):
    job, names, events, _ = watched["verl"]
    refused = [e for e in events if e["event"] == "refused"]
    assert [e["checkpoint"] for e in refused] == ["global_step_0"]  # said once, not at every look
    assert "\n" not in refused[0]["reason"] and "global_step_0" in refused[0]["reason"]
    assert not (job / "out" / "global_step_0").exists()
    assert _of(events, "published") == names


def test_a_restart_publishes_nothing_twice_and_keep_last_removes_only_what_fsdpfast_wrote(watched, tmp_path):
    job, names, _, _ = watched["torchtitan"]
    out = tmp_path / "out"
    shutil.copytree(job / "out", out)  # copy2: the files keep their modification times, as the manifest lists them
    (out / names[0] / "eval.json").write_text("{}")  # a pipeline's file in an output: not fsdpfast's
    (out / "notes").mkdir()
    (out / "notes" / "todo.txt").write_text("not an output")
    result = run_cli_here("watch", job / "run", "--out", out, "--once", "--json")
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert _of(events, "skipped") == names and not _of(events, "started")

    result = run_cli_here("watch", job / "run", "--out", out, "--once", "--keep-last", "1", "--json")
    assert result.returncode == 0, result.stderr
    removed = [e for e in map(json.loads, result.stdout.splitlines()) if e["event"] == "removed"]
    assert [(Path(e["out"]).name, e["kept"]) for e in removed] == [(names[0], ["eval.json"]), (names[1], [])]
    assert sorted(os.listdir(out)) == sorted([names[0], names[2], "notes"])
    assert os.listdir(out / names[0]) == ["eval.json"] and (out / "notes" / "todo.txt").exists()
    _assert_is_the_model(out, job / "refs", names[2])


def test_once_exits_2_when_a_checkpoint_is_refused(watched, tmp_path):
    job, names, _, _ = watched["verl"]
    result = run_cli_here("watch", job / "run", "--out", tmp_path / "out", "--once")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "refused global_step_0" in result.stdout
    assert sorted(os.listdir(tmp_path / "out")) == names


@pytest.fixture(scope="module")
def one_large_step(tmp_path_factory):
    """A step whose merge takes long enough to be killed in the middle (about 100 MB)."""
    root = tmp_path_factory.mktemp("large")
    sizes = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, vocab_size=16000, num_attention_heads=8)
    write_run(str(root), RunSpec("torchtitan", steps=1, sizes=sizes), 2)
    return root


def test_a_watcher_killed_mid_merge_leaves_no_output_and_the_next_one_publishes_it(one_large_step, tmp_path):
    run, out, log = one_large_step / "run", tmp_path / "out", tmp_path / "events.jsonl"
    watcher = _start_watcher(run, out, log, "--interval", "0.2")
    try:
        _wait_for(lambda: _merging(out, "step-1") or watcher.poll() is not None, "the merge's staging folder")
        os.kill(watcher.pid, signal.SIGKILL)
    finally:
        watcher.wait()
    assert _merging(out, "step-1"), f"the merge ended before it could be killed: {_events(log)}"
    assert not (out / "step-1").exists() and "published" not in {e["event"] for e in _events(log)}

    result = run_cli_here("watch", run, "--out", out, "--once", "--json")
    assert result.returncode == 0, result.stderr
    assert _of([json.loads(line) for line in result.stdout.splitlines()], "published") == ["step-1"]
    _assert_is_the_model(out, one_large_step / "refs", "step-1")
    assert not [e for e in os.listdir(out) if e.startswith(".")], "the killed merge's staging folder was not removed"


def test_sigterm_discards_the_merge_under_way(one_large_step, tmp_path):
    run, out, log = one_large_step / "run", tmp_path / "out", tmp_path / "events.jsonl"
    watcher = _start_watcher(run, out, log, "--interval", "0.2")
    try:
        _wait_for(lambda: watcher.poll() is not None or _merging(out, "step-1"), "the merge's staging folder")
    finally:
        err = _stop(watcher) if watcher.poll() is None else watcher.communicate()[1]
    events = _events(log)
    assert events[-1]["event"] == "stopped", (events, err)
    if "published" not in {e["event"] for e in events}:  # stopped while writing: nothing of it is left
        assert "step-1 was discarded" in events[-1]["reason"]
        assert not out.exists() or not os.listdir(out), os.listdir(out)
    else:  # the signal came after the rename: published whole
        _assert_is_the_model(out, one_large_step / "refs", "step-1")


def _merging(out: Path, name: str) -> bool:
    return out.exists() and any(e.startswith(f".{name}.fsdpfast-") for e in os.listdir(out))
