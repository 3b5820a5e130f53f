"""Merges through a real S3 server that fail: refused outputs, a failing upload, a source deleted
mid-merge, no client installed. Nothing loadable is left, no multipart upload pending, and the
command line says why in one line with a non-zero status, as locally."""

from __future__ import annotations

import sys

import pytest
from s3_server import objects, pending_uploads, upload_folder

import fsdpfast
from fsdpfast.cli import main
from fsdpfast.manifest import MANIFEST_NAME
from fsdpfast.remote import metadata_mirror
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
    original = ObjectFile.write_at

    def failing(self, data, offset):
        calls.append(offset)
        if offset > 0:  # the first tensor bytes, after the header
            raise OSError(5, "Input/output error")
        return original(self, data, offset)

    monkeypatch.setattr(ObjectFile, "write_at", failing)
    assert main(["merge", folder, "--out", f"s3://{bucket}/out"]) != 0
    assert "nothing was published" in _error_line(capsys)
    assert objects(client, bucket, "out") == {}
    assert pending_uploads(client, bucket) == []


def test_a_source_deleted_mid_merge_fails_it(checkpoints, s3_server, bucket, capsys, monkeypatch):
    _, folder = checkpoints.get(NAME)
    client = s3_server.client()
    upload_folder(client, folder, bucket, "run")
    monkeypatch.setattr(metadata_mirror, "WHOLE_BYTES", 0)
    original = RangeSources._read
    deleted = []

    def deleting(self, index, memory, start, end):
        if not deleted:
            key = self.buffers[index].path.split(f"s3://{bucket}/", 1)[1]
            client.delete_object(Bucket=bucket, Key=key)
            deleted.append(key)
        return original(self, index, memory, start, end)

    monkeypatch.setattr(RangeSources, "_read", deleting)
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
