"""A merge into a real S3 server (moto, tests/remote/conftest.py) by several processes: torchrun's, or
`fsdpfast merge` processes told their ranks as torchrun tells them (tests/support/merge_processes.py).
Each process uploads whole files of its own (balanced by bytes), rank 0 publishes: the objects are the
local merge's byte for byte, the manifest's checksums theirs, and `verify` passes. A rank whose part
uploads fail, or one killed outright after it completed an upload, leaves nothing under the prefix and
no pending upload, each rank saying why in one line; `watch --nproc-per-merge 2` publishes to the bucket.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from merge_processes import Ranks
from refusals import run_cli_here
from s3_server import objects, pending_uploads, upload_folder
from tcp_proxy import TcpProxy
from test_object_store_merge import _assert_same_output, _local_files

import fsdpfast
from fsdpfast.cli import main
from fsdpfast.execute.parts import share_whole_files
from fsdpfast.plan.layout import plan_files

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
NAME = "w2-llama"
SHARD = "40KB"  # several files for the tiny model: each process has some to upload


def _torchrun_merge(src: str, out: str, *options: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "fsdpfast", "merge", src, "--out", out, "--json", "--quiet", "-v", *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def _bytes_written_by_rank(stderr: str) -> dict[int, int]:
    return {int(rank): int(n) for rank, n in re.findall(r"rank (\d+) wrote (\d+) bytes", stderr)}


def _error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("fsdpfast: error:")]


@pytest.mark.parametrize("direction", ["local-to-s3", "s3-to-s3"])
def test_torchrun_merges_into_the_store_as_one_process_merges_locally(
    checkpoints, tmp_path, s3_server, bucket, direction
):
    _, folder = checkpoints.get(NAME)
    client = s3_server.client()
    files = plan_files(fsdpfast.plan_merge(folder), SHARD)
    assert all(share_whole_files(files, 2)), "each process has files to upload"  # the case this test is for
    fsdpfast.merge(folder, tmp_path / "local", max_shard_size=SHARD)
    source = folder
    if direction == "s3-to-s3":
        upload_folder(client, folder, bucket, "run")
        source = f"s3://{bucket}/run"

    done = _torchrun_merge(source, f"s3://{bucket}/merged", "--max-shard-size", SHARD)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["processes"] == 2  # one report, rank 0's
    written = _bytes_written_by_rank(done.stderr)
    assert sorted(written) == [0, 1] and all(written.values()), done.stderr  # both uploaded
    merged = objects(client, bucket, "merged")
    _assert_same_output(merged, _local_files(tmp_path / "local"))  # the manifest's checksums among them
    assert pending_uploads(client, bucket) == []
    assert main(["verify", f"s3://{bucket}/merged"]) == 0


def test_processes_uploading_the_same_prefix_refuse_another_prefix_on_a_rank(checkpoints, s3_server, bucket):
    _, folder = checkpoints.get(NAME)

    def argv(rank):
        out = f"s3://{bucket}/{'elsewhere' if rank == 1 else 'out'}"
        return [folder, "--out", out, "--max-shard-size", SHARD, "--timeout", 60]

    results = Ranks(argv, 2).wait()
    assert [status for status, *_ in results] == [2, 2], results
    (own,) = _error_lines(results[1][2])
    (told,) = _error_lines(results[0][2])
    assert own.startswith("fsdpfast: error: rank 1: ") and "every rank's --out must be the same prefix" in own
    assert told.startswith("fsdpfast: error: rank 1 failed: ") and "nothing was published" in told
    assert objects(s3_server.client(), bucket) == {}


# rank 1's part uploads go through a proxy that resets every one of them: its uploads fail mid-way
# (parts of 8 KB, so the tiny files are multipart uploads with parts sent before they fail)
PARTS_FAIL = r"""
import os, sys
from datetime import timedelta
os.environ["AWS_ENDPOINT_URL"] = {proxy!r}
from fsdpfast.remote import object_target, stores
object_target.PART_BYTES = 8192
stores.RETRIES = {{"max_retries": 2, "retry_timeout": timedelta(seconds=5),
    "backoff": {{"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(milliseconds=200), "base": 2}}}}
from fsdpfast.cli import main
sys.exit(main(sys.argv[1:]))
"""

# rank 1 dies by SIGKILL as soon as one of its uploads is complete (a node lost): rank 0 deletes that object
DIES_AFTER_AN_UPLOAD = r"""
import os, signal, sys
from fsdpfast.remote.object_target import ObjectTarget
original = ObjectTarget.put_done
def put_then_die(self, name, size):
    original(self, name, size)
    os.kill(os.getpid(), signal.SIGKILL)
ObjectTarget.put_done = put_then_die
from fsdpfast.cli import main
sys.exit(main(sys.argv[1:]))
"""


# Ctrl-C on rank 1 once parts of its first upload are sent (8 KB parts: the tiny files are multipart uploads)
INTERRUPTED_MID_UPLOAD = r"""
import signal, sys
from fsdpfast.remote import object_target
object_target.PART_BYTES = 8192
original = object_target.ObjectFile.write_owned  # what the engines' window streams through
def write_then_interrupt(self, data, offset):
    original(self, data, offset)
    if self._next > 3 * 8192:
        signal.raise_signal(signal.SIGINT)
object_target.ObjectFile.write_owned = write_then_interrupt
from fsdpfast.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def proxy(s3_server):
    proxy = TcpProxy(s3_server.port).start()
    yield proxy
    proxy.stop()


def _two_ranks(checkpoints, s3_server, bucket, script: str):
    """(the server's client, each rank's results) of a merge into the bucket by two processes, rank 1 running `script`."""
    _, folder = checkpoints.get(NAME)
    out = f"s3://{bucket}/out"
    argv = [folder, "--out", out, "--max-shard-size", SHARD, "--timeout", 60]
    return s3_server.client(), Ranks(lambda rank: argv, 2, scripts={1: script}).wait()


def test_a_rank_whose_parts_fail_leaves_nothing(checkpoints, s3_server, bucket, proxy):
    proxy.drop(b"partNumber=", 10_000)
    client, results = _two_ranks(checkpoints, s3_server, bucket, PARTS_FAIL.format(proxy=proxy.url))
    assert [status for status, *_ in results] == [1, 1], results
    assert proxy.dropped > 0  # parts were sent, and failed
    (own,) = _error_lines(results[1][2])
    (told,) = _error_lines(results[0][2])
    assert "the upload failed after the client's retries" in own and own.endswith("nothing was published")
    assert told.startswith("fsdpfast: error: rank 1 failed: ") and "the upload failed" in told
    assert told.count("nothing was published") == 1
    assert objects(client, bucket) == {}  # rank 0's completed uploads deleted too
    assert pending_uploads(client, bucket) == []


def test_a_rank_killed_after_an_upload_leaves_nothing(checkpoints, s3_server, bucket):
    client, results = _two_ranks(checkpoints, s3_server, bucket, DIES_AFTER_AN_UPLOAD)
    assert results[1][0] < 0  # killed
    status, _, stderr, _ = results[0]
    assert status == 1
    (line,) = _error_lines(stderr)
    assert "lost touch" in line and "nothing was published" in line
    assert objects(client, bucket) == {}  # rank 1's completed object deleted by rank 0
    assert pending_uploads(client, bucket) == []


def test_ctrl_c_on_a_rank_mid_upload_leaves_nothing(checkpoints, s3_server, bucket):
    client, results = _two_ranks(checkpoints, s3_server, bucket, INTERRUPTED_MID_UPLOAD)
    assert results[1][0] == 130, results[1]
    assert "fsdpfast: interrupted; nothing was published" in results[1][2] and not _error_lines(results[1][2])
    assert results[0][0] == 1
    (line,) = _error_lines(results[0][2])
    assert "nothing was published" in line
    assert objects(client, bucket) == {}
    assert pending_uploads(client, bucket) == []


def test_watch_publishes_to_the_store_with_two_processes_per_merge(s3_server, bucket, tmp_path_factory, tmp_path):
    from fsdpfast._testing.watch_job import RunSpec, write_run

    root = tmp_path_factory.mktemp("verl-s3")
    write_run(str(root), RunSpec("verl", steps=2), 2)
    run = root / "run"
    out = f"s3://{bucket}/models"
    shard = ("--max-shard-size", SHARD)
    result = run_cli_here("watch", run, "--out", out, "--once", "--json", "--nproc-per-merge", "2", *shard)
    assert result.returncode == 0, result.stdout + result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    published = [e for e in events if e["event"] == "published"]
    assert [e["checkpoint"] for e in published] == ["global_step_1", "global_step_2"], events
    client = s3_server.client()
    for name in ("global_step_1", "global_step_2"):
        local = tmp_path / name
        assert run_cli_here("merge", run / name / "actor", "--out", local, *shard).returncode == 0
        merged = objects(client, bucket, f"models/{name}")
        assert len([n for n in merged if n.endswith(".safetensors")]) > 1
        _assert_same_output(merged, _local_files(local))
    assert pending_uploads(client, bucket) == []
    again = run_cli_here("watch", run, "--out", out, "--once", "--json", "--nproc-per-merge", "2", *shard)
    skipped = [e["checkpoint"] for e in map(json.loads, again.stdout.splitlines()) if e["event"] == "skipped"]
    assert skipped == ["global_step_1", "global_step_2"]


def test_watch_of_a_run_in_the_store_merges_with_two_processes_per_merge(s3_server, bucket, tmp_path_factory, tmp_path):
    from fsdpfast._testing.watch_job import RunSpec, write_run

    root = tmp_path_factory.mktemp("verl-run")
    write_run(str(root), RunSpec("verl", steps=2), 2)
    upload_folder(s3_server.client(), str(root / "run"), bucket, "run")
    shard = ("--max-shard-size", SHARD)
    watched = (f"s3://{bucket}/run", "--out", tmp_path / "models", "--once", "--json", "--nproc-per-merge", "2")
    result = run_cli_here("watch", *watched, *shard)
    assert result.returncode == 0, result.stdout + result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    published = [e for e in events if e["event"] == "published"]
    assert [e["checkpoint"] for e in published] == ["global_step_1", "global_step_2"], events
    for name in ("global_step_1", "global_step_2"):
        local = tmp_path / name
        assert run_cli_here("merge", root / "run" / name / "actor", "--out", local, *shard).returncode == 0
        _assert_same_output(_local_files(tmp_path / "models" / name), _local_files(local))
