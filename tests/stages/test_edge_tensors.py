"""Edge tensors: zero-size, 0-d, unicode names, views into shared storage, non-contiguous pieces,
and offsets past 4 GiB (sparse files keep those cheap).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from helpers import assert_bit_exact, bits, read_merged
from refusals import cli_refuses
from safetensors import safe_open

import fsdpfast
from fsdpfast.execute.engines import select_engine
from fsdpfast.execute.writer import write_file
from fsdpfast.io.sources import SourceFiles
from fsdpfast.plan.layout import OutputFile, plan_files
from fsdpfast.plan.model import Extent, MergePlan, SourceBuffer, TensorPlan

ENGINES = ["cpu", "torch"]


# --- a real FSDP2 checkpoint of odd tensors ---------------------------------------------------


class OddTensors(torch.nn.Module):
    """Parameters FSDP2 shards (unicode names, zero rows, uneven rows) and buffers every rank holds whole."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(5)
        self.register_parameter("权重", torch.nn.Parameter(torch.randn(7, 4, generator=generator)))
        self.register_parameter("leer", torch.nn.Parameter(torch.empty(0, 4)))
        self.register_parameter("größe_ß", torch.nn.Parameter(torch.randn(3, generator=generator)))
        self.register_buffer("skalar", torch.tensor(2.5))  # 0-d
        self.register_buffer("nichts", torch.empty(0, 3, dtype=torch.int64))
        self.register_buffer("zähler", torch.tensor(7, dtype=torch.int64))


def _write_odd_rank(rank: int, world: int, port: int, folder: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = OddTensors()
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        state = model.state_dict()
        ranks = os.path.join(folder, "ranks")
        os.makedirs(ranks, exist_ok=True)
        torch.save(state, os.path.join(ranks, f"model_world_size_{world}_rank_{rank}.pt"))
        dcp.save(state, checkpoint_id=os.path.join(folder, "dcp"))
        full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}
        if rank == 0:
            torch.save(full, os.path.join(folder, "reference.pt"))
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def odd_checkpoint(tmp_path_factory) -> Path:
    import torch.multiprocessing as mp

    from fsdpfast._testing.fsdp2_writer import _free_port

    folder = tmp_path_factory.mktemp("odd")
    mp.spawn(_write_odd_rank, args=(2, _free_port(), str(folder)), nprocs=2, join=True)
    return folder


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["ranks", "dcp"])
@pytest.mark.parametrize("engine", ENGINES)
def test_zero_size_scalar_and_unicode_tensors_merge_bit_exact(odd_checkpoint, tmp_path, layout, engine):
    reference = torch.load(odd_checkpoint / "reference.pt", weights_only=True)
    assert reference["leer"].shape == (0, 4) and reference["skalar"].dim() == 0  # the edges are really there
    out = tmp_path / "merged"
    fsdpfast.merge(odd_checkpoint / layout, out, engine=engine)
    merged = read_merged(out)
    assert_bit_exact(merged, reference)
    header = _header(out / "model.safetensors")
    assert header["skalar"]["shape"] == [] and header["leer"]["shape"] == [0, 4]
    assert header["leer"]["data_offsets"][0] == header["leer"]["data_offsets"][1]


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


# --- views: shared storage, offsets, strides --------------------------------------------------


def test_contiguous_views_into_one_storage_merge_bit_exact(tmp_path):
    # A fused qkv weight saved as three views of one storage (storage offsets 0, 16, 32).
    folder = tmp_path / "ckpt"
    folder.mkdir()
    qkv = torch.arange(48, dtype=torch.float32).reshape(12, 4)
    state = {"q": qkv[0:4], "k": qkv[4:8], "v": qkv[8:12], "row": qkv[5]}
    torch.save(state, folder / "model_world_size_1_rank_0.pt")
    out = tmp_path / "merged"
    fsdpfast.merge(folder, out)
    assert_bit_exact(read_merged(out), {k: v.contiguous() for k, v in state.items()})


@pytest.mark.parametrize("view", ["transposed", "every other column"])
def test_non_contiguous_pieces_are_refused_with_their_name(tmp_path, view):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    odd = base.t() if view == "transposed" else base[:, ::2]
    assert not odd.is_contiguous()
    torch.save({"fine": base[0:2], "odd.weight": odd}, folder / "model_world_size_1_rank_0.pt")
    cli_refuses(folder, tmp_path / "merged", mentions=["odd.weight", "not contiguous"])


# --- past 4 GiB -------------------------------------------------------------------------------

FOUR_GIB = 1 << 32


def _disk_room(path: Path, needed: int) -> None:
    stats = os.statvfs(path)
    if stats.f_bavail * stats.f_frsize < needed:
        pytest.skip(f"needs {needed / 2**30:.1f} GiB free on {path}")


def _fill(path: Path, record_offset: int, element_offset: int, values: torch.Tensor) -> None:
    with open(path, "r+b") as f:
        f.seek(record_offset + element_offset * values.element_size())
        f.write(values.numpy().tobytes())


def _record_offset(path: Path, key: str) -> int:
    from fsdpfast._parsing.torch_zip import TorchZip

    with TorchZip(str(path)) as archive:
        return archive.storage_span(key)[0]


def test_a_tensor_stored_past_4_gib_of_the_file_is_read_from_the_right_offset(tmp_path):
    # torch.save with skip_data writes the zip (zip64) with holes where the bytes go: a 5 GiB
    # sparse rank file whose optimizer state comes first, the model's weight after it.
    _disk_room(tmp_path, 64 << 20)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    path = folder / "model_pt_rank_0.pt"
    big = torch.empty(5 * 2**30 // 4, dtype=torch.float32)  # never touched: no memory used
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4) - 5.5
    payload = {
        "optimizer_state": {"exp_avg": big},
        "state_dict": {"w": torch.empty(3, 4)},
        "metadata": {"world_size": 1},
    }
    with torch.serialization.skip_data():
        torch.save(payload, path)
    if path.stat().st_blocks * 512 > 64 << 20:
        pytest.skip("this filesystem does not keep files sparse")
    offset = _record_offset(path, "1")
    assert offset > FOUR_GIB + 2**30
    _fill(path, offset, 0, weight)
    for engine in ENGINES:
        out = tmp_path / f"merged-{engine}"
        fsdpfast.merge(folder, out, engine=engine)
        assert torch.equal(bits(read_merged(out)["w"]), bits(weight))


@pytest.mark.parametrize("engine", ENGINES)
def test_output_offsets_past_4_gib_are_written_where_the_header_says(tmp_path, engine):
    # A plan whose header places a small tensor after a 4.25 GiB one, executed on a small window:
    # only the small tensor is written, into a sparse output file (the torch engine reserves the
    # whole file first, see execute/sinks.py, so it needs the room without using it).
    _disk_room(tmp_path, 5 * 2**30 if engine == "torch" else 64 << 20)
    values = torch.arange(1000, dtype=torch.float32) * 0.25
    source_path = tmp_path / "source.bin"
    source_path.write_bytes(values.numpy().tobytes())
    sources = [SourceBuffer(str(source_path), 0, 4000, "float32")]
    huge = TensorPlan("a.huge", (17 * 2**27,), "bfloat16", "bfloat16", [])  # 4.25 GiB, not written
    small = TensorPlan("b.small", (10, 100), "float32", "bfloat16", [Extent(0, 0, 1000, 0)])
    (planned,) = plan_files(MergePlan("test", 1, sources, [huge, small]), max_shard_size="100GB")
    window = OutputFile(planned.name, planned.header, [p for p in planned.tensors if p.tensor is small], planned.size)
    (placed,) = window.tensors
    assert placed.offset > FOUR_GIB
    path = tmp_path / "model.safetensors"
    with SourceFiles(sources) as files:
        write_file(str(path), window, select_engine(engine), files)
    assert path.stat().st_size == planned.size > FOUR_GIB
    if engine == "cpu":
        assert path.stat().st_blocks * 512 < 64 << 20
    with safe_open(str(path), framework="pt") as f:
        assert torch.equal(bits(f.get_tensor("b.small")), bits(values.to(torch.bfloat16).reshape(10, 100)))
        assert f.get_slice("a.huge").get_shape() == [17 * 2**27]


BIG = os.environ.get("FSDPFAST_BIG_TESTS") == "1"


@pytest.mark.skipif(not BIG, reason="writes 4.4 GB; run with FSDPFAST_BIG_TESTS=1")
def test_a_tensor_over_4_gib_merges_end_to_end(tmp_path):
    # 2**30 + 2**20 + 3 float32 elements (4.0 GiB + 4 MiB, odd count), sparse in the rank file,
    # with values set at the edges and around the 2**31-byte and 4 GiB marks, merged as it is.
    _disk_room(tmp_path, 5 * 2**30)
    n = 2**30 + 2**20 + 3
    folder = tmp_path / "ckpt"
    folder.mkdir()
    path = folder / "model_world_size_1_rank_0.pt"
    with torch.serialization.skip_data():
        torch.save({"big": torch.empty(n, dtype=torch.float32), "tail": torch.empty(4, dtype=torch.float32)}, path)
    marks = [0, 1, 2**29 - 1, 2**29, 2**30 - 1, 2**30, 2**30 + 1, n - 2, n - 1]
    big_offset, tail_offset = _record_offset(path, "0"), _record_offset(path, "1")
    for i, element in enumerate(marks):
        _fill(path, big_offset, element, torch.tensor([i + 0.5], dtype=torch.float32))
    tail = torch.tensor([1.0, -2.0, 3.5, float("inf")])
    _fill(path, tail_offset, 0, tail)
    out = tmp_path / "merged"
    fsdpfast.merge(folder, out, engine="cpu")
    header = _header(out / "model.safetensors")
    assert header["big"]["data_offsets"] == [0, 4 * n] and header["tail"]["data_offsets"] == [4 * n, 4 * n + 16]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        big = f.get_slice("big")
        for i, element in enumerate(marks):
            assert big[element : element + 1].item() == i + 0.5, element
        assert big[12345:12349].abs().sum().item() == 0
        assert torch.equal(bits(f.get_tensor("tail")), bits(tail))
