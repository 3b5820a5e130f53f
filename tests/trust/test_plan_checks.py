"""Shards that overlap or leave gaps: refused with an error naming the tensor.

Real DCP checkpoints whose .metadata is edited with torch's own classes (a chunk moved onto
another, or out of the tensor, or dropped), and the plan check itself against a brute-force
count of every element, on random tilings made by the readers' own box_extents.
"""

from __future__ import annotations

import pickle
from array import array
from itertools import product
from math import prod
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint  # noqa: F401  (the classes .metadata pickles)
from helpers import copy_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from refusals import cli_refuses
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from fsdpfast import _ops
from fsdpfast.dtypes import itemsize
from fsdpfast.errors import BadInput
from fsdpfast.geometry.boxes import box_extents
from fsdpfast.plan.checks import check_extents
from fsdpfast.plan.columns import Records
from fsdpfast.plan.model import Extent, SourceBuffer

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"  # (64, 64), two chunks of 32 rows in w2-dcp
BERT_QUERY = "model.bert.encoder.layer.0.attention.self.query.weight"  # DCP flat name; (48, 48), Shard(1) over 3 ranks


# --- real checkpoints with edited metadata ----------------------------------------------------


def edit_metadata(folder: Path, edit) -> None:
    path = folder / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    edit(metadata)
    path.write_bytes(pickle.dumps(metadata))


def move_chunk(metadata, fqn: str, old_offsets, new_offsets) -> None:
    """Say the chunk saved at `old_offsets` belongs at `new_offsets` (the bytes stay where they are)."""
    entry = metadata.state_dict_metadata[fqn]
    entry.chunks = [
        ChunkStorageMetadata(torch.Size(new_offsets), c.sizes) if list(c.offsets) == list(old_offsets) else c
        for c in entry.chunks
    ]
    for index in [i for i in metadata.storage_data if i.fqn == fqn and list(i.offset) == list(old_offsets)]:
        info = metadata.storage_data.pop(index)
        metadata.storage_data[MetadataIndex(fqn, torch.Size(new_offsets), index.index)] = info


def drop_chunk(metadata, fqn: str, offsets) -> None:
    entry = metadata.state_dict_metadata[fqn]
    entry.chunks = [c for c in entry.chunks if list(c.offsets) != list(offsets)]


EDITS = {
    # chunk of rows 32..63 said to hold rows 16..47: the element count still matches
    "rows overlap": ("w2-dcp", lambda m: move_chunk(m, Q_PROJ, [32, 0], [16, 0]), [Q_PROJ, "overlap", "element 1024 "]),
    # Shard(1) columns 16..31 said to be 8..23: strided pieces interleave
    "columns overlap": (
        "w3-dcp-nested-bert-dim1",
        lambda m: move_chunk(m, BERT_QUERY, [0, 16], [0, 8]),
        ["query.weight", "overlap"],
    ),
    "chunk outside the tensor": (
        "w2-dcp",
        lambda m: move_chunk(m, Q_PROJ, [32, 0], [48, 0]),
        [Q_PROJ, "reaches element"],
    ),
    "chunk missing": ("w2-dcp", lambda m: drop_chunk(m, Q_PROJ, [32, 0]), [Q_PROJ, "2048 of its 4096"]),
}


@pytest.mark.parametrize("name", EDITS)
def test_dcp_chunks_that_overlap_or_leave_gaps_are_refused(checkpoints, tmp_path, name):
    base, edit, mentions = EDITS[name]
    folder = copy_checkpoint(checkpoints, base, tmp_path)
    edit_metadata(folder, edit)
    cli_refuses(folder, tmp_path / "merged", mentions=mentions)


@pytest.mark.slow
def test_bert_query_name_is_what_the_nested_checkpoint_holds(checkpoints):
    # Guards the "columns overlap" case above against renames in the example models.
    _, folder = checkpoints.get("w3-dcp-nested-bert-dim1")
    metadata = pickle.loads((Path(folder) / ".metadata").read_bytes())
    entry = metadata.state_dict_metadata[BERT_QUERY]
    assert [list(c.offsets) for c in entry.chunks] == [[0, 0], [0, 16], [0, 32]]


# --- the check against a brute-force count ----------------------------------------------------


def element_counts(shape, extents: list[Extent]) -> list[int]:
    counts = [0] * prod(shape)
    for e in extents:
        for run in range(e.runs):
            for k in range(e.count):
                index = e.dst_offset + run * e.dst_stride + k
                if index < len(counts):
                    counts[index] += 1
                else:
                    counts.append(99)  # out of the tensor: never "exactly once"
    return counts


def grid_boxes(shape, cuts):
    """Boxes (offsets, sizes) of the grid that splits each dim at `cuts[d]` (a tiling of the tensor)."""
    edges = [sorted({0, size, *(c for c in dim_cuts if 0 < c < size)}) for size, dim_cuts in zip(shape, cuts)]
    spans = [list(zip(e, e[1:])) for e in edges]
    for box in product(*spans):
        yield tuple(a for a, _ in box), tuple(b - a for a, b in box)


@st.composite
def tilings(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    cuts = [draw(st.lists(st.integers(1, size), max_size=3)) for size in shape]
    return shape, list(grid_boxes(shape, cuts))


def plan_of(shape, boxes, nudge=None):
    """Extents and one source buffer per box, as a reader makes them; `nudge` moves one box."""
    extents, sources = [], []
    for i, (offsets, sizes) in enumerate(boxes):
        if nudge is not None and nudge[0] == i:
            offsets = tuple(max(0, o + (nudge[2] if d == nudge[1] else 0)) for d, o in enumerate(offsets))
        sources.append(SourceBuffer(f"rank{i}", 0, prod(sizes) * 4, "float32"))
        extents += box_extents(i, 0, shape, offsets, sizes)
    return extents, sources


def exactly_once(shape, extents) -> bool:
    return all(c == 1 for c in element_counts(shape, extents))


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(tilings())
def test_a_tiling_passes(tiling):
    shape, boxes = tiling
    extents, sources = plan_of(shape, boxes)
    assert exactly_once(shape, extents)
    check_extents("t", shape, "float32", extents, sources)


@pytest.mark.slow
@settings(max_examples=500, deadline=None)
@given(tilings(), st.data())
def test_a_moved_or_dropped_box_is_caught_exactly_when_an_element_is_not_written_once(tiling, data):
    shape, boxes = tiling
    i = data.draw(st.integers(0, len(boxes) - 1))
    if data.draw(st.booleans()) and len(boxes) > 1:
        extents, sources = plan_of(shape, boxes[:i] + boxes[i + 1 :])
    else:
        nudge = (i, data.draw(st.integers(0, len(shape) - 1)), data.draw(st.integers(-3, 3)))
        extents, sources = plan_of(shape, boxes, nudge)
    if exactly_once(shape, extents):
        check_extents("t", shape, "float32", extents, sources)
    else:
        with pytest.raises(BadInput, match="^t: "):
            check_extents("t", shape, "float32", extents, sources)


# --- the native common case (csrc/plan_checks.h) against the Python check ----------------------

native_tile = getattr(_ops.native(), "extents_tile", None)
needs_native = pytest.mark.skipif(
    native_tile is None, reason="fsdpfast._native is not built, or older than extents_tile"
)


def native_sure(shape, extents, sources, dtype="float32") -> bool:
    numbers = Records.of(Extent, extents).numbers()
    return native_tile(numbers, array("q", [s.nbytes for s in sources]), prod(shape), itemsize(dtype))


def python_accepts(shape, extents, sources, dtype="float32") -> bool:
    try:
        check_extents("t", shape, dtype, extents, sources)
    except BadInput:
        return False
    return True


@pytest.mark.slow
@needs_native
@settings(max_examples=500, deadline=None)
@given(tilings(), st.data())
def test_the_native_check_is_sure_of_single_run_tilings_and_of_nothing_wrong(tiling, data):
    shape, boxes = tiling
    i = data.draw(st.integers(0, len(boxes) - 1))
    mutation = data.draw(st.sampled_from(["none", "drop", "nudge"]))
    if mutation == "drop" and len(boxes) > 1:
        extents, sources = plan_of(shape, boxes[:i] + boxes[i + 1 :])
    elif mutation == "nudge":
        nudge = (i, data.draw(st.integers(0, len(shape) - 1)), data.draw(st.integers(-3, 3)))
        extents, sources = plan_of(shape, boxes, nudge)
    else:
        extents, sources = plan_of(shape, boxes)
    accepted = python_accepts(shape, extents, sources)
    if native_sure(shape, extents, sources):
        assert accepted
    if accepted and all(e.runs == 1 for e in extents):
        assert native_sure(shape, extents, sources)


small = st.integers(-1, 9)


@pytest.mark.slow
@needs_native
@settings(max_examples=2000, deadline=None)
@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=2),
    st.lists(
        st.tuples(st.integers(-1, 3), small, small, small, st.sampled_from([0, 1, 1, 1, 2]), small, small), max_size=6
    ),
    st.lists(st.integers(0, 40), min_size=1, max_size=3),
    st.sampled_from(["float32", "bfloat16"]),
)
def test_the_native_check_is_never_sure_of_what_the_python_check_refuses(shape, fields, sizes, dtype):
    extents = [Extent(*f) for f in fields]
    sources = [SourceBuffer(f"r{i}", 0, n, dtype) for i, n in enumerate(sizes)]
    accepted = python_accepts(tuple(shape), extents, sources, dtype)
    if native_sure(tuple(shape), extents, sources, dtype):
        assert accepted
    elif accepted:  # only what it does not handle: strided runs
        assert any(e.runs > 1 and e.count for e in extents)


@needs_native
def test_the_native_check_handles_a_thousand_pieces_in_any_order():
    # a tensor of 2**20 elements in 1,024 pieces of 1,024, as a reader lists them and reversed
    total, pieces = 1 << 20, 1024
    extents = [Extent(r, 0, total // pieces, r * total // pieces) for r in range(pieces)]
    sources = [SourceBuffer(f"r{r}", 0, total // pieces * 2, "bfloat16") for r in range(pieces)]
    assert native_sure((total,), extents, sources, "bfloat16")
    assert native_sure((total,), extents[::-1], sources, "bfloat16")
    assert not native_sure((total,), extents[:-1], sources, "bfloat16")
    assert not native_sure((total + 1,), extents, sources, "bfloat16")
    assert not native_sure((total,), extents[:1] + extents, sources, "bfloat16")
    assert not native_sure((total,), extents, sources, "float32")  # each piece reads past its record


def test_strided_pieces_that_interleave_are_an_overlap():
    # Two column pieces of a (4, 6) tensor: columns 0..2 and 2..4 (one column shared) plus 5..5.
    shape, sources = (4, 6), [SourceBuffer("a", 0, 4 * 12 * 4, "float32")] * 3
    extents = [Extent(0, 0, 3, 0, 4, 3, 6), Extent(1, 0, 3, 2, 4, 3, 6), Extent(2, 0, 1, 5, 4, 1, 6)]
    with pytest.raises(BadInput, match="both hold element 2 "):
        check_extents("w", shape, "float32", extents, sources)


def test_a_piece_reading_past_its_record_is_refused():
    sources = [SourceBuffer("rank0.pt", 64, 8 * 4, "float32")]
    with pytest.raises(BadInput, match="rank0.pt: w reads 40 bytes from a record of 32"):
        check_extents("w", (10,), "float32", [Extent(0, 0, 10, 0)], sources)


def test_many_strided_rows_are_checked_without_walking_them():
    # Shard(1) of a (1_000_000, 64) tensor over 8 ranks: 8 extents of a million runs each.
    # The modulo-stride test settles it; walking 8 million runs would take seconds.
    rows, cols, world = 1_000_000, 64, 8
    width = cols // world
    sources = [SourceBuffer(f"r{r}", 0, rows * width * 2, "bfloat16") for r in range(world)]
    extents = [Extent(r, 0, width, r * width, rows, width, cols) for r in range(world)]
    check_extents("w", (rows, cols), "bfloat16", extents, sources)
    extents[3] = Extent(3, 0, width, 3 * width - 1, rows, width, cols)
    with pytest.raises(BadInput, match="overlap"):
        check_extents("w", (rows, cols), "bfloat16", extents, sources)
