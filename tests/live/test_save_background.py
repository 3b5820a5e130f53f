"""`save_pretrained(..., background=True)` on real gloo ranks: the files are byte for byte the
blocking save's, though training's next step (its collectives on the same group) ran while they
were written; a second background save waits for the first."""

from __future__ import annotations

import json

import pytest
from helpers import assert_nothing_published

from fsdpfast._testing.background_examples import BackgroundSpec, save_both_ways

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORLD = 2
SPECS = [
    BackgroundSpec("rows-fp32"),
    BackgroundSpec("columns-to-bf16", shard_dim=1, save_dtype="bf16", max_shard_size="40KB", seed=51),
]
FAILS = BackgroundSpec("fails", fail_rank=1, seed=52)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("background")
    save_both_ways(str(root), [*SPECS, FAILS], WORLD)
    return root


def _files(folder) -> dict[str, bytes]:
    """Every file but the manifest (which records when each file was written)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "fsdpfast-manifest.json"}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_background_save_writes_the_blocking_saves_bytes(saved, spec):
    folder = saved / spec.name
    outcomes = [json.loads((folder / f"outcome-{rank}.json").read_text()) for rank in range(WORLD)]
    assert all(o["ok"] for o in outcomes), outcomes
    assert all(o["first_done_before_second"] for o in outcomes), outcomes
    blocking, background = _files(folder / "blocking"), _files(folder / "background")
    assert any(name.endswith(".safetensors") for name in blocking) and blocking == background
    assert _files(folder / "second") == _files(folder / "after")  # the model of the next step
    assert _files(folder / "second") != background  # which training changed while the first was written
    manifest = json.loads((folder / "background" / "fsdpfast-manifest.json").read_text())
    assert manifest["tensors"] == json.loads((folder / "blocking" / "fsdpfast-manifest.json").read_text())["tensors"]
    stored = sum(t["nbytes"] for t in manifest["tensors"].values())
    held = sum(o["host_bytes"] for o in outcomes)  # the ranks' pieces once, as stored: the model once in all
    assert held == (stored if spec.save_dtype is None else stored * 2)  # fp32 pieces, written as bf16


def test_a_rank_whose_background_writes_fail_fails_every_ranks_wait(saved):
    assert_nothing_published(saved / FAILS.name, WORLD, FAILS.fail_rank)
