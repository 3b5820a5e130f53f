"""fsdp-ranks (verl's `model_world_size_W_rank_R.pt`): merged output equals the unsharded model bit for bit,
for every world size and mesh (the corpus's other layouts: their readers' test files)."""

from __future__ import annotations

import os

import pytest
import torch
from corpus import assert_merge_is_the_model, specs_read_by
from helpers import assert_bit_exact, load_reference, read_index, read_merged, transformers_logits

import fsdpfast


@pytest.mark.slow
@pytest.mark.parametrize("name", specs_read_by("fsdp-ranks"))
def test_keep_dtype_is_bit_exact_and_loads_in_transformers(checkpoints, tmp_path, name):
    assert_merge_is_the_model(checkpoints, tmp_path, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w2-llama", "w3-bert-dim1", "w4-bf16", "w8-hsdp-bert"])
@pytest.mark.parametrize(
    "dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)]
)
def test_cast_equals_torch_to(checkpoints, tmp_path, name, dtype, torch_dtype):
    spec, folder = checkpoints.get(name)
    reference, tied = load_reference(spec.reference_path(checkpoints.root))
    out = tmp_path / "merged"
    fsdpfast.merge(folder, out, dtype=dtype)
    assert_bit_exact(read_merged(out), reference, dtype=torch_dtype, tied=tied)


def test_config_and_tokenizer_files_are_copied_with_the_written_dtype(checkpoints, tmp_path):
    spec, folder = checkpoints.get("w2-llama")
    out = tmp_path / "merged"
    report = fsdpfast.merge(folder, out, dtype="bf16")
    for entry in ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / entry).is_file(), entry
    assert set(report.copied) == {
        "config.json",
        "generation_config.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    import json

    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert not (out / "model.safetensors.index.json").exists()


def test_config_folder_option_takes_files_from_elsewhere(checkpoints, tmp_path):
    spec, folder = checkpoints.get("w2-llama")
    elsewhere = tmp_path / "base-model"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text(open(os.path.join(folder, "huggingface", "config.json")).read())
    (elsewhere / "modeling_custom.py").write_text("# custom code travels with the model\n")
    (elsewhere / "model.safetensors").write_bytes(b"weights of another model must not be copied")
    out = tmp_path / "merged"
    fsdpfast.merge(folder, out, config=str(elsewhere))
    assert (out / "modeling_custom.py").read_text().startswith("# custom code")
    assert not (out / "generation_config.json").exists()
    assert (out / "model.safetensors").read_bytes()[:8] != b"weights "


@pytest.mark.slow
@pytest.mark.parametrize("max_shard_size", ["20KB", 30_000, "0.05MB"])
def test_split_output_has_index_and_loads(checkpoints, tmp_path, max_shard_size):
    spec, folder = checkpoints.get("w3-llama")
    reference, tied = load_reference(spec.reference_path(checkpoints.root))
    out = tmp_path / "merged"
    report = fsdpfast.merge(folder, out, max_shard_size=max_shard_size)
    index = read_index(out)
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(shards) > 1
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert set(index["weight_map"].values()) == set(shards)
    merged = read_merged(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    for name, file in index["weight_map"].items():
        from safetensors import safe_open

        with safe_open(str(out / file), framework="pt") as f:
            assert name in f.keys()
    assert_bit_exact(merged, reference, tied=tied)
    assert report.files[-1] == "model.safetensors.index.json"
    logits = transformers_logits(str(out), spec.model)
    assert torch.equal(logits, torch.load(spec.logits_path(checkpoints.root), weights_only=True))


@pytest.mark.slow
def test_cli_merge_prints_report_and_exits_zero(checkpoints, tmp_path):
    import json
    import subprocess
    import sys

    _, folder = checkpoints.get("w2-tied-bf16")
    out = tmp_path / "merged"
    result = subprocess.run(
        [sys.executable, "-m", "fsdpfast", "merge", folder, "--out", str(out), "--dtype", "fp32", "--json"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["files"] == ["model.safetensors"]
    assert report["tied"] == {"model.embed_tokens.weight": ["lm_head.weight"]}
    from fsdpfast.execute.engines import available_engines

    assert report["engine"] == available_engines()[0]
