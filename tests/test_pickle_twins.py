"""Rank files read as changes of one already read (fsdpfast/_parsing/pickle_twins.py) give exactly
what unpickling each file gives: every rank of real checkpoints (gloo ranks: HSDP, Shard(1), tied
weights, wrappers and a buffer; and 48 ranks of real FSDP2 over torch's fake process group, whose
last ranks hold shorter or empty pieces), compared object by object with the full read."""

from __future__ import annotations

import glob
import os

import pytest
from fuzz_parsers import _assert_same
from helpers import write_many_ranks

from fsdpfast import _ops
from fsdpfast._parsing.pickle_twins import Twins
from fsdpfast._parsing.safe_load import safe_unpickle
from fsdpfast._parsing.torch_zip import TorchZip

pytestmark = pytest.mark.skipif(
    not hasattr(_ops.native(), "pickle_value_changes"),
    reason="the native module is not built: every pickle is unpickled in full",
)

GLOO = ["w8-tied", "w4-hsdp-tied", "w3-bert-dim1", "w4-hsdp-bert-dim1", "w3-wrapped-buffer", "w2-verl-steps"]


def rank_pickles(folder: str) -> list[tuple[str, bytes]]:
    paths = sorted(
        glob.glob(os.path.join(folder, "model_world_size_*_rank_*.pt")),
        key=lambda p: int(p.rsplit("_", 1)[1].split(".")[0]),
    )
    return [(path, TorchZip(path).pickle_bytes) for path in paths]


def read_all(pickles) -> Twins:
    twins = Twins()
    for path, data in pickles:
        _assert_same(twins.load(data, path), safe_unpickle(data, path))
    return twins


@pytest.mark.parametrize("name", GLOO)
def test_every_rank_reads_as_its_full_unpickling(checkpoints, name):
    _, folder = checkpoints.get(name)
    pickles = rank_pickles(folder)
    twins = read_all(pickles)
    assert len(twins._references) < len(pickles), "no file was read as changes of another"


@pytest.fixture(scope="module")
def many_ranks(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("twins") / "ckpt")
    write_many_ranks(folder, 48, 3)
    return folder


def test_many_ranks_with_short_and_empty_last_pieces(many_ranks):
    pickles = rank_pickles(many_ranks)
    twins = read_all(pickles)
    assert len(twins._references) <= 3  # numbers of one byte throughout: one reference, a few at most


def test_a_file_of_another_structure_is_unpickled_in_full(checkpoints, many_ranks):
    _, other = checkpoints.get("w3-bert-dim1")
    mixed = rank_pickles(many_ranks)[:3] + rank_pickles(other)[:1] + rank_pickles(many_ranks)[3:5]
    twins = read_all(mixed)
    assert any(ref.data == mixed[3][1] for ref in twins._references)  # read in full, and kept as a reference
