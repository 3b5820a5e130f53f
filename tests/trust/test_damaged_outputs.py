"""Damaged safetensors headers and manifests, in merged outputs of real FSDP2 checkpoints and in real
DCP / dcp-hf checkpoints: each is one line naming the file, never a traceback.

verify: a damaged output header or own manifest is a failed check (exit 3, one mismatch line); a
damaged --reference or --manifest file is bad input (exit 2, one line on stderr). Readers of
safetensors inputs refuse a header length over safetensors' 100 MB limit before reading it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import copy_checkpoint

import fsdpfast
from fsdpfast.errors import EXIT_BAD_INPUT, EXIT_MISMATCH, BadInput
from fsdpfast.manifest import MANIFEST_NAME

# Minutes of Python-only checks: CI runs them with the CPU torch, not again with the CUDA one (docs/development.md)
pytestmark = pytest.mark.slow

WEIGHT = "model.layers.0.self_attn.q_proj.weight"  # float32 (64, 64) in the tiny llama


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdpfast", *map(str, args)], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def merged(checkpoints, tmp_path_factory) -> tuple[str, Path]:
    """(checkpoint folder, a fresh merge of it) — tests damage copies of the merge."""
    _, folder = checkpoints.get("w2-llama")
    out = tmp_path_factory.mktemp("merged") / "out"
    fsdpfast.merge(folder, out)
    return folder, out


def damaged_copy(merged_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(merged_dir, out)
    return out


def rewrite_header(path: Path, edit) -> None:
    """Replace the JSON header of a safetensors file by edit(header) (a value or raw bytes); the data stays."""
    data = path.read_bytes()
    end = 8 + int.from_bytes(data[:8], "little")
    new = edit(json.loads(data[8:end]))
    raw = new if isinstance(new, bytes) else json.dumps(new).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[end:])


def with_entry(header: dict, **fields) -> dict:
    header[WEIGHT].update(fields)
    return header


def oversized_length(path: Path, length: int = 200 << 20) -> None:
    """A header length over the 100 MB limit, in a (sparse) file that is long enough to hold it."""
    with open(path, "r+b") as f:
        f.write(length.to_bytes(8, "little"))
    os.truncate(path, 8 + length + 64)


def assert_one_mismatch_line(result: subprocess.CompletedProcess, *mentions: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_MISMATCH, output
    assert result.stderr == "" and "Traceback" not in output, output
    lines = [line for line in result.stdout.splitlines() if line.startswith("mismatch:")]
    assert len(lines) == 1 and all(m in lines[0] for m in mentions), output
    assert "FAILED, 1 mismatch:" in result.stdout.splitlines()[-1]


def assert_bad_input_line(result: subprocess.CompletedProcess, *mentions: str) -> None:
    assert result.returncode == EXIT_BAD_INPUT, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and all(m in result.stderr for m in mentions), result.stderr


# --- damaged output headers --------------------------------------------------------------------

HEADERS = {
    "a JSON list": lambda h: [h[WEIGHT]],
    "string offsets": lambda h: with_entry(h, data_offsets=["0", 16384]),
    "shape not its bytes": lambda h: with_entry(h, shape=[100]),  # 400 bytes over a 16384-byte range
    "a negative dimension": lambda h: with_entry(h, shape=[-64, -64]),
    "an entry that is a string": lambda h: {**h, WEIGHT: "F32"},
    "not JSON": lambda h: b'{"a": ',
    "nested too deeply": lambda h: b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("damage", HEADERS)
def test_a_damaged_output_header_is_one_mismatch_line(merged, tmp_path, damage):
    folder, good = merged
    out = damaged_copy(good, tmp_path)
    rewrite_header(out / "model.safetensors", HEADERS[damage])
    # The headers are checked before any comparison (these two used to reach the kernels or compare wrong lengths).
    comparisons = (
        [["--against", folder], ["--reference", good]] if damage in ("string offsets", "shape not its bytes") else []
    )
    for options in [[], *comparisons]:
        assert_one_mismatch_line(run_cli("verify", out, *options), "model.safetensors")


def test_an_oversized_output_header_length_is_one_mismatch_line(merged, tmp_path):
    _, good = merged
    out = damaged_copy(good, tmp_path)
    oversized_length(out / "model.safetensors")
    assert_one_mismatch_line(run_cli("verify", out), "model.safetensors", "100 MB limit")


def test_a_damaged_reference_header_is_bad_input(merged, tmp_path):
    _, good = merged
    reference = damaged_copy(good, tmp_path)
    rewrite_header(reference / "model.safetensors", HEADERS["string offsets"])
    assert_bad_input_line(run_cli("verify", good, "--reference", reference), "model.safetensors", WEIGHT)


# --- damaged manifests ---------------------------------------------------------------------------

_DROP = object()


def _edit(*path, value=_DROP):
    """Set (or drop) the field at `path` in the manifest; "WEIGHT" stands for the q_proj weight's name."""

    def edit(manifest):
        keys = [WEIGHT if key == "WEIGHT" else key for key in path]
        node = manifest
        for key in keys[:-1]:
            node = node[key]
        if value is _DROP:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
        return manifest

    return edit


MANIFESTS = {
    "not JSON": lambda m: b'{"tensors": {',
    "nested too deeply": lambda m: b"[" * 100_000 + b"]" * 100_000,
    "a JSON list": lambda m: [m],
    "tensors is a list": _edit("tensors", value=[]),
    "an offset as a string": _edit("tensors", "WEIGHT", "offset", value="0"),
    "a checksum as a number": _edit("tensors", "WEIGHT", "crc32c", value=12345),
    "a checksum that is not hex": _edit("tensors", "WEIGHT", "crc32c", value="0000000g"),
    "an entry that is a string": _edit("tensors", "WEIGHT", value="model.safetensors"),
    "sources with a string size": lambda m: {**m, "sources": [{**m["sources"][0], "size": "1"}]},
    "no tensors": _edit("tensors"),
    "no checksum field": _edit("checksum"),
    "an entry without its file": _edit("tensors", "WEIGHT", "file"),
    "written is a list": _edit("written", value=["config.json"]),
    "a written entry as a bare size": _edit("written", "config.json", value=1),
    "a written size as a string": _edit("written", "config.json", "size", value="1"),
    "a written entry without its mtime_ns": _edit("written", "config.json", "mtime_ns"),
    "files is a list": _edit("files", value=[]),
}


def write_manifest(path: Path, original: Path, edit) -> None:
    new = edit(json.loads(original.read_text()))
    path.write_bytes(new if isinstance(new, bytes) else json.dumps(new).encode())


@pytest.mark.parametrize("damage", MANIFESTS)
def test_a_damaged_own_manifest_is_one_mismatch_line(merged, tmp_path, damage):
    _, good = merged
    out = damaged_copy(good, tmp_path)
    write_manifest(out / MANIFEST_NAME, good / MANIFEST_NAME, MANIFESTS[damage])
    assert_one_mismatch_line(run_cli("verify", out), MANIFEST_NAME, "damaged")


@pytest.mark.parametrize("damage", MANIFESTS)
def test_a_damaged_other_manifest_is_bad_input(merged, tmp_path, damage):
    _, good = merged
    other = tmp_path / "old-manifest.json"
    write_manifest(other, good / MANIFEST_NAME, MANIFESTS[damage])
    assert_bad_input_line(run_cli("verify", good, "--manifest", other), str(other), "damaged")


def test_the_untouched_merge_still_verifies(merged):
    """The copies above were damaged, not the merge itself (and a good manifest passes the checks)."""
    _, good = merged
    result = run_cli("verify", good)
    assert result.returncode == 0, result.stdout + result.stderr


# --- an oversized header length in safetensors inputs --------------------------------------------


@pytest.mark.parametrize("name,pattern", [("w3-dcp-safetensors", "__0_0.distcp"), ("w2-dcp-hf", "*.safetensors")])
def test_a_reader_refuses_an_oversized_header_length_without_reading_it(checkpoints, tmp_path, name, pattern):
    folder = copy_checkpoint(checkpoints, name, tmp_path)
    victim = sorted(folder.glob(pattern))[0]
    oversized_length(victim)
    with pytest.raises(BadInput, match="100 MB limit"):
        fsdpfast.plan_merge(folder)
    assert_bad_input_line(run_cli("inspect", folder), victim.name, "100 MB limit")
