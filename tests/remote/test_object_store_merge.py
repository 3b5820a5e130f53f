"""Merges into and out of a real S3 server (moto, tests/remote/conftest.py): byte-identical to the local merge."""

from __future__ import annotations

import json
import os

import pytest
from corpus import MERGE_OPTIONS, SPECS
from s3_server import objects, pending_uploads, upload_folder

import fsdpfast
from fsdpfast.manifest import MANIFEST_NAME
from fsdpfast.remote import metadata_mirror

pytestmark = pytest.mark.slow


def _local_files(folder) -> dict[str, bytes]:
    found = {}
    for root, _, files in os.walk(folder):
        for file in files:
            path = os.path.join(root, file)
            with open(path, "rb") as handle:
                found[os.path.relpath(path, folder)] = handle.read()
    return found


def _assert_same_output(remote: dict[str, bytes], local: dict[str, bytes]) -> None:
    assert sorted(remote) == sorted(local)
    for name in local:
        if name == MANIFEST_NAME:  # where and when differ; the checksums of every tensor may not
            mine, theirs = json.loads(remote[name]), json.loads(local[name])
            assert mine["tensors"] == theirs["tensors"] and mine["checksum"] == theirs["checksum"] == "crc32c"
            assert mine["files"] == theirs["files"]
            assert sorted(mine["written"]) == sorted(theirs["written"])
            continue
        assert remote[name] == local[name], name


NAMES = sorted(SPECS, key=lambda n: (SPECS[n][0], n))


@pytest.mark.parametrize("direction", ["local-to-s3", "s3-to-local", "s3-to-s3"])
@pytest.mark.parametrize("name", NAMES)
def test_merge_through_s3_is_the_local_merge(checkpoints, tmp_path, s3_server, bucket, name, direction, monkeypatch):
    """Only the metadata of the (tiny) shards is fetched for planning, as of a large checkpoint's: the
    tensor bytes come by ranged GETs, or the merge would hold zeros."""
    monkeypatch.setattr(metadata_mirror, "WHOLE_BYTES", 0)
    _, folder = checkpoints.get(name)
    options = MERGE_OPTIONS.get(name, {})
    client = s3_server.client()
    fsdpfast.merge(folder, tmp_path / "local", **options)
    if direction != "local-to-s3":
        upload_folder(client, folder, bucket, "run")
    source = folder if direction == "local-to-s3" else f"s3://{bucket}/run"
    if direction == "s3-to-local":
        report = fsdpfast.merge(source, tmp_path / "out", **options)
        assert "fsdpfast-remote-" not in repr(report)  # the stand-in folder is never named
        merged = _local_files(tmp_path / "out")
    else:
        fsdpfast.merge(source, f"s3://{bucket}/merged", **options)
        merged = objects(client, bucket, "merged")
    _assert_same_output(merged, _local_files(tmp_path / "local"))
    assert pending_uploads(client, bucket) == []


@pytest.mark.parametrize("name", ["w2-llama", "w2-dcp"])
def test_inspect_of_a_store_prefix_is_the_local_inspection(checkpoints, s3_server, bucket, name, monkeypatch):
    monkeypatch.setattr(metadata_mirror, "WHOLE_BYTES", 0)
    _, folder = checkpoints.get(name)
    upload_folder(s3_server.client(), folder, bucket, "run")
    remote, local = fsdpfast.inspect(f"s3://{bucket}/run"), fsdpfast.inspect(folder)
    assert "fsdpfast-remote-" not in json.dumps(remote)  # the stand-in folder is never named
    remote.pop("notes"), local.pop("notes")  # the model check: built once, then read from its cache
    assert json.dumps(remote).replace(f"s3://{bucket}/run", "SRC") == json.dumps(local).replace(folder, "SRC")


def test_folder_markers_in_the_store_are_not_files_of_the_checkpoint(checkpoints, tmp_path, s3_server, bucket):
    """Zero-byte keys ending in "/" (a console's "create folder", some sync tools) are no objects of the checkpoint:
    the merge is the local one (it failed naming its stand-in folder: "Is a directory")."""
    _, folder = checkpoints.get("w2-dcp")
    client = s3_server.client()
    upload_folder(client, folder, bucket, "run")
    for marker in ("run/", *(f"run/{d}/" for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))):
        client.put_object(Bucket=bucket, Key=marker, Body=b"")
    fsdpfast.merge(folder, tmp_path / "local")
    fsdpfast.merge(f"s3://{bucket}/run", tmp_path / "out")
    _assert_same_output(_local_files(tmp_path / "out"), _local_files(tmp_path / "local"))
