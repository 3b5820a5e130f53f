"""HuggingFaceStorageWriter folders merge bit for bit like torch's own consolidate_safetensors_files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from corpus import assert_merge_is_the_model, specs_read_by
from helpers import assert_bit_exact, config_beside, copy_checkpoint, load_reference, read_merged
from refusals import cli_refuses
from safetensors import safe_open
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

import fsdpfast

SPECS = ["w2-dcp-hf", "w2-dcp-hf-split-dim1", "w4-dcp-hf-hsdp-tied-bf16"]


def torch_consolidation(folder: str, out: Path) -> dict[str, torch.Tensor]:
    """torch's consolidation of the folder into `out`, with the model files the writer used."""
    shards = sorted(Path(folder).glob("*.safetensors"))
    mapping = {}
    for path in shards:  # shard-S-model-I-of-N: tensor -> I
        with safe_open(str(path), framework="pt") as f:
            mapping.update(dict.fromkeys(f.keys(), int(path.name.split("-")[3])))
    out.mkdir()
    consolidate_safetensors_files(folder, str(out), fqn_to_index_mapping=mapping)
    return read_merged(str(out))


@pytest.mark.slow
@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("dtype", ["keep", "bf16"])
def test_equals_torch_consolidate_safetensors_files(checkpoints, tmp_path, name, dtype):
    spec, folder = checkpoints.get(name)
    oracle = torch_consolidation(folder, tmp_path / "oracle")
    report = fsdpfast.merge(folder, tmp_path / "merged", dtype=dtype)
    assert report.layout == "dcp-hf"
    _, tied = load_reference(spec.reference_path(checkpoints.root))
    assert_bit_exact(
        read_merged(tmp_path / "merged"), oracle, dtype=torch.bfloat16 if dtype == "bf16" else None, tied=tied
    )


def test_split_writer_output_has_one_file_per_rank_and_model_file(checkpoints):
    _, folder = checkpoints.get("w2-dcp-hf-split-dim1")
    assert sorted(p.name for p in Path(folder).glob("*.safetensors")) == [
        f"shard-0000{s}-model-0000{m}-of-00002.safetensors" for s in (1, 2) for m in (1, 2)
    ]
    assert not os.path.exists(os.path.join(folder, ".metadata"))  # the writer records the sharding nowhere else


def test_a_folder_with_dcp_files_too_needs_layout(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-dcp-hf", tmp_path)
    _, dcp_folder = checkpoints.get("w2-dcp")
    for entry in os.listdir(dcp_folder):
        if entry == ".metadata" or entry.endswith(".distcp"):
            shutil.copy(os.path.join(dcp_folder, entry), folder / entry)
    cli_refuses(folder, tmp_path / "out", mentions=["several layouts", "dcp, dcp-hf", "--layout"])
    assert fsdpfast.merge(folder, tmp_path / "hf", layout="dcp-hf").layout == "dcp-hf"


def test_missing_first_shard_file(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-dcp-hf", tmp_path)
    (folder / "shard-00001-model-00001-of-00001.safetensors").unlink()
    cli_refuses(folder, tmp_path / "out", mentions=["shard-00001-model-*-of-00001.safetensors is missing"])


@pytest.mark.slow
def test_missing_middle_shard_file(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w4-dcp-hf-hsdp-tied-bf16", tmp_path)
    (folder / "shard-00003-model-00001-of-00001.safetensors").unlink()
    cli_refuses(folder, tmp_path / "out", mentions=["shard-00003-model-*-of-00001.safetensors is missing"])


def test_missing_model_file(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-dcp-hf-split-dim1", tmp_path)
    for rank in (1, 2):
        (folder / f"shard-0000{rank}-model-00002-of-00002.safetensors").unlink()
    cli_refuses(folder, tmp_path / "out", mentions=["shard-*-model-00002-of-00002.safetensors is missing"])


@pytest.mark.parametrize(
    "name,last",
    [
        ("w2-dcp-hf", "shard-00002-model-00001-of-00001.safetensors"),
        ("w2-dcp-hf-split-dim1", "shard-00002-model-*-of-00002.safetensors"),
    ],
)
def test_missing_last_shard_file_is_caught_by_the_config(checkpoints, tmp_path, name, last):
    """No gap in the numbering is left, so only the config can tell the embeddings came out too small."""
    folder = copy_checkpoint(checkpoints, name, tmp_path)
    for path in folder.glob(last):
        path.unlink()
    cli_refuses(
        folder, tmp_path / "out", mentions=["model.embed_tokens.weight", "vocab_size", "a shard file is missing"]
    )
    config = tmp_path / "config"
    shutil.move(folder / "huggingface", config)  # --config is checked the same way
    cli_refuses(
        folder, tmp_path / "out", "--config", config, mentions=["model.embed_tokens.weight", "a shard file is missing"]
    )
    found = fsdpfast.inspect(folder)  # without any config.json the plan says what it could not check
    assert any(
        "a missing last shard file cannot be detected" in note and "no config.json" in note for note in found["notes"]
    )


def test_plan_says_the_shapes_were_checked(checkpoints):
    _, folder = checkpoints.get("w2-dcp-hf")
    notes = fsdpfast.inspect(folder)["notes"]
    assert any("2 shard files" in n and "agree with" in n and "config.json" in n for n in notes), notes


@pytest.mark.parametrize("keep", [0.5, 0.001])
def test_truncated_shard_file(checkpoints, tmp_path, keep):
    folder = copy_checkpoint(checkpoints, "w2-dcp-hf", tmp_path)
    shard = folder / "shard-00002-model-00001-of-00001.safetensors"
    os.truncate(shard, int(shard.stat().st_size * keep))  # in the data, then inside the header
    cli_refuses(folder, tmp_path / "out", mentions=[shard.name, "truncated"])


def rewrite_header(shard: Path, old: str, new: str) -> None:
    """Replace text in a safetensors header by text of the same length (the data stays in place)."""
    assert len(old) == len(new)
    raw = shard.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = raw[8 : 8 + size].decode()
    assert header.count(old) == 1, old
    shard.write_bytes(raw[:8] + header.replace(old, new).encode() + raw[8 + size :])


def test_shape_that_disagrees_with_the_data_offsets(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-dcp-hf", tmp_path)
    shard = folder / "shard-00001-model-00001-of-00001.safetensors"
    entry = '"model.embed_tokens.weight":{"dtype":"F32","shape":[5'  # rows 0-50 of the embedding
    rewrite_header(shard, entry + "1,64]", entry + "0,64]")
    cli_refuses(folder, tmp_path / "out", mentions=[shard.name, "model.embed_tokens.weight", "data_offsets", "corrupt"])


@pytest.mark.parametrize("offsets,problem", [("[52, 0]", "cover"), ("[50, 0]", "overlaps")])
def test_saved_offsets_that_disagree_with_the_shapes(checkpoints, tmp_path, offsets, problem):
    folder = copy_checkpoint(checkpoints, "w2-dcp-hf", tmp_path)
    shard = folder / "shard-00002-model-00001-of-00001.safetensors"  # rows 51-100 of the embedding
    rewrite_header(
        shard,
        'embed_tokens.weight\\": {\\"saved_offsets\\": [51, 0]',
        f'embed_tokens.weight\\": {{\\"saved_offsets\\": {offsets}',
    )
    cli_refuses(folder, tmp_path / "out", mentions=["model.embed_tokens.weight", problem])


def test_hole_and_overlap_that_add_up_are_refused(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-dcp-hf", tmp_path)
    shard = folder / "shard-00001-model-00001-of-00001.safetensors"  # rows 0-50 moved down by one
    rewrite_header(
        shard,
        'embed_tokens.weight\\": {\\"saved_offsets\\": [0, 0]',
        'embed_tokens.weight\\": {\\"saved_offsets\\": [1, 0]',
    )
    cli_refuses(folder, tmp_path / "out", mentions=["model.embed_tokens.weight", "overlaps"])


def test_a_plain_safetensors_file_among_the_shards(checkpoints, tmp_path):
    from safetensors.torch import save_file

    folder = copy_checkpoint(checkpoints, "w2-dcp-hf", tmp_path)
    save_file({"x": torch.zeros(2)}, str(folder / "extra.safetensors"))
    cli_refuses(folder, tmp_path / "out", mentions=["extra.safetensors", "DCP_SHARDING_INFO", "move it out"])


def test_sharding_info_that_lists_other_tensors(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-dcp-hf", tmp_path)
    shard = folder / "shard-00002-model-00001-of-00001.safetensors"
    rewrite_header(shard, '\\"model.norm.weight\\"', '\\"model.nOrm.weight\\"')
    cli_refuses(folder, tmp_path / "out", mentions=[shard.name, "DCP_SHARDING_INFO", "corrupt"])


def test_header_metadata_is_what_torch_writes(checkpoints):
    """The facts the reader relies on, read from a real file: offsets as JSON inside __metadata__."""
    _, folder = checkpoints.get("w2-dcp-hf")
    with safe_open(os.path.join(folder, "shard-00002-model-00001-of-00001.safetensors"), framework="pt") as f:
        info = json.loads(f.metadata()["DCP_SHARDING_INFO"])
        assert set(info) == set(f.keys())
        assert info["model.embed_tokens.weight"]["saved_offsets"] == [51, 0]


@pytest.mark.slow
@pytest.mark.parametrize("name", specs_read_by("dcp-hf"))
def test_keep_dtype_is_bit_exact_and_loads_in_transformers(checkpoints, tmp_path, name):
    assert_merge_is_the_model(checkpoints, tmp_path, name)


@pytest.mark.slow
def test_config_beside_the_shard_files_is_taken_and_checks_them(checkpoints, tmp_path):
    """config.json next to the shard files (no huggingface/): copied with its tokenizer files, and the
    embeddings' inferred shapes checked against it."""
    spec, _ = checkpoints.get("w2-dcp-hf")
    folder = copy_checkpoint(checkpoints, "w2-dcp-hf", tmp_path)
    moved = config_beside(folder)
    report = fsdpfast.merge(folder, tmp_path / "merged")
    assert report.warnings == [] and report.copied == moved
    assert any("agree with" in note and str(folder / "config.json") in note for note in report.notes), report.notes
    reference, tied = load_reference(spec.reference_path(checkpoints.root))
    assert_bit_exact(read_merged(tmp_path / "merged"), reference, tied=tied)
    (folder / "shard-00002-model-00001-of-00001.safetensors").unlink()
    cli_refuses(folder, tmp_path / "out", mentions=["model.embed_tokens.weight", "a shard file is missing"])
