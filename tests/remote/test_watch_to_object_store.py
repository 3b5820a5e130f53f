"""`fsdpfast watch RUN_DIR --out s3://...` against the S3 server (tests/remote/conftest.py): a real
run (accelerate's save_state on two gloo ranks, fsdpfast._testing.framework_runs) saves three
steps locally while the watcher publishes each to the bucket; each is published once, its objects
byte-identical to what `merge` writes locally from the finished checkpoint; a restarted watcher
finds them published; --keep-last removes the older outputs' objects fsdpfast wrote and nothing
else."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from framework_checkpoints import HAVE_ACCELERATE
from s3_server import objects

import fsdpfast
from fsdpfast._testing.framework_runs import checkpoint_name, run_folder, write_framework_run
from fsdpfast.manifest import MANIFEST_NAME

pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.skipif(not HAVE_ACCELERATE, reason="accelerate is not installed"),
]
STEPS = 3


def _events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _watch_once(run_dir: str, out: str, *extra: str) -> list[dict]:
    command = [sys.executable, "-m", "fsdpfast", "watch", run_dir, "--out", out, "--once", "--json", *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return _events(done.stdout)


@pytest.fixture(scope="module")
def watched_to_s3(s3_server, tmp_path_factory):
    import uuid

    bucket = f"t-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    root = tmp_path_factory.mktemp("watch-s3")
    run_dir, log = run_folder(str(root), "accelerate"), root / "events.jsonl"
    os.makedirs(run_dir, exist_ok=True)
    out = f"s3://{bucket}/models/run"
    command = [sys.executable, "-m", "fsdpfast", "watch", run_dir, "--out", out, "--json", "--interval", "0.05"]
    watcher = subprocess.Popen(command + ["--config", run_dir], stdout=open(log, "w"), stderr=subprocess.PIPE)
    try:
        write_framework_run(str(root), "accelerate", STEPS)
        deadline = time.monotonic() + 600
        while len([e for e in _events(log.read_text()) if e["event"] in ("published", "refused", "failed")]) < STEPS:
            assert watcher.poll() is None, watcher.communicate()[1]
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
    finally:
        watcher.send_signal(signal.SIGTERM)
        _, err = watcher.communicate(timeout=600)
    assert watcher.returncode == 0, err
    names = [checkpoint_name("accelerate", step) for step in range(1, STEPS + 1)]
    return bucket, run_dir, out, names, _events(log.read_text())


def test_every_step_is_published_to_the_bucket_once_as_merge_writes_it(watched_to_s3, s3_server, tmp_path):
    bucket, run_dir, out, names, events = watched_to_s3
    assert events[0]["event"] == "watching" and events[0]["out_root"] == out
    assert [e["checkpoint"] for e in events if e["event"] == "published"] == names, events
    assert [e["out"] for e in events if e["event"] == "published"] == [f"{out}/{n}" for n in names]
    assert not [e for e in events if e["event"] in ("refused", "failed")], events
    client = s3_server.client()
    for name in names:
        fsdpfast.merge(os.path.join(run_dir, name), tmp_path / name, config=run_dir)
        local = {p: (tmp_path / name / p).read_bytes() for p in os.listdir(tmp_path / name) if p != MANIFEST_NAME}
        remote = objects(client, bucket, f"models/run/{name}/")
        assert sorted(remote) == sorted([*local, MANIFEST_NAME])
        assert any(p.endswith(".safetensors") for p in local)
        for file, data in local.items():
            assert remote[file] == data, (name, file)
        assert json.loads(remote[MANIFEST_NAME])["checkpoint"] == os.path.abspath(os.path.join(run_dir, name))


def test_a_restarted_watcher_finds_them_published_and_keep_last_removes_only_fsdpfasts_objects(
    watched_to_s3, s3_server
):
    bucket, run_dir, out, names, _ = watched_to_s3
    client = s3_server.client()
    events = _watch_once(run_dir, out, "--config", run_dir)
    assert [e["checkpoint"] for e in events if e["event"] == "skipped"] == names, events
    assert not [e for e in events if e["event"] in ("found", "started", "published")], events
    # a pipeline's eval result inside the oldest output, and a model of the user's beside the outputs
    client.put_object(Bucket=bucket, Key=f"models/run/{names[0]}/eval.json", Body=b"{}")
    client.put_object(Bucket=bucket, Key="models/run/best/model.safetensors", Body=b"mine")
    client.put_object(Bucket=bucket, Key=f"models/run/{names[1]}/", Body=b"")  # a console's folder: no one's file
    before = objects(client, bucket, "models/run/")
    events = _watch_once(run_dir, out, "--config", run_dir, "--keep-last", "1")
    removed = [e for e in events if e["event"] == "removed"]
    assert [(e["out"], e["kept"]) for e in removed] == [
        (f"{out}/{names[0]}", ["eval.json"]),
        (f"{out}/{names[1]}", []),
    ], events
    after = objects(client, bucket, "models/run/")
    newest = {k: v for k, v in before.items() if k.startswith(f"{names[-1]}/")}
    assert after == {
        **newest,
        f"{names[0]}/eval.json": b"{}",
        f"{names[1]}/": b"",
        "best/model.safetensors": b"mine",
    }
