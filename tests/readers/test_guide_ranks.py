"""guide-ranks (`model_pt_rank_R.pt` rank files of DTensors, or of plain to_local() pieces placed by
the model's shapes): merged bit for bit, what else the files hold reported, damaged copies refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from corpus import assert_merge_is_the_model, specs_read_by
from helpers import copy_checkpoint, rank_file
from refusals import DOWN_PROJ, Q_PROJ, api_refuses, cli_refuses, edit_state_dict

import fsdpfast


@pytest.mark.slow
@pytest.mark.parametrize("name", specs_read_by("guide-ranks"))
def test_keep_dtype_is_bit_exact_and_loads_in_transformers(checkpoints, tmp_path, name):
    assert_merge_is_the_model(checkpoints, tmp_path, name)


def test_guide_layout_reports_what_else_the_files_hold(checkpoints, tmp_path):
    spec, folder = checkpoints.get("w2-guide")
    report = fsdpfast.merge(folder, tmp_path / "merged")
    assert report.layout == "guide-ranks"
    text = " ".join(report.notes)
    assert "optimizer_state" in text and "tensors" in text
    assert "metadata" in text and "world_size=2" in text


def remove_last_guide_rank(folder: Path) -> list:
    # The metadata's world_size tells how many ranks there should be, so the missing one is named.
    missing = rank_file(folder, 1)
    missing.unlink()
    return [missing, "is missing", "2 ranks"]


def swap_in_a_local_piece_of_another_shape(folder: Path) -> list:
    victim = rank_file(folder, 1)
    edit_state_dict(victim, lambda state: state.update({Q_PROJ: state[DOWN_PROJ]}))
    return [victim, Q_PROJ, "[32, 88]"]


def cast_a_local_piece_to_bf16(folder: Path) -> list:
    victim = rank_file(folder, 1)
    edit_state_dict(victim, lambda state: state.update({Q_PROJ: state[Q_PROJ].to(torch.bfloat16)}))
    return [victim, Q_PROJ, "bfloat16"]


# name -> (the corpus checkpoint copied, the damage; it returns what the refusal must mention)
DAMAGES: dict[str, tuple[str, Callable[[Path], list]]] = {
    "last rank missing": ("w2-guide", remove_last_guide_rank),
    "piece shapes disagree": ("w2-guide-local", swap_in_a_local_piece_of_another_shape),
    "piece dtypes disagree": ("w2-guide-local", cast_a_local_piece_to_bf16),
}


@pytest.mark.parametrize("name", DAMAGES)
def test_damaged_checkpoint_is_refused_by_the_cli(checkpoints, tmp_path, name):
    base, damage = DAMAGES[name]
    folder = copy_checkpoint(checkpoints, base, tmp_path)
    cli_refuses(folder, tmp_path / "merged", mentions=damage(folder))


@pytest.mark.parametrize("name", DAMAGES)
def test_damaged_checkpoint_is_refused_by_the_api(checkpoints, tmp_path, name):
    base, damage = DAMAGES[name]
    folder = copy_checkpoint(checkpoints, base, tmp_path)
    api_refuses(folder, tmp_path / "merged", mentions=damage(folder))
