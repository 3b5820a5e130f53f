"""A tensor written transposed (plan.windows.Windows.transposed, execute.transposed), on its own: each
matrix of a window written with its rows and columns swapped, bit for bit torch's
`.transpose(-2, -1).contiguous()` (then `.to(dtype)`), whether a matrix is one run of one source
file (the kernel reads the mapping) or cut between files and runs (gathered first), on the native
and torch engines and a matrix at a time into a file; what cannot be transposed is refused."""

from __future__ import annotations

import pytest
import torch

from fsdpfast import _ops
from fsdpfast.errors import BadInput
from fsdpfast.execute.parts import slice_tensor
from fsdpfast.execute.transposed import fill_transposed, interleaved_block, write_transposed
from fsdpfast.io.local_file import LocalFile
from fsdpfast.io.sources import SourceFiles
from fsdpfast.plan.layout import PlacedTensor
from fsdpfast.plan.model import Extent, SourceBuffer, TensorPlan, Transposed
from fsdpfast.plan.windows import Window, Windows

SHAPE = (3, 10, 7)  # three experts of 10 x 7


def packed(tmp_path, dtype, cut: int):
    """A [3, 10, 7] tensor saved as two raw files cut at element `cut`, and its plan."""
    value = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5)).to(dtype)
    flat = value.reshape(-1)
    paths = [tmp_path / "a.bin", tmp_path / "b.bin"]
    for path, part in zip(paths, (flat[:cut], flat[cut:])):
        path.write_bytes(part.contiguous().view(torch.uint8).numpy().tobytes())
    name = str(dtype).removeprefix("torch.")
    sources = [SourceBuffer(str(p), 0, p.stat().st_size, name) for p in paths]
    extents = [Extent(0, 0, cut, 0), Extent(1, 0, flat.numel() - cut, cut)]
    return value, sources, TensorPlan("experts", SHAPE, name, name, extents)


def as_written(tensor: TensorPlan, target: torch.dtype) -> TensorPlan:
    return TensorPlan(
        tensor.name,
        tensor.shape,
        tensor.source_dtype,
        str(target).removeprefix("torch."),
        tensor.extents,
        compute=tensor.compute,
    )


@pytest.mark.skipif(not _ops.native_cpu(), reason="the native module is not built")
@pytest.mark.parametrize("cut", [70, 75, 210], ids=["between-matrices", "inside-a-matrix", "one-file"])
@pytest.mark.parametrize(
    "source,target",
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float16),
        (torch.float64, torch.bfloat16),
    ],
    ids=str,
)
def test_every_matrix_written_transposed(tmp_path, cut, source, target):
    value, buffers, tensor = packed(tmp_path, source, min(cut, 209))
    made = Windows([tensor]).transposed("experts.t", Window("experts", (0, 0, 0), SHAPE, (0, 0, 0)))
    assert made.shape == (3, 7, 10) and isinstance(made.compute, Transposed)
    made = as_written(made, target)
    want = value.transpose(-2, -1).contiguous().to(target).view(-1).view(torch.uint8)
    with SourceFiles(buffers) as sources:
        memory = bytearray(want.numel())
        fill_transposed(made, memoryview(memory), sources)
        assert bytes(memory) == want.numpy().tobytes()
        with LocalFile.create(str(tmp_path / "out.bin"), 8 + want.numel()) as file:
            crc = write_transposed(file, PlacedTensor(made, 8, want.numel()), sources)
    assert (tmp_path / "out.bin").read_bytes()[8:] == want.numpy().tobytes()
    assert crc == _ops.crc32c(want.numpy().tobytes())


def test_a_window_of_one_expert_transposed(tmp_path):
    value, buffers, tensor = packed(tmp_path, torch.float32, 100)
    made = Windows([tensor]).transposed("one", Window("experts", (1, 2, 0), (1, 5, 7), (0, 0, 0)))
    assert made.shape == (1, 7, 5)
    with SourceFiles(buffers) as sources:
        memory = bytearray(made.numel * 4)
        fill_transposed(made, memoryview(memory), sources)
    assert bytes(memory) == value[1:2, 2:7].transpose(-2, -1).contiguous().numpy().tobytes()


def test_what_cannot_be_transposed_is_refused(tmp_path):
    _, _, tensor = packed(tmp_path, torch.float32, 100)
    flat = TensorPlan("flat", (210,), "float32", "float32", tensor.extents)
    with pytest.raises(BadInput, match="two dimensions"):
        Windows([flat]).transposed("x", Window("flat", (0,), (210,), (0,)))
    with pytest.raises(BadInput, match="does not fit"):
        Windows([tensor]).transposed("x", Window("experts", (0, 0, 0), (4, 10, 7), (0, 0, 0)))
    holed = TensorPlan("holed", SHAPE, "float32", "float32", tensor.extents[:1])
    with pytest.raises(BadInput, match="incomplete"):
        Windows([holed]).transposed("x", Window("holed", (0, 0, 0), SHAPE, (0, 0, 0)))


@pytest.mark.skipif(not _ops.native_cpu(), reason="the native module is not built")
@pytest.mark.parametrize("source,target", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)], ids=str)
@pytest.mark.parametrize(
    "groups,files,stepped",
    [(2, 2, True), (2, 2, False), (2, 1, True), (3, 1, True), (3, 1, False), (0, 2, False)],
    ids=[
        "gate-up-two-chunks",
        "gate-up-two-chunks-by-row",
        "gate-up-one-chunk",
        "three-groups",
        "three-groups-by-row",
        "rows-reversed",
    ],
)
def test_rows_dealt_from_blocks_written_transposed(tmp_path, source, target, groups, files, stepped):
    """gpt-oss's gate_up_proj from Megatron's fc1: the rows of each expert's blocks (gate, up: chunks of their
    own in megatron-core's files, here files=2) dealt out in turn (gate row j at 2j, up row j at 2j + 1), then
    transposed: the native way (a transpose per block, then one across them) equals torch's, and rows in
    another order (reversed: gathered first) too; the blocks as windows of every groups-th row (stepped, as
    readers.megatron_names makes them) or a window per row."""
    experts, rows, cols = 3, 12, 7
    value = torch.randn((experts, rows, cols), generator=torch.Generator().manual_seed(9)).to(source)
    name, half = str(source).removeprefix("torch."), rows // files * cols
    buffers, extents = [], []
    for f in range(files):  # file f: every expert's rows [f * rows / files, (f + 1) * rows / files)
        path = tmp_path / f"fc1_{f}.bin"
        path.write_bytes(
            value[:, f * rows // files : (f + 1) * rows // files].contiguous().view(torch.uint8).numpy().tobytes()
        )
        buffers.append(SourceBuffer(str(path), 0, path.stat().st_size, name))
        extents += [Extent(f, e * half, half, e * rows * cols + f * half) for e in range(experts)]
    fc1 = TensorPlan("fc1", value.shape, name, name, extents)
    order = [(i % groups) * (rows // groups) + i // groups for i in range(rows)] if groups else list(range(rows))[::-1]
    windows = [Window("fc1", (0, r, 0), (experts, 1, cols), (0, i, 0)) for i, r in enumerate(order)]
    if stepped:
        per = rows // groups
        windows = [
            Window("fc1", (0, k * per, 0), (experts, per, cols), (0, k, 0), (1, groups, 1)) for k in range(groups)
        ]
    made = as_written(Windows([fc1]).transposed_of("gate_up", (experts, rows, cols), windows), target)
    second = slice_tensor(made, rows * cols, 2 * rows * cols)
    assert (interleaved_block(second, rows, cols) is not None) == bool(groups)
    if stepped:  # a strided extent a block's chunk and expert at most (one a row by row: experts * rows)
        assert len(made.extents) <= experts * max(groups, files)
    want = value[:, order].transpose(-2, -1).contiguous().to(target).view(-1).view(torch.uint8).numpy().tobytes()
    with SourceFiles(buffers) as sources:
        memory = bytearray(len(want))
        fill_transposed(made, memoryview(memory), sources)
        assert bytes(memory) == want
        with LocalFile.create(str(tmp_path / "out.bin"), len(want)) as file:
            crc = write_transposed(file, PlacedTensor(made, 0, len(want)), sources)
    assert (tmp_path / "out.bin").read_bytes() == want and crc == _ops.crc32c(want)
