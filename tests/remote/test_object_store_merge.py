"""Merges into and out of a real S3 server (moto, tests/remote/conftest.py): byte-identical to the local merge."""

from __future__ import annotations

import json
import os

import pytest
from conftest import objects, pending_uploads, upload_folder
from corpus import MERGE_OPTIONS, SPECS

import fsdpfast
from fsdpfast.manifest import MANIFEST_NAME

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


@pytest.mark.parametrize("name", sorted(SPECS, key=lambda n: (SPECS[n][0], n)))
def test_local_to_s3_is_the_local_merge(checkpoints, tmp_path, s3_server, bucket, name):
    _, folder = checkpoints.get(name)
    options = MERGE_OPTIONS.get(name, {})
    fsdpfast.merge(folder, tmp_path / "local", **options)
    fsdpfast.merge(folder, f"s3://{bucket}/merged/{name}", **options)
    client = s3_server.client()
    _assert_same_output(objects(client, bucket, f"merged/{name}"), _local_files(tmp_path / "local"))
    assert pending_uploads(client, bucket) == []
