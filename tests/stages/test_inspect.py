"""`fsdpfast inspect`: what a checkpoint holds and what a merge would write, from metadata alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import load_reference

import fsdpfast


@pytest.mark.slow
def test_inspect_lists_what_merge_writes(checkpoints, tmp_path):
    spec, folder = checkpoints.get("w3-wrapped-buffer")
    found = fsdpfast.inspect(folder)
    reference, tied = load_reference(spec.reference_path(checkpoints.root))
    assert found["layout"] == "fsdp-ranks" and found["world_size"] == 3
    assert {t["name"] for t in found["tensors"]} == set(reference) - tied
    assert sorted(n for t in found["tensors"] for n in t["tied"]) == sorted(tied)
    assert found["total_bytes"] == sum(v.numel() * v.element_size() for k, v in reference.items() if k not in tied)
    report = fsdpfast.merge(folder, tmp_path / "merged")
    assert report.bytes_written == found["total_bytes"] and report.tensors == found["total_tensors"]


@pytest.mark.slow
def test_inspect_cli_json_and_text(checkpoints):
    _, folder = checkpoints.get("w3-dcp-nested-bert-dim1")
    result = subprocess.run(
        [sys.executable, "-m", "fsdpfast", "inspect", folder, "--json"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["layout"] == "dcp" and found["world_size"] == 3
    assert any("optim." in note for note in found["notes"])
    text = subprocess.run([sys.executable, "-m", "fsdpfast", "inspect", folder], capture_output=True, text=True)
    assert text.returncode == 0 and text.stdout.startswith(f"{folder}: layout dcp, 3 ranks")
    assert "bert.embeddings.word_embeddings.weight" in text.stdout


@pytest.mark.slow
def test_inspect_bad_folder_is_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "fsdpfast", "inspect", str(tmp_path / "nowhere")], capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "no such folder" in result.stderr
