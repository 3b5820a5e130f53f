"""Rank files read as changes of one already read (fsdpfast/_parsing/pickle_twins.py) give exactly
what unpickling each file gives: every rank of real checkpoints (gloo ranks: HSDP, Shard(1), tied
weights, wrappers and a buffer; and 48 ranks of real FSDP2 over torch's fake process group, whose
last ranks hold shorter or empty pieces), compared object by object with the full read."""

from __future__ import annotations

import glob
import os
import pickletools

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


@pytest.mark.slow
@pytest.mark.parametrize("name", GLOO)
def test_every_rank_reads_as_its_full_unpickling(checkpoints, name):
    _, folder = checkpoints.get(name)
    pickles = rank_pickles(folder)
    twins = read_all(pickles)
    # Each rank's process pickles hashes of its own (DTensorSpec._hash); one that happens to need a
    # byte less gives that file another structure, read in full. The others are read as changes.
    changes_of = _ops.native().pickle_value_changes
    if any(changes_of(pickles[0][1], data) is not None for _, data in pickles[1:]):
        assert len(twins._references) < len(pickles), "no file was read as changes of another"


@pytest.fixture(scope="module")
def many_ranks(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("twins") / "ckpt")
    write_many_ranks(folder, 48, 3)
    return folder


@pytest.mark.slow
def test_many_ranks_with_short_and_empty_last_pieces(many_ranks):
    pickles = rank_pickles(many_ranks)
    twins = read_all(pickles)
    assert len(twins._references) <= 3  # numbers of one byte throughout: one reference, a few at most


@pytest.mark.slow
def test_a_file_of_another_structure_is_unpickled_in_full(checkpoints, many_ranks):
    _, other = checkpoints.get("w3-bert-dim1")
    mixed = rank_pickles(many_ranks)[:3] + rank_pickles(other)[:1] + rank_pickles(many_ranks)[3:5]
    twins = read_all(mixed)
    assert any(ref.data == mixed[3][1] for ref in twins._references)  # read in full, and kept as a reference


def test_files_of_other_structures_do_not_push_out_the_reference_in_use(monkeypatch):
    import pickle

    from fsdpfast._parsing import pickle_twins

    def rank_file(rank: int, dims: int = 2) -> bytes:  # `dims` other than 2: another structure
        return pickle.dumps({"rank": rank, "shape": (4,) * dims}, protocol=2)

    twins = Twins()
    twins.load(rank_file(0), "rank 0")
    assert twins.load(rank_file(1), "rank 1") == {"rank": 1, "shape": (4, 4)}  # learns where the rank lands
    read_in_full = []
    monkeypatch.setattr(
        pickle_twins, "safe_unpickle", lambda data, *args: read_in_full.append(data) or safe_unpickle(data, *args)
    )
    for dims in range(3, 3 + 2 * pickle_twins._KEPT):  # more files of other structures than references kept
        twins.load(rank_file(dims, dims), f"rank {dims}")  # read in full, and kept as a reference
        assert twins.load(rank_file(dims + 100), "a twin of rank 0") == {"rank": dims + 100, "shape": (4, 4)}
        assert read_in_full[-1] != rank_file(dims + 100), "read in full: rank 0's reference was pushed out"


def with_a_shorter_hash(data: bytes, which: int) -> bytes:
    """The pickle with its `which`-th eight-byte LONG1 (a DTensorSpec._hash) a hash that needs seven
    bytes, as one in 256 does: what torch writes when that rank's hash happens to be small."""
    hashes = [pos for op, _, pos in pickletools.genops(data) if op.name == "LONG1" and data[pos + 1] == 8]
    at = hashes[which]
    value = int.from_bytes(data[at + 2 : at + 10], "little", signed=True) >> 16
    return data[: at + 1] + b"\x07" + value.to_bytes(7, "little", signed=True) + data[at + 10 :]


def test_a_run_of_files_of_other_structures_leaves_the_reference_in_use(many_ranks, monkeypatch):
    from fsdpfast._parsing import pickle_twins

    pickles = rank_pickles(many_ranks)
    odd = [(path, with_a_shorter_hash(data, i)) for i, (path, data) in enumerate(pickles[3 : 4 + pickle_twins._KEPT])]
    assert len({data for _, data in odd}) == len(odd)  # each a structure of its own
    after = pickles[4 + pickle_twins._KEPT :]
    twins = Twins()
    for path, data in pickles[:3] + odd:
        _assert_same(twins.load(data, path), safe_unpickle(data, path))
    read_in_full = []
    original = pickle_twins.safe_unpickle
    monkeypatch.setattr(
        pickle_twins,
        "safe_unpickle",
        lambda data, *args, **kw: read_in_full.append(data) or original(data, *args, **kw),
    )
    for path, data in after:
        _assert_same(twins.load(data, path), safe_unpickle(data, path))
    assert not {data for _, data in after} & set(read_in_full), "a file after the odd ones was read in full"
