"""DCP folders (torch.distributed.checkpoint.save) merge bit for bit like torch's own converter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from corpus import assert_merge_is_the_model, specs_read_by
from helpers import assert_bit_exact, config_beside, copy_checkpoint, load_reference, read_merged
from refusals import cli_refuses
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import fsdpfast
from fsdpfast.errors import BadInput

# torch's dcp_to_torch_save reads torch.save-serialised .distcp files only; the safetensors kind
# ("w3-dcp-safetensors") is checked against the unsharded model like every spec (below).
ORACLE_SPECS = ["w2-dcp", "w3-dcp-nested-bert-dim1", "w4-dcp-hsdp-tied-bf16"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ORACLE_SPECS)
@pytest.mark.parametrize("dtype", ["keep", "bf16"])
def test_equals_torch_dcp_to_torch_save(checkpoints, tmp_path, name, dtype):
    spec, folder = checkpoints.get(name)
    dcp_to_torch_save(folder, tmp_path / "oracle.pt")
    oracle = torch.load(tmp_path / "oracle.pt", weights_only=True)
    oracle = oracle["model"] if spec.layout == "dcp-nested" else oracle
    report = fsdpfast.merge(folder, tmp_path / "merged", dtype=dtype)
    assert report.layout == "dcp"
    merged = read_merged(tmp_path / "merged")
    _, tied = load_reference(spec.reference_path(checkpoints.root))
    assert set(merged) == set(oracle) - tied
    for key, got in merged.items():
        want = oracle[key].to(torch.bfloat16) if dtype == "bf16" and oracle[key].is_floating_point() else oracle[key]
        assert got.dtype == want.dtype and torch.equal(
            got.view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)
        ), key


@pytest.mark.slow
def test_nested_checkpoint_reports_the_optimizer_it_skips(checkpoints, tmp_path):
    _, folder = checkpoints.get("w3-dcp-nested-bert-dim1")
    report = fsdpfast.merge(folder, tmp_path / "merged")
    assert any("optim." in note for note in report.notes)


@pytest.mark.slow
def test_prefix_chooses_the_part_and_rejects_unknown_ones(checkpoints, tmp_path):
    _, folder = checkpoints.get("w3-dcp-nested-bert-dim1")
    fsdpfast.merge(folder, tmp_path / "merged", prefix="model")
    with pytest.raises(BadInput, match="no tensors under prefix='ema'"):
        fsdpfast.merge(folder, tmp_path / "other", prefix="ema")
    _, flat = checkpoints.get("w2-llama")
    with pytest.raises(BadInput, match="the prefix argument applies to dcp"):
        fsdpfast.merge(flat, tmp_path / "third", prefix="model")


def _refused(folder, out) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "fsdpfast", "merge", str(folder), "--out", str(out)], capture_output=True, text=True
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("fsdpfast: error: ")
    assert not out.exists()
    return result.stderr


def test_missing_distcp_file(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-dcp", tmp_path)
    (folder / "__1_0.distcp").unlink()
    assert "__1_0.distcp is missing" in _refused(folder, tmp_path / "out")


def test_truncated_metadata(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-dcp", tmp_path)
    metadata = folder / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[: metadata.stat().st_size // 2])
    assert ".metadata" in _refused(folder, tmp_path / "out")


def test_truncated_distcp_file(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-dcp", tmp_path)
    shard = folder / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    assert "__0_0.distcp" in _refused(folder, tmp_path / "out")


def test_metadata_that_runs_code_is_refused(checkpoints, tmp_path):
    import pickle

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    folder = copy_checkpoint(checkpoints, "w2-dcp", tmp_path)
    (folder / ".metadata").write_bytes(pickle.dumps(Exploit()))
    assert "refusing to unpickle" in _refused(folder, tmp_path / "out")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow
def test_safetensors_distcp_missing_a_tensor(checkpoints, tmp_path):
    import json

    folder = copy_checkpoint(checkpoints, "w3-dcp-safetensors", tmp_path)
    shard = folder / "__1_0.distcp"
    raw = shard.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    victim = next(k for k in header if k != "__metadata__")
    header["x" + victim[1:]] = header.pop(victim)  # same length, another name
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (size - len(text))
    assert len(text) == size  # the renamed header still fits in place
    shard.write_bytes(raw[:8] + text + raw[8 + size :])
    assert f"holds no tensor {victim}" in _refused(folder, tmp_path / "out")


@pytest.mark.slow
@pytest.mark.parametrize("name", specs_read_by("dcp"))
def test_keep_dtype_is_bit_exact_and_loads_in_transformers(checkpoints, tmp_path, name):
    assert_merge_is_the_model(checkpoints, tmp_path, name)


def _same_files_but_the_manifest(a, b) -> None:
    names = sorted(set(os.listdir(a)) - {"fsdpfast-manifest.json"})
    assert names == sorted(set(os.listdir(b)) - {"fsdpfast-manifest.json"})
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.slow
def test_config_beside_metadata_is_taken_with_its_tokenizer_files(checkpoints, tmp_path):
    """config.json next to .metadata (no huggingface/ sub-folder): the same output as from huggingface/."""
    spec, original = checkpoints.get("w2-dcp")
    folder = copy_checkpoint(checkpoints, "w2-dcp", tmp_path)
    moved = config_beside(folder)
    assert {"config.json", "generation_config.json", "tokenizer_config.json"} <= set(moved)
    report = fsdpfast.merge(folder, tmp_path / "merged")
    assert report.warnings == [] and report.copied == moved
    assert not any("not checked against the model" in note for note in report.notes), report.notes
    reference, tied = load_reference(spec.reference_path(checkpoints.root))
    assert_bit_exact(read_merged(tmp_path / "merged"), reference, tied=tied)
    fsdpfast.merge(original, tmp_path / "from-huggingface", dtype="bf16")
    fsdpfast.merge(folder, tmp_path / "beside", dtype="bf16")  # config.json's dtype entry written the same way
    _same_files_but_the_manifest(tmp_path / "beside", tmp_path / "from-huggingface")
    assert fsdpfast.verify(tmp_path / "merged", against=folder).ok


@pytest.mark.slow
def test_a_config_beside_metadata_that_ties_two_different_tensors_is_refused(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-dcp", tmp_path)  # trained untied: lm_head differs from embed_tokens
    config_beside(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    cli_refuses(folder, tmp_path / "out", mentions=["ties lm_head.weight to model.embed_tokens.weight", "differ"])
