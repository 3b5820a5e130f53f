"""`fsdpfast watch s3://BUCKET/RUN --out ...`: a run folder that is itself in an object store, against
the S3 server (tests/remote/conftest.py), polled while the run's steps arrive there.

- A gloo FSDP2 job saves three DCP steps straight into the bucket with torch's own FsspecWriter
  (fsdpfast._testing.watch_job, `store=`): `.distcp` objects, then `.metadata.tmp` renamed, as a
  copy and a delete, to `.metadata`. Published to a local OUT_ROOT.
- verl's step folders, written by a gloo FSDP2 job on disk, uploaded to the bucket file by file,
  step by step, the tracker latest_checkpointed_iteration.txt after each step's files (as a run
  synced to a store must be). Published to the bucket.
Each step is published once, bit for bit the live model; beside the watcher this process asks
watch.discover which checkpoints are complete as fast as it can, and each time one is called
complete its objects must already be the final ones (and each was seen while incomplete). A
restarted watcher finds them published; --keep-last removes the older outputs. A tracker naming a
step whose rank files are not all uploaded yet (a sync tool's order) is refused, nothing published,
and published once the last file arrives.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from helpers import assert_bit_exact, load_reference, read_merged
from s3_server import objects

import fsdpfast
from fsdpfast._testing.watch_job import RunSpec, write_run
from fsdpfast.manifest import MANIFEST_NAME
from fsdpfast.watch.discover import complete_checkpoints
from fsdpfast.watch.run_listing import run_listing

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
STEPS = 3
TRACKER = "latest_checkpointed_iteration.txt"
_PATIENCE_S = 600


class StoreObserver(threading.Thread):
    """Lists the store run's complete checkpoints in a loop: for each, the objects (key, size) it had
    every time it was called complete; and how often a checkpoint's prefix was there but not complete."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop = url, threading.Event()
        self.seen: dict[str, set] = {}
        self.incomplete: dict[str, int] = {}
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                there = run_listing(self.url).folders()  # listed first: one not complete after is incomplete now
                complete = complete_checkpoints(self.url)
            except Exception as exc:  # noqa: BLE001 - said by the test, which fails on any
                self.errors.append(repr(exc))
                continue
            for checkpoint in complete:
                listed = tuple((key, size) for key, size, _ in checkpoint.signature())
                self.seen.setdefault(checkpoint.name, set()).add(listed)
            for name in set(there) - {c.name for c in complete}:
                self.incomplete[name] = self.incomplete.get(name, 0) + 1
            time.sleep(0.01)


def _events(path) -> list[dict]:
    text = path.read_text() if os.path.exists(path) else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _watch_once(run: str, out: str, *extra: str) -> tuple[int, list[dict]]:
    command = [sys.executable, "-m", "fsdpfast", "watch", run, "--out", out, "--once", "--json", *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=_PATIENCE_S)
    assert done.returncode in (0, 2), done.stdout + done.stderr
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def _of(events: list[dict], kind: str) -> list[str]:
    return [e["checkpoint"] for e in events if e["event"] == kind]


def _watched(run: str, out: str, log, write) -> list[dict]:
    """Start a watcher of `run` polling every 50 ms and an observer, `write()` the steps, wait until
    each of STEPS checkpoints is said published, refused or failed; stop both (the watcher exits 0)."""
    command = [sys.executable, "-m", "fsdpfast", "watch", run, "--out", out, "--json", "--interval", "0.05"]
    watcher = subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.PIPE, text=True)
    observer = StoreObserver(run)
    observer.start()
    try:
        write()
        deadline = time.monotonic() + _PATIENCE_S
        while len([e for e in _events(log) if e["event"] in ("published", "refused", "failed")]) < STEPS:
            assert watcher.poll() is None, watcher.communicate()[1]
            assert time.monotonic() < deadline, _events(log)
            time.sleep(0.05)
    finally:
        observer.stop.set()
        observer.join()
        watcher.send_signal(signal.SIGTERM)
        _, err = watcher.communicate(timeout=_PATIENCE_S)
    assert watcher.returncode == 0, err
    return _events(log), observer


def _assert_observed_only_final(observer: StoreObserver, client, bucket: str, prefix: str, names: list[str]) -> None:
    assert not observer.errors, observer.errors[:3]
    assert sorted(observer.seen) == names, observer.seen.keys()
    for name in names:
        listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{name}/")["Contents"]
        final = tuple(sorted((o["Key"][len(prefix) + len(name) + 2 :], o["Size"]) for o in listed))
        assert observer.seen[name] == {final}, (name, observer.seen[name] - {final})
        assert observer.incomplete.get(name, 0) > 0, observer.incomplete  # looked at midway


@pytest.fixture(scope="module")
def dcp_run_in_store(s3_server, tmp_path_factory):
    """torch's FsspecWriter saving each step into the bucket while the watcher publishes to a local folder."""
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    root = tmp_path_factory.mktemp("dcp-in-store")
    run, out = f"s3://{bucket}/run", root / "out"
    spec = RunSpec("torchtitan", steps=STEPS, store=run)
    events, observer = _watched(run, str(out), root / "events.jsonl", lambda: write_run(str(root), spec, 2))
    return bucket, root, run, out, [spec.checkpoint(s) for s in range(1, STEPS + 1)], events, observer


def test_dcp_steps_saved_into_the_store_are_published_once_bit_for_bit(dcp_run_in_store):
    _, root, run, out, names, events, _ = dcp_run_in_store
    assert events[0]["event"] == "watching" and events[0]["run_dir"] == run, events[0]
    assert _of(events, "published") == names, events  # once each, in step order
    assert not [e for e in events if e["event"] in ("refused", "failed")], events
    assert {e["framework"] for e in events if e["event"] == "found"} == {"torchtitan"}
    assert [e["path"] for e in events if e["event"] == "found"] == [f"{run}/{n}" for n in names]
    for name in names:
        reference, tied = load_reference(str(root / "refs" / f"{name}.pt"))
        assert_bit_exact(read_merged(str(out / name)), reference, tied=tied)
        assert json.loads((out / name / MANIFEST_NAME).read_text())["checkpoint"] == f"{run}/{name}"


def test_a_dcp_step_is_complete_only_once_its_metadata_is_renamed_into_place(dcp_run_in_store, s3_server):
    bucket, _, _, _, names, _, observer = dcp_run_in_store
    _assert_observed_only_final(observer, s3_server.client(), bucket, "run", names)


def test_a_restarted_watcher_of_a_store_run_skips_what_is_published_and_keep_last_removes(dcp_run_in_store):
    _, _, run, out, names, _, _ = dcp_run_in_store
    status, events = _watch_once(run, str(out))
    assert status == 0 and _of(events, "skipped") == names, events
    assert not [e for e in events if e["event"] in ("found", "started", "published")], events
    status, events = _watch_once(run, str(out), "--keep-last", "1")
    assert status == 0 and [e["out"] for e in events if e["event"] == "removed"] == [
        str(out / n) for n in names[:-1]
    ], events
    assert sorted(p for p in os.listdir(out) if not p.startswith(".")) == names[-1:]


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory):
    """verl's step folders on disk (a gloo FSDP2 job): what is uploaded to the store below."""
    root = tmp_path_factory.mktemp("verl-on-disk")
    spec = RunSpec("verl", steps=STEPS)
    write_run(str(root), spec, 2)
    return root, [spec.checkpoint(s) for s in range(1, STEPS + 1)]


def _upload_step(client, bucket: str, prefix: str, step_dir, pause: float = 0.05, leave_out=()) -> None:
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file()):
        relative = path.relative_to(step_dir.parent).as_posix()
        if relative in leave_out:
            continue
        client.upload_file(str(path), bucket, f"{prefix}/{relative}")
        time.sleep(pause)


@pytest.fixture(scope="module")
def verl_run_uploaded(verl_run, s3_server, tmp_path_factory):
    """verl's steps uploaded file by file, the tracker after each step, while the watcher publishes into the bucket."""
    root, names = verl_run
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    client = s3_server.client()
    client.create_bucket(Bucket=bucket)
    run, out = f"s3://{bucket}/run", f"s3://{bucket}/models"

    def upload() -> None:
        for step, name in enumerate(names, 1):
            _upload_step(client, bucket, "run", root / "run" / name)
            client.put_object(Bucket=bucket, Key=f"run/{TRACKER}", Body=str(step).encode())
            time.sleep(0.2)

    events, observer = _watched(run, out, tmp_path_factory.mktemp("verl-log") / "events.jsonl", upload)
    return root, bucket, run, out, names, events, observer


def test_verl_steps_uploaded_tracker_last_are_published_once_as_merge_writes_them(
    verl_run_uploaded, s3_server, tmp_path
):
    root, bucket, run, out, names, events, _ = verl_run_uploaded
    assert _of(events, "published") == names, events
    assert not [e for e in events if e["event"] in ("refused", "failed")], events
    assert {e["framework"] for e in events if e["event"] == "found"} == {"verl"}
    client = s3_server.client()
    for name in names:
        fsdpfast.merge(root / "run" / name, tmp_path / name)  # the same step, merged from the disk
        local = {p: (tmp_path / name / p).read_bytes() for p in os.listdir(tmp_path / name) if p != MANIFEST_NAME}
        remote = objects(client, bucket, f"models/{name}/")
        assert sorted(remote) == sorted([*local, MANIFEST_NAME]) and any(p.endswith(".safetensors") for p in local)
        for file, data in local.items():
            assert remote[file] == data, (name, file)
        assert json.loads(remote[MANIFEST_NAME])["checkpoint"] == f"{run}/{name}"
        reference, tied = load_reference(str(root / "refs" / f"{name}.pt"))
        assert_bit_exact(read_merged(str(tmp_path / name)), reference, tied=tied)


def test_a_verl_step_is_complete_only_once_the_tracker_names_it(verl_run_uploaded, s3_server):
    _, bucket, run, out, names, _, observer = verl_run_uploaded
    _assert_observed_only_final(observer, s3_server.client(), bucket, "run", names)
    status, events = _watch_once(run, out)  # restarted: everything published already
    assert status == 0 and _of(events, "skipped") == names, events


def test_a_published_step_whose_object_is_replaced_is_merged_again(verl_run_uploaded, s3_server):
    """The output's manifest pins each source object's ETag: a rank file replaced since (same size, other
    bytes) makes the step unpublished, and a watcher with --overwrite merges it again, from the new bytes."""
    from fsdpfast.watch.published import manifest_of, published

    root, bucket, run, out, names, _, _ = verl_run_uploaded
    step, dtype = names[0], manifest_of(f"{out}/{names[0]}")["dtype"]
    assert published(f"{out}/{step}", f"{run}/{step}", dtype)
    rank0 = f"{step}/actor/model_world_size_2_rank_0.pt"
    with open(root / "run" / names[1] / "actor" / "model_world_size_2_rank_0.pt", "rb") as f:
        later = f.read()  # the next step's rank file: the same size, other weights
    assert len(later) == (root / "run" / rank0).stat().st_size
    s3_server.client().put_object(Bucket=bucket, Key=f"run/{rank0}", Body=later)
    assert not published(f"{out}/{step}", f"{run}/{step}", dtype)
    status, events = _watch_once(run, out, "--overwrite")
    assert status == 0 and _of(events, "published") == [step] and _of(events, "skipped") == names[1:], events
    merged = objects(s3_server.client(), bucket, f"models/{step}/")
    assert json.loads(merged[MANIFEST_NAME])["checkpoint"] == f"{run}/{step}"


def test_a_tracker_uploaded_before_the_step_it_names_is_refused_then_published(verl_run, s3_server, tmp_path):
    """A sync tool's order: the tracker and rank 0's file of global_step_1 are there, rank 1's is not.
    The merge refuses the incomplete step (exit 2, nothing published); once the file arrives, it is published."""
    root, names = verl_run
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    client = s3_server.client()
    client.create_bucket(Bucket=bucket)
    missing = f"{names[0]}/actor/model_world_size_2_rank_1.pt"
    _upload_step(client, bucket, "run", root / "run" / names[0], pause=0, leave_out={missing})
    client.put_object(Bucket=bucket, Key=f"run/{TRACKER}", Body=b"1")
    out = tmp_path / "out"
    status, events = _watch_once(f"s3://{bucket}/run", str(out))
    assert status == 2 and _of(events, "refused") == names[:1], events
    (refused,) = [e for e in events if e["event"] == "refused"]
    assert refused["reason"].startswith(f"s3://{bucket}/run/{missing} is missing"), refused  # the store's name
    assert not out.exists() or not os.listdir(out)
    client.upload_file(str(root / "run" / missing), bucket, f"run/{missing}")
    status, events = _watch_once(f"s3://{bucket}/run", str(out))
    assert status == 0 and _of(events, "published") == names[:1], events
    reference, tied = load_reference(str(root / "refs" / f"{names[0]}.pt"))
    assert_bit_exact(read_merged(str(out / names[0])), reference, tied=tied)
