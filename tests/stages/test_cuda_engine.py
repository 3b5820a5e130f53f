"""The CUDA ops and engine equal torch's CPU Tensor.to() bit for bit (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from test_native_convert import PAIRS, _name, assert_same_bits, every_16bit_value, float32_specials, torch_reference

import fsdpfast
from fsdpfast import _ops
from fsdpfast.io.sources import SourceFiles
from fsdpfast.plan.model import Extent, SourceBuffer, TensorPlan

pytestmark = [
    pytest.mark.skipif(not _ops.native_cuda(), reason="needs the CUDA ops and a GPU"),
    pytest.mark.gpu,
    pytest.mark.torch_ops,
]


def device_convert(x: torch.Tensor, to: torch.dtype) -> torch.Tensor:
    src = x.view(torch.uint8).cuda()
    out_size = torch.empty(0, dtype=to).element_size()
    out = torch.empty(x.numel() * out_size, dtype=torch.uint8, device="cuda")
    plan = torch.tensor(
        [[0, 0, _ops.code(_name(x.dtype)), _ops.code(_name(to)), x.element_size(), out_size, 0, x.numel(), 0, 1, 0, 0]],
        dtype=torch.int64,
    )
    _ops.gather_convert([src], [out], plan)
    return out.cpu().view(to)


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{_name(a)}-{_name(b)}" for a, b in PAIRS])
def test_device_kernel_on_every_16bit_value_and_float32_specials(source, target):
    if source is torch.float32:
        generator = torch.Generator().manual_seed(11)
        bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=generator, dtype=torch.int64).to(torch.int32)
        x = torch.cat([float32_specials(), bits.view(torch.float32)])
    else:
        x = every_16bit_value(source)
    assert_same_bits(device_convert(x, target), torch_reference(x, target), x)


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{_name(a)}-{_name(b)}" for a, b in PAIRS])
def test_device_kernel_on_views_at_odd_byte_offsets(source, target):
    # Byte views may start anywhere in a device buffer; 2- and 4-byte accesses there would fault.
    x = (torch.randn(10_001, generator=torch.Generator().manual_seed(3)) * 100).to(source)
    out_size = torch.empty(0, dtype=target).element_size()
    src = torch.zeros(x.numel() * x.element_size() + 1, dtype=torch.uint8, device="cuda")
    src[1:] = x.view(torch.uint8).cuda()
    out = torch.zeros(x.numel() * out_size + 3, dtype=torch.uint8, device="cuda")
    plan = torch.tensor(
        [
            [
                0,
                0,
                _ops.code(_name(x.dtype)),
                _ops.code(_name(target)),
                x.element_size(),
                out_size,
                0,
                x.numel(),
                0,
                1,
                0,
                0,
            ]
        ],
        dtype=torch.int64,
    )
    _ops.gather_convert([src[1:]], [out[3:]], plan)
    assert_same_bits(out[3:].cpu().view(target), torch_reference(x, target), x)
    assert out[:3].cpu().tolist() == [0, 0, 0]


@pytest.mark.slow
def test_staging_is_one_allocation_kept_across_merges(checkpoints, tmp_path):
    from fsdpfast.execute import cuda

    _, folder = checkpoints.get("w3-bert-dim1")
    fsdpfast.merge(folder, tmp_path / "first", dtype="bf16", engine="cuda")
    kept = cuda._staging[torch.cuda.current_device()]
    fsdpfast.merge(folder, tmp_path / "second", dtype="bf16", engine="cuda")
    assert cuda._staging[torch.cuda.current_device()] is kept and kept.pinned.is_pinned()
    assert kept.pinned.numel() < cuda._Staging.nbytes(cuda.SLOTS, cuda.STAGING_BYTES)  # a tiny model pins little


def _staged(tmp_path, x: torch.Tensor, to: torch.dtype, staging_bytes: int, runs: int = 1) -> torch.Tensor:
    """Run the staged pipeline on a file-backed source through tiny staging buffers."""
    from fsdpfast.execute.cuda import CudaEngine

    path = tmp_path / "source.bin"
    path.write_bytes(b"\0" * 24 + x.view(torch.uint8).numpy().tobytes())
    count = x.numel() // runs
    buffer = SourceBuffer(str(path), 24, x.numel() * x.element_size(), _name(x.dtype))
    plan = TensorPlan("t", (runs, count), _name(x.dtype), _name(to), [Extent(0, 0, count, 0, runs, count, count)])
    out = bytearray(x.numel() * torch.empty(0, dtype=to).element_size())
    with SourceFiles([buffer]) as sources:
        CudaEngine(staging_bytes=staging_bytes, slots=2).execute([(plan, memoryview(out))], sources)
    return torch.frombuffer(out, dtype=to)


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{_name(a)}-{_name(b)}" for a, b in PAIRS])
@pytest.mark.parametrize("staging_bytes", [4096, 1 << 20])
def test_staged_pipeline_crosses_staging_buffer_boundaries(tmp_path, source, target, staging_bytes):
    generator = torch.Generator().manual_seed(5)
    x = (torch.randn(300_007, generator=generator) * 100).to(source)
    assert_same_bits(_staged(tmp_path, x, target, staging_bytes), torch_reference(x, target), x)


def test_staged_pipeline_strided_runs(tmp_path):
    x = torch.randn(64 * 999)
    got = _staged(tmp_path, x, torch.bfloat16, 4096, runs=64)
    assert_same_bits(got, torch_reference(x, torch.bfloat16), x)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["keep", "bf16", "fp16"])
def test_cuda_engine_merge_is_byte_identical_to_torch_engine(checkpoints, tmp_path, dtype):
    _, folder = checkpoints.get("w3-bert-dim1")
    fsdpfast.merge(folder, tmp_path / "torch", dtype=dtype, engine="torch")
    report = fsdpfast.merge(folder, tmp_path / "cuda", dtype=dtype, engine="cuda")
    assert report.engine == "cuda"
    assert (tmp_path / "torch" / "model.safetensors").read_bytes() == (
        tmp_path / "cuda" / "model.safetensors"
    ).read_bytes()
