"""Records that disagree with their own bytes are refused, as torch.load refuses them.

torch.load reads each storage record once, with the dtype and size the pickle's first reference to
it names, and refuses a record of any other length ("record size ... does not match expected
size"); Tensor.set_ refuses a tensor whose offset, shape and strides reach past its storage; and a
later reference naming the record with another dtype is silently read with the first one's. Real
FSDP2 rank files (gloo ranks) are edited the way each case describes: their zip records cut or
lengthened, or numbers of their data.pkl rewritten. Every refusal is one line, exit 2, nothing
written, sources unchanged; its look-alike (two tensors viewing one storage, one at an offset)
merges bit-exact. The rank files read as changes of another (pickle_twins) are checked the same.
"""

from __future__ import annotations

import collections
import pickletools
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (lets torch.load(weights_only=True) rebuild DTensors)
from fuzz_parsers import _assert_same
from helpers import assert_bit_exact, copy_checkpoint, load_reference, rank_file, read_merged
from refusals import K_PROJ, Q_PROJ, api_refuses, cli_refuses, edit_state_dict

import fsdpfast
from fsdpfast import _ops
from fsdpfast._parsing import pickle_twins
from fsdpfast._parsing.pickle_twins import Twins
from fsdpfast._parsing.safe_load import safe_unpickle
from fsdpfast._parsing.torch_zip import TorchZip
from fsdpfast.errors import BadInput

# --- editing the records of a real rank file ---------------------------------------------------


def rewrite_records(path: Path, edit) -> None:
    """Rewrite the archive with edit(name, data) for each record's bytes, names and order kept."""
    with zipfile.ZipFile(path) as original:
        records = [(info.filename, original.read(info)) for info in original.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as rewritten:
        for name, data in records:
            rewritten.writestr(name, edit(name, data))


def data_pkl(path: Path) -> bytes:
    return TorchZip(path).pickle_bytes


def with_data_pkl(path: Path, pickle: bytes) -> None:
    rewrite_records(path, lambda name, data: pickle if name.endswith("/data.pkl") else data)


def share_one_storage(state: dict) -> None:
    """q_proj's and k_proj's pieces (plain tensors) become views of one storage, k_proj's at an
    offset: what torch.save writes for two tensors of one buffer (a fused qkv, say). (torch.save
    cannot write a DTensor whose local tensor starts past its storage's first element: it pickles
    the DTensor's own empty storage then; so these are a guide layout's plain pieces.)"""
    q, k = state[Q_PROJ], state[K_PROJ]
    joined = torch.cat([q.reshape(-1), k.reshape(-1)])
    state[Q_PROJ] = joined[: q.numel()].view(q.shape)
    state[K_PROJ] = joined[q.numel() :].view(k.shape)


def storage_references(pickle: bytes) -> list[dict]:
    """Each persistent id of a torch.save pickle, in order: its storage key, and the opcodes of its
    storage class and size and of the storage offset of the tensor made from it."""
    ops = list(pickletools.genops(pickle))
    memo, found = {}, []
    for i, (op, arg, _) in enumerate(ops):
        if op.name in ("BINPUT", "LONG_BINPUT"):
            memo[arg] = ops[i - 1][1]
        if op.name != "BINPERSID":
            continue
        end = max(j for j in range(i) if ops[j][0].name == "TUPLE")
        start = max(j for j in range(end) if ops[j][0].name == "MARK")
        _, kind, key, _, numel = [o for o in ops[start + 1 : end] if o[0].name not in ("BINPUT", "LONG_BINPUT")]
        offset = next(o for o in ops[i + 1 :] if o[0].name not in ("BINPUT", "LONG_BINPUT"))
        key = memo[key[1]] if key[0].name in ("BINGET", "LONG_BINGET") else key[1]
        found.append({"key": key, "kind": kind, "numel": numel, "offset": offset})
    return found


def shared(pickle: bytes) -> tuple[dict, dict]:
    """The first two references to one storage record (k_proj's is the second)."""
    by_key = collections.defaultdict(list)
    for reference in storage_references(pickle):
        by_key[reference["key"]].append(reference)
    (pair,) = [refs for refs in by_key.values() if len(refs) == 2]
    return pair[0], pair[1]


def with_number(pickle: bytes, op, value: int) -> bytes:
    """`op` (a BININT1/BININT2/BININT opcode of `pickle`) holding `value`: in the same width where it
    fits (the pickle then differs from the file's in that value only), else as a BININT."""
    width = {"BININT1": 1, "BININT2": 2, "BININT": 4}[op[0].name]
    end = op[2] + 1 + width
    if value < 1 << (8 * width - (width == 4)):
        return pickle[: op[2] + 1] + value.to_bytes(width, "little", signed=width == 4) + pickle[end:]
    return pickle[: op[2]] + b"J" + value.to_bytes(4, "little", signed=True) + pickle[end:]


def with_storage_class(pickle: bytes, op, name: str) -> bytes:
    """The storage class opcode `op` (a GLOBAL, or a BINGET of one) replaced by GLOBAL torch.`name`."""
    end = op[2] + {"BINGET": 2, "LONG_BINGET": 5}.get(op[0].name, len(f"c{op[1]}\n") + 1)
    return pickle[: op[2]] + f"ctorch\n{name}\n".encode() + pickle[end:]


# --- the cases -----------------------------------------------------------------------------------


def lengthen_a_record(folder: Path) -> list:
    victim = rank_file(folder, 1)
    (size,) = [i.file_size for i in zipfile.ZipFile(victim).infolist() if i.filename.endswith("/data/0")]
    rewrite_records(victim, lambda name, data: data + bytes(4) if name.endswith("/data/0") else data)
    return [victim, "data/0", f"holds {size + 4} bytes", f"({size} bytes)"]


def shorten_a_record(folder: Path) -> list:
    victim = rank_file(folder, 1)
    (size,) = [i.file_size for i in zipfile.ZipFile(victim).infolist() if i.filename.endswith("/data/0")]
    rewrite_records(victim, lambda name, data: data[:-4] if name.endswith("/data/0") else data)
    return [victim, "data/0", f"holds {size - 4} bytes", f"({size} bytes)"]


def name_a_shared_storage_with_two_dtypes(folder: Path) -> list:
    victim = views_at_offsets(folder)
    pickle = data_pkl(victim)
    first, second = shared(pickle)
    with_data_pkl(victim, with_storage_class(pickle, second["kind"], "IntStorage"))
    return [victim, f"data/{first['key']}", "float32", "int32"]


def name_a_shared_storage_with_two_sizes(folder: Path) -> list:
    victim = views_at_offsets(folder)
    pickle = data_pkl(victim)
    first, second = shared(pickle)
    numel = first["numel"][1]
    with_data_pkl(victim, with_number(pickle, second["numel"], numel - 1))
    return [victim, f"data/{first['key']}", f"{numel} float32", f"{numel - 1} float32"]


def move_a_view_past_its_storage(folder: Path) -> list:
    victim = views_at_offsets(folder)
    pickle = data_pkl(victim)
    first, second = shared(pickle)
    numel, offset = first["numel"][1], second["offset"][1]
    with_data_pkl(victim, with_number(pickle, second["offset"], offset + 1))
    return [victim, f"data/{first['key']}", f"offset {offset + 1}", f"reaches element {numel + 1}", f"holds {numel}"]


def move_a_local_shard_past_its_storage(folder: Path) -> list:
    """A DTensor's local shard (FSDP2 rank files) starting where its storage ends."""
    victim = rank_file(folder, 1)
    pickle = data_pkl(victim)
    first = storage_references(pickle)[0]
    numel = first["numel"][1]
    with_data_pkl(victim, with_number(pickle, first["offset"], numel))
    return [victim, f"data/{first['key']}", f"offset {numel}", f"holds {numel}"]


def deepen_the_metadata(depth: int):
    """The state dict's `_metadata` (what torch.save pickles of nn.Module versions) nested `depth` deep."""

    def damage(folder: Path) -> list:
        victim = rank_file(folder, 1)
        whole = torch.load(victim, weights_only=True)
        nested: dict = {"version": 1}
        for _ in range(depth):
            nested = {"inner": nested}
        whole._metadata["model"] = nested
        torch.save(whole, victim)
        return [victim, "nests more than 100 levels"]

    return damage


def views_at_offsets(folder: Path) -> Path:
    """Both ranks' q_proj and k_proj on one storage (share_one_storage); rank 1's file."""
    for rank in (0, 1):
        edit_state_dict(rank_file(folder, rank), share_one_storage)
    return rank_file(folder, 1)


# name -> (the session checkpoint copied, what alters it and returns what the refusal names)
FSDP2, GUIDE = "w2-llama", "w2-guide-local"  # DTensors; plain pieces (to_local) placed by the model
REFUSED = {
    "a record longer than its storage": (FSDP2, lengthen_a_record),
    "a record shorter than its storage": (FSDP2, shorten_a_record),
    "a local shard past its storage": (FSDP2, move_a_local_shard_past_its_storage),
    "a storage named with two dtypes": (GUIDE, name_a_shared_storage_with_two_dtypes),
    "a storage named with two sizes": (GUIDE, name_a_shared_storage_with_two_sizes),
    "a view past its storage": (GUIDE, move_a_view_past_its_storage),
    "_metadata nested 150 deep": (FSDP2, deepen_the_metadata(150)),
}
ACCEPTED = {
    "views of one storage at offsets": (GUIDE, views_at_offsets),
    "_metadata nested 60 deep": (FSDP2, deepen_the_metadata(60)),
}


@pytest.mark.parametrize("name", REFUSED)
def test_the_cli_refuses(checkpoints, tmp_path, name):
    base, damage = REFUSED[name]
    folder = copy_checkpoint(checkpoints, base, tmp_path)
    mentions = damage(folder)
    cli_refuses(folder, tmp_path / "merged", mentions=mentions)


@pytest.mark.parametrize("name", REFUSED)
def test_the_api_refuses(checkpoints, tmp_path, name):
    base, damage = REFUSED[name]
    folder = copy_checkpoint(checkpoints, base, tmp_path)
    mentions = damage(folder)
    api_refuses(folder, tmp_path / "merged", mentions=mentions)


@pytest.mark.parametrize("name", ACCEPTED)
def test_the_look_alike_merges_bit_exact(checkpoints, tmp_path, name):
    base, alter = ACCEPTED[name]
    spec, _ = checkpoints.get(base)
    folder = copy_checkpoint(checkpoints, base, tmp_path)
    alter(folder)
    fsdpfast.merge(folder, tmp_path / "merged")
    reference, tied = load_reference(spec.reference_path(checkpoints.root))
    assert_bit_exact(read_merged(tmp_path / "merged"), reference, tied=tied)


def test_torch_load_refuses_the_records_that_disagree_with_their_bytes(checkpoints, tmp_path):
    """A record's length and a tensor's reach are torch.load's own checks. Two references naming one
    storage otherwise it does not refuse: it reads the record as the first names it, whatever the
    second says (a tensor named int32 comes back float32); fsdpfast would read it as named, so it refuses."""
    for name in ["a record longer than its storage", "a record shorter than its storage", "a view past its storage"]:
        base, damage = REFUSED[name]
        folder = copy_checkpoint(checkpoints, base, tmp_path / name)
        damage(folder)
        with pytest.raises(RuntimeError, match="size"):
            torch.load(rank_file(folder, 1), weights_only=True)
    folder = copy_checkpoint(checkpoints, GUIDE, tmp_path / "dtypes")
    name_a_shared_storage_with_two_dtypes(folder)
    state = torch.load(rank_file(folder, 1), weights_only=True)
    assert state["state_dict"][K_PROJ].dtype == torch.float32


# --- the twins path: rank files read as changes of one already read -----------------------------

needs_twins = pytest.mark.skipif(
    not hasattr(_ops.native(), "pickle_value_changes"),
    reason="the native module is not built: every pickle is unpickled in full",
)


@pytest.fixture
def shared_views(checkpoints, tmp_path) -> bytes:
    folder = copy_checkpoint(checkpoints, GUIDE, tmp_path)
    return data_pkl(views_at_offsets(folder))


def read_in_full_counted(monkeypatch) -> list[bytes]:
    read = []
    original = pickle_twins.safe_unpickle
    monkeypatch.setattr(
        pickle_twins, "safe_unpickle", lambda data, *args, **kw: read.append(data) or original(data, *args, **kw)
    )
    return read


@needs_twins
@pytest.mark.parametrize("change", ["the view's offset past its storage", "the second reference's size"])
def test_a_twin_is_refused_as_its_full_unpickling_is(shared_views, monkeypatch, change):
    first, second = shared(shared_views)
    if change == "the second reference's size":
        damaged = with_number(shared_views, second["numel"], first["numel"][1] - 1)
    else:
        damaged = with_number(shared_views, second["offset"], first["numel"][1] - 1)
    assert _ops.native().pickle_value_changes(shared_views, damaged) is not None  # a twin: values differ
    with pytest.raises(BadInput) as full:
        safe_unpickle(damaged, "rank 1")
    twins = Twins()
    twins.load(shared_views, "rank 0")
    with pytest.raises(BadInput) as twin:
        twins.load(damaged, "rank 1")
    assert str(twin.value) == str(full.value)
    assert "rank 1" in str(full.value) and "data/" in str(full.value)


@needs_twins
def test_a_twin_whose_view_moved_within_its_storage_is_read_as_changes(shared_views, monkeypatch):
    first, second = shared(shared_views)
    moved = with_number(shared_views, second["offset"], 0)  # k_proj's view now overlaps q_proj's: torch reads it
    twins = Twins()
    twins.load(shared_views, "rank 0")
    read = read_in_full_counted(monkeypatch)
    value = twins.load(moved, "rank 1")
    assert moved not in read, "read in full, not as changes"
    assert value["state_dict"][K_PROJ].offset == 0
    _assert_same(value, safe_unpickle(moved, "rank 1"))


@needs_twins
def test_a_twin_whose_shared_storage_grew_is_read_as_changes(shared_views, monkeypatch):
    first, second = shared(shared_views)
    numel = first["numel"][1]
    grown = with_number(with_number(shared_views, first["numel"], numel + 1), second["numel"], numel + 1)
    twins = Twins()
    twins.load(shared_views, "rank 0")
    read = read_in_full_counted(monkeypatch)
    value = twins.load(grown, "rank 1")
    assert grown not in read, "read in full, not as changes"
    assert value["state_dict"][K_PROJ].storage.numel == numel + 1
    _assert_same(value, safe_unpickle(grown, "rank 1"))


def test_a_storage_of_no_bytes_viewed_with_two_dtypes_is_read_as_torch_reads_it(tmp_path):
    """torch.save skips its one-dtype-per-storage check for a storage of no bytes, so a file it writes
    may name one empty storage as float32 and as int32; torch.load reads it, and so does fsdpfast."""
    empty = torch.empty(0)
    path = tmp_path / "empty.pt"
    torch.save({"a": empty, "b": empty.view(torch.int32)}, path)
    torch_read = torch.load(path, weights_only=True)
    read = safe_unpickle(TorchZip(path).pickle_bytes, str(path))
    assert set(read) == set(torch_read) == {"a", "b"}
    for key in read:
        assert (read[key].shape, read[key].storage.numel) == (tuple(torch_read[key].shape), 0), key
