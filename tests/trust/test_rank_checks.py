"""Rank files that say less than they seem to: every merge is the model, or it is refused.

Plain to_local() pieces (which do not record the dimension they were split along), buffers every
rank holds whole, DDP and full-state-dict saves, file names that disagree with the ranks the files
record, files of two training steps, HSDP replicas that differ, two spellings of one rank, and a
stale .distcp file. Every checkpoint is written by real gloo ranks (tests/support/corpus.py names them) and altered with
torch in a private copy; each case merges bit-exact or is refused in one line (exit 2, nothing
written), and `verify --against` runs the same checks.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_bit_exact, copy_checkpoint, load_reference, read_merged
from hypothesis import given, settings
from hypothesis import strategies as st
from refusals import api_refuses, cli_refuses, edit_state_dict, run_cli, the_error_line

import fsdpfast
from fsdpfast.checks import copies
from fsdpfast.errors import BadInput
from fsdpfast.geometry.placements import chunk_span
from fsdpfast.readers.plain_pieces import _concatenate_to

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"  # (64, 64) in the llama examples
BUFFER = "fsdpfast_probe_buffer"  # (3, 4), held whole by every rank (CheckpointSpec.buffer)


def merged_is_the_model(checkpoints, name: str, folder, out: Path, **options) -> fsdpfast.MergeReport:
    spec, _ = checkpoints.get(name)
    reference, tied = load_reference(spec.reference_path(checkpoints.root))
    report = fsdpfast.merge(folder, out, **options)
    assert_bit_exact(read_merged(out), reference, tied=tied)
    return report


def drop_architecture(folder: Path) -> None:
    """huggingface/config.json without `architectures`: the model's class, and so its shapes, unknown."""
    path = folder / "huggingface" / "config.json"
    config = json.loads(path.read_text())
    config.pop("architectures", None)
    path.write_text(json.dumps(config))


def config_folder(folder: Path, where: Path, cls: str) -> Path:
    """A --config folder: the checkpoint's config.json naming the model class."""
    where.mkdir()
    config = json.loads((folder / "huggingface" / "config.json").read_text())
    config["architectures"] = [cls]
    (where / "config.json").write_text(json.dumps(config))
    return where


def guide_file(folder: Path, rank: int) -> Path:
    return folder / f"model_pt_rank_{rank}.pt"


def verl_file(folder: Path, kind: str, rank: int, world: int = 2) -> Path:
    return folder / f"{kind}_world_size_{world}_rank_{rank}.pt"


def edit_metadata(path: Path, **changes) -> None:
    whole = torch.load(path, weights_only=True)
    whole["metadata"].update(changes)
    torch.save(whole, path)


def add_one_at(state: dict, name: str, element: int) -> None:
    """Change one element of a tensor's local piece in place (a DTensor's or a plain tensor's)."""
    value = state[name]
    local = value._local_tensor if hasattr(value, "_local_tensor") else value
    local.view(-1)[element] += 1


# --- 1. plain to_local() pieces -----------------------------------------------------------------


def test_a_buffer_every_rank_holds_is_kept_once_beside_plain_pieces(checkpoints, tmp_path):
    # Was: the buffer's two copies concatenated as if they were dim-0 pieces ([6, 4]).
    _, folder = checkpoints.get("w2-guide-local-buffer")
    report = merged_is_the_model(
        checkpoints, "w2-guide-local-buffer", folder, tmp_path / "out", allow_extra_tensors=True
    )
    assert list(read_merged(tmp_path / "out")[BUFFER].shape) == [3, 4]
    assert any("1 tensors every rank holds whole" in note for note in report.notes), report.notes


@pytest.mark.slow
def test_pieces_sharded_on_dim_1_are_placed_along_dim_1(checkpoints, tmp_path):
    # Was: concatenated along dim 0 (FSDP2 shard_placement_fn=Shard(1), saved as to_local() pieces).
    _, folder = checkpoints.get("w3-guide-local-bert-dim1")
    report = merged_is_the_model(checkpoints, "w3-guide-local-bert-dim1", folder, tmp_path / "out")
    assert any("along dim 1" in note and "along dim 0" in note for note in report.notes), report.notes


@pytest.mark.slow
def test_plain_pieces_without_the_models_shapes_are_refused(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w3-guide-local-bert-dim1", tmp_path)
    shutil.rmtree(folder / "huggingface")  # no config.json: the model's shapes are unknown
    cli_refuses(folder, tmp_path / "out", mentions=["do not record the dimension", "--config DIR", "no config.json"])


@pytest.mark.slow
def test_the_config_option_places_plain_pieces(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w3-guide-local-bert-dim1", tmp_path)
    drop_architecture(folder)
    config = config_folder(folder, tmp_path / "config", "BertForMaskedLM")
    merged_is_the_model(checkpoints, "w3-guide-local-bert-dim1", folder, tmp_path / "out", config=str(config))


@pytest.mark.slow
def test_a_config_of_another_model_refuses_the_pieces(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w3-guide-local-bert-dim1", tmp_path)
    config = folder / "huggingface" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_size": 96}))
    cli_refuses(
        folder, tmp_path / "out", mentions=["bert.embeddings.word_embeddings.weight", "[103, 96]", "--config DIR"]
    )


def test_buffer_copies_that_differ_are_refused(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-guide-local-buffer", tmp_path)
    edit_state_dict(guide_file(folder, 1), lambda state: add_one_at(state, BUFFER, 5))
    cli_refuses(
        folder,
        tmp_path / "out",
        "--allow-extra-tensors",
        mentions=[BUFFER, "first at element 5", guide_file(folder, 0), guide_file(folder, 1)],
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.integers(2, 6), st.data())
def test_only_the_split_dimension_rebuilds_the_shape(shape, world, data):
    # torch.chunk's pieces, trailing ranks given empty ones as FSDP2 does: exactly one dimension
    # lays them end to end into the full shape (so the choice is never a guess), with torch.chunk's sizes.
    dim = data.draw(st.integers(0, len(shape) - 1))
    chunks = list(torch.chunk(torch.empty(shape), world, dim))
    empty = [0 if d == dim else size for d, size in enumerate(shape)]
    pieces = [tuple(c.shape) for c in chunks] + [tuple(empty)] * (world - len(chunks))
    assert [d for d in range(len(shape)) if _concatenate_to(pieces, tuple(shape), d)] == [dim]
    assert [p[dim] for p in pieces] == [chunk_span(shape[dim], world, r)[1] for r in range(world)]
    assert any(p != tuple(shape) for p in pieces)  # never mistaken for whole copies


# --- 2. the guide layout's metadata: rank and step -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("order", list(itertools.permutations(range(3)))[1:])
def test_renamed_guide_files_are_placed_by_the_rank_they_record(checkpoints, tmp_path, order):
    # File i is renamed to model_pt_rank_{order[i]}.pt: the names lie, the metadata does not.
    folder = copy_checkpoint(checkpoints, "w3-guide-local", tmp_path)
    moved = {rank: guide_file(folder, rank).rename(folder / f"moved_{rank}") for rank in range(3)}
    for rank, path in moved.items():
        path.rename(guide_file(folder, order[rank]))
    report = merged_is_the_model(checkpoints, "w3-guide-local", folder, tmp_path / "out")
    assert any("metadata records other ranks than their names" in note for note in report.notes), report.notes


def test_renamed_guide_files_of_dtensors_merge_bit_exact(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-guide", tmp_path)
    guide_file(folder, 0).rename(folder / "swap")
    guide_file(folder, 1).rename(guide_file(folder, 0))
    (folder / "swap").rename(guide_file(folder, 1))
    merged_is_the_model(checkpoints, "w2-guide", folder, tmp_path / "out")


def test_guide_files_of_two_steps_are_refused(checkpoints, tmp_path):
    # A save that crashed part way: rank 1's file is already the next step's (written by the same ranks).
    spec, _ = checkpoints.get("w2-guide-local")
    folder = copy_checkpoint(checkpoints, "w2-guide-local", tmp_path)
    shutil.copy(guide_file(Path(spec.second_folder(checkpoints.root)), 1), guide_file(folder, 1))
    cli_refuses(folder, tmp_path / "out", mentions=[guide_file(folder, 1), "step 2", "step 1", "two saves"])


def test_guide_files_recording_one_rank_twice_are_refused(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-guide-local", tmp_path)
    edit_metadata(guide_file(folder, 1), rank=0)
    cli_refuses(folder, tmp_path / "out", mentions=[guide_file(folder, 0), guide_file(folder, 1), "both record rank 0"])


def test_a_recorded_rank_outside_the_world_is_refused(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-guide-local", tmp_path)
    edit_metadata(guide_file(folder, 1), rank=5)
    cli_refuses(folder, tmp_path / "out", mentions=[guide_file(folder, 1), "rank 5", "world of 2"])


# --- 3. every rank saved the whole model ----------------------------------------------------------


@pytest.mark.parametrize("name", ["w2-ddp", "w2-full-state"])
def test_every_rank_holding_the_whole_model_merges_once(checkpoints, tmp_path, name):
    # Was: the two copies of every tensor concatenated along dim 0. w2-ddp's config.json names no
    # class (the copies' bytes decide); w2-full-state's does (the model's shapes decide).
    _, folder = checkpoints.get(name)
    report = merged_is_the_model(checkpoints, name, folder, tmp_path / "out")
    assert report.world_size == 2
    assert any("every rank holds the whole model" in note for note in report.notes), report.notes


def test_whole_copies_that_differ_without_the_models_shapes_are_refused(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-ddp", tmp_path)
    shutil.rmtree(folder / "huggingface")  # no config.json: the model's shapes are unknown
    victim = verl_file(folder, "model", 1)
    edit_state_dict(victim, lambda state: add_one_at(state, "module." + Q_PROJ, 100))
    cli_refuses(folder, tmp_path / "out", mentions=[Q_PROJ, victim, "first at element 100", "--config DIR"])


def test_whole_copies_that_differ_are_refused(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-full-state", tmp_path)
    victim = verl_file(folder, "model", 1)
    edit_state_dict(victim, lambda state: add_one_at(state, Q_PROJ, 4095))
    cli_refuses(folder, tmp_path / "out", mentions=[Q_PROJ, victim, "first at element 4095", "holds this tensor whole"])


# --- 6. ambiguous inputs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,copy_as", [("w2-llama", "model_world_size_2_rank_01.pt"), ("w2-guide", "model_pt_rank_01.pt")]
)
def test_two_spellings_of_one_rank_are_refused(checkpoints, tmp_path, name, copy_as):
    folder = copy_checkpoint(checkpoints, name, tmp_path)
    original = next(folder.glob("*_rank_1.pt"))
    shutil.copy(original, folder / copy_as)
    cli_refuses(folder, tmp_path / "out", mentions=[copy_as, original.name, "both name rank 1"])


def damage_a_replica(folder: Path, element: int) -> Path:
    """Change one element of q_proj in a file of HSDP replica group 1 (mesh (2, 2): ranks 2 and 3)."""
    victim = verl_file(folder, "model", 3, world=4)
    edit_state_dict(victim, lambda state: add_one_at(state, Q_PROJ, element))
    return victim


@pytest.mark.slow
def test_hsdp_replicas_that_differ_are_refused(checkpoints, tmp_path):
    # Was: replica group 0 read, group 1 never looked at.
    folder = copy_checkpoint(checkpoints, "w4-hsdp-tied", tmp_path)
    victim = damage_a_replica(folder, 7)
    cli_refuses(
        folder,
        tmp_path / "out",
        mentions=[Q_PROJ, victim, verl_file(folder, "model", 1, world=4), "first at element 7", "replica"],
    )


@pytest.mark.slow
def test_the_merge_samples_replicas_and_verify_compares_every_byte(checkpoints, tmp_path, monkeypatch):
    # q_proj's local piece is 32 x 64 float32; with 64-byte samples, element 500 is outside all three.
    monkeypatch.setattr(copies, "SAMPLE_BYTES", 64)
    folder = copy_checkpoint(checkpoints, "w4-hsdp-tied", tmp_path)
    victim = damage_a_replica(folder, 500)
    report = merged_is_the_model(checkpoints, "w4-hsdp-tied", folder, tmp_path / "out")
    assert any("verify --against compares every byte" in note for note in report.notes), report.notes
    with pytest.raises(BadInput) as caught:
        fsdpfast.verify(tmp_path / "out", against=folder)
    assert str(victim) in str(caught.value) and "first at element 500" in str(caught.value)
    monkeypatch.setattr(copies, "SAMPLE_BYTES", 2048)  # the first sample is now elements 0-511: refused
    api_refuses(folder, tmp_path / "out2", mentions=[victim, "first at element 500"])


@pytest.mark.slow
def test_buffers_beside_dtensors_that_differ_are_refused(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w3-wrapped-buffer", tmp_path)
    victim = verl_file(folder, "model", 2, world=3)
    edit_state_dict(victim, lambda state: add_one_at(state, next(k for k in state if k.endswith(BUFFER)), 0))
    cli_refuses(folder, tmp_path / "out", mentions=[BUFFER, victim, "first at element 0"])


def test_a_stale_distcp_file_is_not_counted(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-dcp", tmp_path)
    shutil.copy(folder / "__1_0.distcp", folder / "__2_0.distcp")  # left by an earlier save of 3 ranks
    report = merged_is_the_model(checkpoints, "w2-dcp", folder, tmp_path / "out")
    assert report.world_size == 2
    assert any("__2_0.distcp" in note and "does not reference" in note for note in report.notes), report.notes


def mix_in_the_next_step(checkpoints, folder: Path, kinds) -> None:
    spec, _ = checkpoints.get("w2-verl-steps")
    for kind in kinds:
        shutil.copy(verl_file(Path(spec.second_folder(checkpoints.root)), kind, 1), verl_file(folder, kind, 1))


def test_verl_files_of_two_steps_are_refused(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-verl-steps", tmp_path)
    mix_in_the_next_step(checkpoints, folder, ["model", "optim", "extra_state"])
    cli_refuses(
        folder,
        tmp_path / "out",
        mentions=[
            verl_file(folder, "extra_state", 0),
            verl_file(folder, "extra_state", 1),
            "last_epoch 1",
            "last_epoch 2",
            "two saves",
        ],
    )


def test_verl_files_of_two_steps_are_refused_by_the_optimizer_step(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-verl-steps", tmp_path)
    mix_in_the_next_step(checkpoints, folder, ["model", "optim"])
    for rank in range(2):
        verl_file(folder, "extra_state", rank).unlink()
    cli_refuses(
        folder, tmp_path / "out", mentions=[verl_file(folder, "optim", 1), "optimizer step 1", "optimizer step 2"]
    )


def test_verl_files_of_one_step_merge_with_a_note(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-verl-steps")
    report = merged_is_the_model(checkpoints, "w2-verl-steps", folder, tmp_path / "out")
    assert any("agree on the training step (lr_scheduler last_epoch 1)" in note for note in report.notes), report.notes


# --- verify --against runs the same checks -----------------------------------------------------------


def verify_refuses(out: Path, against: Path, mentions) -> None:
    line = the_error_line(run_cli("verify", out, "--against", against))
    for text in mentions:
        assert str(text) in line, (text, line)


def test_verify_against_refuses_a_checkpoint_of_two_steps(checkpoints, tmp_path):
    spec, _ = checkpoints.get("w2-guide-local")
    folder = copy_checkpoint(checkpoints, "w2-guide-local", tmp_path)
    fsdpfast.merge(folder, tmp_path / "out")
    shutil.copy(guide_file(Path(spec.second_folder(checkpoints.root)), 1), guide_file(folder, 1))
    verify_refuses(tmp_path / "out", folder, [guide_file(folder, 1), "step 2"])


@pytest.mark.slow
def test_verify_against_refuses_differing_replicas(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w4-hsdp-tied", tmp_path)
    fsdpfast.merge(folder, tmp_path / "out")
    victim = damage_a_replica(folder, 2047)
    verify_refuses(tmp_path / "out", folder, [Q_PROJ, victim, "first at element 2047"])


@pytest.mark.slow
def test_verify_against_checks_the_models_shapes(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w3-guide-local-bert-dim1", tmp_path)
    out = tmp_path / "out"
    fsdpfast.merge(folder, out)
    config = out / "config.json"  # verify --against reads the output's config.json
    config.write_text(json.dumps({**json.loads(config.read_text()), "intermediate_size": 96}))
    verify_refuses(out, folder, ["intermediate.dense.weight", "[96, 48]"])


@pytest.mark.slow
def test_verify_against_accepts_renamed_guide_files(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-guide-local", tmp_path)
    fsdpfast.merge(folder, tmp_path / "out")
    guide_file(folder, 0).rename(folder / "swap")
    guide_file(folder, 1).rename(guide_file(folder, 0))
    (folder / "swap").rename(guide_file(folder, 1))
    result = run_cli("verify", tmp_path / "out", "--against", folder)
    assert result.returncode == 0, result.stderr
