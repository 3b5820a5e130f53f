"""plan.columns.Records: extents and source buffers kept in columns read exactly as the tuples of
records they stand for (equality, hashing, indexing, pickling), and a plan read from real rank
files holds them so; reading rank files leaves no garbage behind for the paused collector."""

from __future__ import annotations

import gc
import pickle

import pytest
from test_pickle_twins import rank_pickles

from fsdpfast import _ops
from fsdpfast._parsing.pickle_twins import Twins
from fsdpfast._parsing.safe_load import DTensorRef, Record, StorageRef, TensorRef
from fsdpfast.plan.columns import Records, RecordsBuilder
from fsdpfast.plan.model import Extent, MergePlan, SourceBuffer, TensorPlan
from fsdpfast.readers import read_plan

EXTENTS = (Extent(3, 0, 10, 0), Extent(0, 5, 4, 10, 3, 7, 9), Extent(2**40, 2**33, 1, 2**50))
SOURCES = (SourceBuffer("/a/rank_0.pt", 64, 128, "float32"), SourceBuffer("/a/rank_1.pt", 0, 8, "bfloat16"))


@pytest.mark.parametrize("items", [EXTENTS, SOURCES, ()])
def test_records_read_as_the_tuple_of_their_records(items):
    kind = type(items[0]) if items else Extent
    records = Records.of(kind, items)
    assert tuple(records) == items and list(records) == list(items)
    assert records == items and items == records and records == list(items)
    assert hash(records) == hash(items)
    assert len(records) == len(items) and bool(records) == bool(items)
    assert [records[i] for i in range(-len(items), len(items))] == list(items) * 2
    assert records[1:] == items[1:] and records[::-1] == items[::-1]
    assert records + items == items + items and items + records == items + items
    assert pickle.loads(pickle.dumps(records)) == records
    with pytest.raises(IndexError):
        records[len(items)]
    if items:
        assert records != items[:-1] and records != Records.of(kind, items[:-1])
        assert {(1, records): "x"}[(1, items)] == "x"  # a key of either form finds the other


def test_builder_rows_and_records_handed_out_stay_as_they_were():
    builder = RecordsBuilder(Extent)
    builder.extend([(3, 0, 10, 0, 1, 0, 0)])
    first = builder.done()
    builder.append(EXTENTS[1])
    e = EXTENTS[2]
    builder.append_values(e.source, e.src_offset, e.count, e.dst_offset, e.runs, e.src_stride, e.dst_stride)
    assert first == EXTENTS[:1] and builder.done() == EXTENTS
    with pytest.raises(TypeError):
        builder.append_values(1, 2, 3)
    with pytest.raises(TypeError):
        builder.extend([(1, 2, 3)])
    assert builder.done() == EXTENTS
    strings = RecordsBuilder(SourceBuffer)
    with pytest.raises(TypeError):
        strings.extend([("/a", 0, 1, "float32")])


def test_a_plan_holds_records_and_compares_with_tuples():
    tensor = TensorPlan("w", (4, 10), "float32", "float32", Records.of(Extent, EXTENTS[:1]))
    as_tuples = TensorPlan("w", (4, 10), "float32", "float32", EXTENTS[:1])
    assert isinstance(tensor.extents, Records) and tensor == as_tuples and hash(tensor) == hash(as_tuples)
    plan = MergePlan("x", 1, Records.of(SourceBuffer, SOURCES), [tensor])
    assert isinstance(plan.sources, Records) and plan == MergePlan("x", 1, SOURCES, [as_tuples])


@pytest.mark.slow
def test_rank_files_are_planned_in_columns(checkpoints):
    _, folder = checkpoints.get("w4-hsdp-tied")
    plan = read_plan(folder, None, None)
    assert isinstance(plan.sources, Records)
    dtensors = [t for t in plan.tensors if isinstance(t.extents, Records)]
    assert dtensors and all(isinstance(e, Extent) for t in dtensors for e in t.extents)
    assert plan.copies  # HSDP replicas: each compared with the piece that is read
    for copy in plan.copies:
        for piece in (copy.kept, copy.other):
            assert all(0 <= e.source < len(plan.sources) for e in piece.extents)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(_ops.native(), "pickle_value_changes"), reason="no native pickle comparison")
def test_rank_files_read_as_changes_leave_no_cycles(checkpoints):
    """Planning pauses the garbage collector: what a file's read makes must go with its last
    reference, not wait for the collector (a cycle kept every rank's objects alive while planning)."""
    _, folder = checkpoints.get("w8-tied")
    pickles = rank_pickles(folder)
    twins = Twins()
    first_path, first_data = pickles[0]
    twins.load(first_data, first_path)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept in gc.garbage, to look at
    try:
        for path, data in pickles[1:]:
            twins.load(data, path)
        assert len(twins._references) < len(pickles) - 1, "no file was read as changes of another"
        gc.collect()
        read = [o for o in gc.garbage if isinstance(o, (Record, TensorRef, StorageRef, DTensorRef))]
        assert not read, f"{len(read)} objects read from the files were left to the collector"
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
