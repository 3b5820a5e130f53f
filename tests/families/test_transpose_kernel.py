"""The transposed copy (csrc/transpose.cpp, csrc/cuda/transpose.cu): torch.ops.fsdpfast.transposed and
transpose_copy, and _native.transpose_convert, bit for bit what torch's `.transpose(-2, -1).contiguous()`
(then `.to(dtype)`) gives, for every element size, odd shapes (tiles cut anywhere) and the float casts;
opcheck of both ops. Runs on CUDA too when a GPU and the CUDA ops are there."""

from __future__ import annotations

import pytest
import torch

from fsdpfast import _ops

pytestmark = [
    pytest.mark.torch_ops,
    pytest.mark.skipif(not _ops.torch_ops(), reason=f"fsdpfast torch ops not built: {_ops.torch_ops_error()}"),
]

CUDA_RUNS = torch.cuda.is_available() and _ops.native_cuda_built()
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA_RUNS, reason="needs a GPU and the CUDA ops")],
    ),
]
DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,  # 16-byte elements: the CPU's byte-wise tiles (refused on the GPU)
]
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [
    (1, 1),
    (3, 5),
    (64, 64),
    (65, 67),
    (1, 130),
    (130, 1),
    (2, 129, 63),
    (3, 1, 7),
    (2, 2, 33, 31),
    (0, 4),
    (4, 0),
]


def sample(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex or dtype.is_floating_point:
        return (
            torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
            if not dtype.is_complex
            else torch.randn(shape, generator=g, dtype=dtype)
        )
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def specials(dtype) -> torch.Tensor:
    """NaNs with payloads, infinities, subnormals, signed zeros, values that round to even: a 16 x 9 matrix."""
    bits = torch.randint(0, 1 << 31, (16, 9), generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    values = bits.to(torch.int32).view(torch.float32)
    extra = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 65520.0, 1.00390625, 3.0e38])
    values[0] = extra
    values[1] = (
        torch.tensor([0x7FC00001, 0x7F800001, 0xFFC12345, 0x00000001, 0x33800000, 0x387FE000, 0x477FF000, 1, 2])
        .to(torch.int32)
        .view(torch.float32)
    )
    return values.to(dtype)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (
        got.dtype == want.dtype
        and got.shape == want.shape
        and torch.equal(
            got.cpu().contiguous().view(-1).view(torch.uint8), want.cpu().contiguous().view(-1).view(torch.uint8)
        )
    )


def skip_on_gpu_if_unhandled(device, dtype):
    if device == "cuda" and dtype.itemsize > 8:
        pytest.skip("16-byte elements are transposed on the CPU only")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_transposed_equals_torch(device, dtype, shape):
    skip_on_gpu_if_unhandled(device, dtype)
    x = sample(shape, dtype).to(device)
    assert same_bits(torch.ops.fsdpfast.transposed(x), x.transpose(-2, -1).contiguous())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("source", FLOATS, ids=str)
@pytest.mark.parametrize("target", FLOATS, ids=str)
@pytest.mark.parametrize("shape", [(65, 67), (2, 129, 63), (16, 9)], ids=str)
def test_transposed_casts_as_torch_does(device, source, target, shape):
    x = (specials(source) if shape == (16, 9) else sample(shape, source, seed=1)).to(device)
    want = x.cpu().transpose(-2, -1).contiguous().to(target)  # torch's CPU casts: the engines' reference
    assert same_bits(torch.ops.fsdpfast.transposed(x, target), want)


@pytest.mark.parametrize("device", DEVICES)
def test_transpose_copy_writes_into_the_destination(device):
    x = sample((3, 70, 45), torch.bfloat16).to(device)
    out = torch.empty((3, 45, 70), dtype=torch.float32, device=device)
    torch.ops.fsdpfast.transpose_copy(x, out)
    assert same_bits(out, x.cpu().transpose(-2, -1).contiguous().float())


@pytest.mark.parametrize("device", DEVICES)
def test_refusals(device):
    x = torch.zeros((4, 6), device=device)
    with pytest.raises(RuntimeError, match="destination must be"):
        torch.ops.fsdpfast.transpose_copy(x, torch.zeros((4, 6), device=device))
    with pytest.raises(RuntimeError, match="converts between float32, bfloat16 and float16 only"):
        torch.ops.fsdpfast.transpose_copy(x, torch.zeros((6, 4), dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match="two dimensions"):
        torch.ops.fsdpfast.transposed(torch.zeros(5, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = sample((2, 33, 17), torch.bfloat16).to(device)
    torch.library.opcheck(torch.ops.fsdpfast.transposed.default, (x,))
    torch.library.opcheck(torch.ops.fsdpfast.transposed.default, (x,), {"dtype": torch.float32})
    out = torch.empty((2, 17, 33), dtype=torch.float16, device=device)
    torch.library.opcheck(torch.ops.fsdpfast.transpose_copy.default, (x, out))


@pytest.mark.skipif(not _ops.native_cpu(), reason="the native module is not built")
@pytest.mark.parametrize("source", FLOATS + [torch.int64], ids=str)
@pytest.mark.parametrize("target", FLOATS + [torch.int64], ids=str)
def test_native_module_without_torch_ops(source, target):
    """_native.transpose_convert (the native CPU engine's, torch-free) on plain buffers."""
    if (source == torch.int64) != (target == torch.int64):
        pytest.skip("integers are copied, not cast")
    x = sample((3, 67, 129), source, seed=2)
    out = torch.empty((3, 129, 67), dtype=target)
    code = lambda dtype: 0 if source == target else _ops.code(str(dtype).removeprefix("torch."))  # noqa: E731
    _ops.native().transpose_convert(
        x.view(-1).view(torch.uint8).numpy(),
        out.view(-1).view(torch.uint8).numpy(),
        3,
        67,
        129,
        code(source),
        code(target),
        source.itemsize,
        target.itemsize,
        threads=2,
    )
    assert same_bits(out, x.transpose(-2, -1).contiguous().to(target))
    with pytest.raises(ValueError, match="smaller than the matrices"):
        _ops.native().transpose_convert(x.view(-1).view(torch.uint8).numpy(), bytearray(10), 3, 67, 129, 0, 0, 8, 8)
