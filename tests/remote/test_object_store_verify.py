"""`verify` of a merged folder in a real S3 server (moto): its manifest's checksums by streamed ranged
GETs; a changed or missing object fails it with the exit status and mismatch lines of a local verify."""

from __future__ import annotations

import json

import pytest
from s3_server import objects, upload_folder

import fsdpfast
from fsdpfast.cli import main
from fsdpfast.errors import EXIT_BAD_INPUT, EXIT_MISMATCH
from fsdpfast.manifest import MANIFEST_NAME
from fsdpfast.remote import metadata_mirror
from fsdpfast.verify import manifest_check

pytestmark = pytest.mark.slow
NAME = "w2-llama"


@pytest.fixture
def merged(checkpoints, s3_server, bucket, monkeypatch):
    """A merge in the store, several files; verify fetches no tensor byte into its stand-in and streams each
    tensor in 4 KB slices (many GETs per tensor, each with the next one fetched ahead)."""
    monkeypatch.setattr(metadata_mirror, "WHOLE_BYTES", 0)
    monkeypatch.setattr(manifest_check, "SLICE_BYTES", 4096)
    _, folder = checkpoints.get(NAME)
    fsdpfast.merge(folder, f"s3://{bucket}/out", max_shard_size="40KB")
    client = s3_server.client()
    manifest = json.loads(objects(client, bucket, "out")[MANIFEST_NAME])
    assert len(manifest["files"]) > 1
    return client, f"s3://{bucket}/out", manifest


def _mismatch_lines(capsys) -> tuple[list[str], str]:
    out = capsys.readouterr().out.splitlines()
    return [line for line in out if line.startswith("mismatch:")], out[-1]


def test_a_good_folder_in_the_store_verifies(merged, capsys):
    _, url, manifest = merged
    assert main(["verify", url]) == 0
    lines, last = _mismatch_lines(capsys)
    assert lines == [] and last.startswith(f"verify {url}: OK: {len(manifest['tensors'])} tensors")


def test_a_flipped_byte_in_one_object_fails_verify(merged, bucket, capsys):
    client, url, manifest = merged
    name, entry = max(manifest["tensors"].items(), key=lambda item: item[1]["nbytes"])  # spans many slices
    key = f"out/{entry['file']}"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[entry["offset"] + entry["nbytes"] - 3] ^= 0x10  # in its last slice
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    assert main(["verify", url]) == EXIT_MISMATCH
    lines, last = _mismatch_lines(capsys)
    assert len(lines) == 1 and name in lines[0] and "crc32c" in lines[0], lines
    assert last.startswith(f"verify {url}: FAILED, 1 mismatch:")


def test_a_missing_object_fails_verify(merged, bucket, capsys):
    client, url, manifest = merged
    file = sorted(manifest["files"])[0]
    lost = sorted(n for n, e in manifest["tensors"].items() if e["file"] == file)
    client.delete_object(Bucket=bucket, Key=f"out/{file}")
    assert main(["verify", url]) == EXIT_MISMATCH
    lines, last = _mismatch_lines(capsys)
    assert lines == [f"mismatch: {n}: in the manifest but not in the output" for n in lost]
    assert "FAILED" in last


def test_another_merges_manifest_and_refusals(merged, checkpoints, tmp_path, capsys):
    _, url, _ = merged
    _, folder = checkpoints.get(NAME)
    fsdpfast.merge(folder, tmp_path / "local")  # one file: the checksums still match tensor by tensor
    assert main(["verify", url, "--manifest", str(tmp_path / "local")]) == 0
    capsys.readouterr()
    for asked in (["--reference", str(tmp_path / "local")], ["--against", folder]):
        assert main(["verify", url, *asked]) == EXIT_BAD_INPUT
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fsdpfast: error:")]
        assert len(errors) == 1 and "local disk" in errors[0], errors


def test_a_remote_merge_records_each_source_objects_etag(checkpoints, s3_server, bucket, capsys):
    """A later verify tells a replaced source object by its ETag (the stand-in's file times mean nothing)."""
    _, folder = checkpoints.get(NAME)
    client = s3_server.client()
    upload_folder(client, folder, bucket, "run")
    fsdpfast.merge(f"s3://{bucket}/run", f"s3://{bucket}/out")
    sources = json.loads(objects(client, bucket, "out")[MANIFEST_NAME])["sources"]
    assert sources and all(s["mtime_ns"] == 0 for s in sources)
    for source in sources:
        assert source["etag"] == client.head_object(Bucket=bucket, Key=f"run/{source['path']}")["ETag"]
    assert main(["verify", f"s3://{bucket}/out"]) == 0
    assert "changed since the merge" not in capsys.readouterr().out
    replaced = sources[0]["path"]
    body = client.get_object(Bucket=bucket, Key=f"run/{replaced}")["Body"].read()
    client.put_object(Bucket=bucket, Key=f"run/{replaced}", Body=body[:-1] + bytes([body[-1] ^ 1]))  # same size
    assert main(["verify", f"s3://{bucket}/out"]) == 0  # the output is still its manifest's: a note, as locally
    notes = [line for line in capsys.readouterr().out.splitlines() if "changed since the merge" in line]
    assert len(notes) == 1 and f"{replaced}: replaced since (ETag" in notes[0], notes


@pytest.mark.parametrize("name", ["w2-llama", "w2-dcp"])
def test_verify_against_shards_in_the_store(checkpoints, s3_server, bucket, tmp_path, capsys, monkeypatch, name):
    """Every tensor recomputed from the shards in the store (their bytes by ranged GETs, none in the stand-in)."""
    monkeypatch.setattr(metadata_mirror, "WHOLE_BYTES", 0)
    _, folder = checkpoints.get(name)
    upload_folder(s3_server.client(), folder, bucket, "run")
    fsdpfast.merge(folder, tmp_path / "out")
    assert main(["verify", str(tmp_path / "out"), "--against", f"s3://{bucket}/run"]) == 0
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    target, entry = max(manifest["tensors"].items(), key=lambda item: item[1]["nbytes"])
    path = tmp_path / "out" / entry["file"]
    data = bytearray(path.read_bytes())
    data[entry["offset"] + 8] ^= 1
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "out"), "--against", f"s3://{bucket}/run"]) == EXIT_MISMATCH
    lines, _ = _mismatch_lines(capsys)
    assert len(lines) == 1 and target in lines[0] and "byte 8)" in lines[0], lines
