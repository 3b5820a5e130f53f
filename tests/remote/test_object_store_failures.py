"""Merges through a real S3 server that fail: refused outputs, a failing upload, a source deleted
mid-merge, no client installed. Nothing loadable is left, no multipart upload pending, and the
command line says why in one line with a non-zero status, as locally."""

from __future__ import annotations

import sys
import uuid
from datetime import timedelta

import pytest
from s3_server import S3Server, objects, pending_uploads, upload_folder
from tcp_proxy import TcpProxy

import fsdpfast
from fsdpfast.cli import main
from fsdpfast.manifest import MANIFEST_NAME
from fsdpfast.remote import metadata_mirror, object_target, stores
from fsdpfast.remote.object_target import ObjectFile
from fsdpfast.remote.range_sources import RangeSources

pytestmark = pytest.mark.slow
NAME = "w2-llama"


def _error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fsdpfast: error:")]
    assert len(lines) == 1, lines
    return lines[0]


def test_an_existing_prefix_is_refused_without_overwrite(checkpoints, s3_server, bucket, capsys):
    _, folder = checkpoints.get(NAME)
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="out/notes.txt", Body=b"mine")
    assert main(["merge", folder, "--out", f"s3://{bucket}/out"]) != 0
    assert "--overwrite" in _error_line(capsys)
    assert objects(client, bucket, "out") == {"notes.txt": b"mine"}


def test_overwrite_replaces_only_what_fsdpfast_wrote(checkpoints, s3_server, bucket, capsys):
    _, folder = checkpoints.get(NAME)
    client = s3_server.client()
    fsdpfast.merge(folder, f"s3://{bucket}/out")
    first = objects(client, bucket, "out")
    assert main(["merge", folder, "--out", f"s3://{bucket}/out", "--overwrite"]) == 0
    assert sorted(objects(client, bucket, "out")) == sorted(first)
    client.put_object(Bucket=bucket, Key="out/notes.txt", Body=b"mine")
    assert main(["merge", folder, "--out", f"s3://{bucket}/out", "--overwrite"]) != 0
    assert "notes.txt" in _error_line(capsys)
    assert sorted(objects(client, bucket, "out")) == sorted([*first, "notes.txt"])


def test_a_failing_part_leaves_nothing(checkpoints, s3_server, bucket, capsys, monkeypatch):
    _, folder = checkpoints.get(NAME)
    client = s3_server.client()
    calls = []
    original = ObjectFile.write_owned

    def failing(self, data, offset):
        calls.append(offset)
        if offset > 0:  # the first tensor bytes, after the header
            raise OSError(5, "Input/output error")
        return original(self, data, offset)

    monkeypatch.setattr(ObjectFile, "write_owned", failing)  # every byte streamed passes here
    assert main(["merge", folder, "--out", f"s3://{bucket}/out"]) != 0
    assert "nothing was published" in _error_line(capsys)
    assert objects(client, bucket, "out") == {}
    assert pending_uploads(client, bucket) == []


def test_a_source_deleted_mid_merge_fails_it(checkpoints, s3_server, bucket, capsys, monkeypatch):
    _, folder = checkpoints.get(NAME)
    client = s3_server.client()
    upload_folder(client, folder, bucket, "run")
    monkeypatch.setattr(metadata_mirror, "WHOLE_BYTES", 0)
    original = RangeSources._read_span
    deleted = []

    def deleting(self, url, first, last, members):
        if not deleted:
            key = url.split(f"s3://{bucket}/", 1)[1]
            client.delete_object(Bucket=bucket, Key=key)
            deleted.append(key)
        return original(self, url, first, last, members)

    monkeypatch.setattr(RangeSources, "_read_span", deleting)
    assert main(["merge", f"s3://{bucket}/run", "--out", f"s3://{bucket}/out"]) != 0
    line = _error_line(capsys)
    assert any(key in line for key in deleted) and "during the merge" in line  # (reads race: perhaps two deleted)
    assert objects(client, bucket, "out") == {}
    assert pending_uploads(client, bucket) == []


def test_without_the_client_a_store_url_is_refused_in_one_line(checkpoints, tmp_path, capsys, monkeypatch):
    _, folder = checkpoints.get(NAME)
    monkeypatch.setitem(sys.modules, "obstore", None)  # as if not installed
    assert main(["merge", folder, "--out", "s3://bucket/out"]) != 0
    assert 'pip install "fsdpfast[s3]"' in _error_line(capsys)
    assert main(["merge", "s3://bucket/run", "--out", str(tmp_path / "out")]) != 0
    assert 'pip install "fsdpfast[s3]"' in _error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_the_manifest_is_written_last(checkpoints, s3_server, bucket):
    """A reader polling the prefix finds config.json and the manifest only after every weights file."""
    _, folder = checkpoints.get(NAME)
    client = s3_server.client()
    fsdpfast.merge(folder, f"s3://{bucket}/out")
    listed = client.list_objects_v2(Bucket=bucket, Prefix="out/")["Contents"]
    when = {item["Key"].split("/", 1)[1]: item["LastModified"] for item in listed}
    weights = [when[n] for n in when if n.endswith(".safetensors")]
    assert max(weights) <= when["config.json"] <= when[MANIFEST_NAME]


# --- the server failing under the merge: a TCP proxy in front of a server of its own ------------------
QUICK_RETRIES = {
    "max_retries": 2,
    "retry_timeout": timedelta(seconds=5),
    "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(milliseconds=200), "base": 2},
}
PART = 8192  # parts this small (moto's minimum lowered to match) make the tiny weights files multipart uploads


@pytest.fixture
def proxied(monkeypatch):
    """(the server's boto3 client, the proxy, a bucket): the merge talks to the proxy, the test to the server.
    The server keeps its state while the proxy is stopped: what a merge leaves is there to see after."""
    server = S3Server(S3_UPLOAD_PART_MIN_SIZE=str(PART // 2))
    server.start()
    proxy = TcpProxy(server.port).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    for key, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(stores, "RETRIES", QUICK_RETRIES)
    monkeypatch.setattr(object_target, "PART_BYTES", PART)
    client = server.client()
    bucket = f"proxied-{uuid.uuid4().hex[:8]}"  # a store of its own (stores are kept by bucket)
    client.create_bucket(Bucket=bucket)
    yield client, proxy, bucket
    proxy.stop()
    server.stop()


def _stop_after_parts(monkeypatch, proxy, outage=None, parts: int = 3) -> None:
    """The server stops answering once `parts` parts of the first weights file have been streamed: for good
    (`outage` None), or until the request holding `outage` has been refused (TcpProxy.outage)."""
    original = ObjectFile.write_owned
    stopped = []

    def writing(self, data, offset):
        original(self, data, offset)
        if self._next > parts * PART and not stopped:
            stopped.append(offset)
            proxy.stop() if outage is None else proxy.outage(outage)

    monkeypatch.setattr(ObjectFile, "write_owned", writing)


def test_a_dropped_part_upload_is_retried(checkpoints, tmp_path, proxied):
    client, proxy, bucket = proxied
    _, folder = checkpoints.get(NAME)
    proxy.drop(b"partNumber=", 2)
    assert main(["merge", folder, "--out", f"s3://{bucket}/out"]) == 0
    assert proxy.dropped == 2
    fsdpfast.merge(folder, tmp_path / "local")
    merged = objects(client, bucket, "out")
    for name in merged:
        if name != MANIFEST_NAME:
            assert merged[name] == (tmp_path / "local" / name).read_bytes(), name
    assert pending_uploads(client, bucket) == []


def test_a_part_failing_every_try_leaves_nothing(checkpoints, proxied, capsys):
    client, proxy, bucket = proxied
    _, folder = checkpoints.get(NAME)
    proxy.drop(b"partNumber=", 10_000)
    assert main(["merge", folder, "--out", f"s3://{bucket}/out"]) != 0
    line = _error_line(capsys)
    assert "model.safetensors: the upload failed" in line and "nothing was published" in line, line
    assert objects(client, bucket, "out") == {}
    assert pending_uploads(client, bucket) == []


def test_the_server_down_mid_upload_and_back_for_the_clean_up(checkpoints, proxied, capsys, monkeypatch):
    client, proxy, bucket = proxied
    _, folder = checkpoints.get(NAME)
    _stop_after_parts(monkeypatch, proxy, outage=b"DELETE /")  # back when the client first tries to abort
    assert main(["merge", folder, "--out", f"s3://{bucket}/out"]) != 0
    assert "the upload failed" in _error_line(capsys)
    assert objects(client, bucket, "out") == {}
    assert pending_uploads(client, bucket) == []


def test_the_server_never_back_leaves_nothing_loadable_and_says_what_is_left(checkpoints, proxied, capsys, monkeypatch):
    client, proxy, bucket = proxied
    _, folder = checkpoints.get(NAME)
    _stop_after_parts(monkeypatch, proxy)
    assert main(["merge", folder, "--out", f"s3://{bucket}/out"]) != 0
    err = capsys.readouterr().err.splitlines()
    assert len([line for line in err if line.startswith("fsdpfast: error:")]) == 1, err
    warned = [line for line in err if "did not answer the clean-up" in line]
    assert len(warned) == 1 and "1 pending multipart uploads (model.safetensors)" in warned[0], err
    left = objects(client, bucket, "out")  # the server's state, seen past the stopped proxy
    assert "config.json" not in left and MANIFEST_NAME not in left
    assert [u["Key"] for u in pending_uploads(client, bucket)] == ["out/model.safetensors"]
