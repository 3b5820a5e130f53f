"""torch.ops.fsdpfast.fp8_block_quantize against transformers' fine-grained FP8 quantizer, bit for bit.

The anchor is transformers' own Fp8Quantize._quantize_one (integrations/finegrained_fp8.py), called on
the whole tensor. It passes through shapes that are not whole 128x128 blocks; for those (partial blocks,
which the op quantizes with one scale each, as vLLM's loaders expect) the reference is the anchor's
function on the tensor zero-padded to whole blocks, the padding cropped off: zeros change no amax.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from fp8_anchor import anchor

from fsdpfast import _ops

pytestmark = [
    pytest.mark.torch_ops,
    pytest.mark.skipif(not _ops.torch_ops(), reason=f"fsdpfast torch ops not built: {_ops.torch_ops_error()}"),
]
finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")

CUDA_RUNS = torch.cuda.is_available() and _ops.native_cuda_built()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA_RUNS, reason="needs a GPU")]),
]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))
    )


def weights(kind: str, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{kind}{shape}{dtype}".encode()))
    w = torch.randn(shape, generator=g, dtype=torch.float32)
    if kind == "zero":
        w.zero_()
    elif kind == "zero_blocks":  # whole blocks of zeros beside random ones
        w[..., :128, :128] = 0
    elif kind == "tiny":  # subnormal float32 amaxes: 448 / amax overflows to inf in the anchor too
        w *= 1e-41 if dtype == torch.float32 else 1e-38
    elif kind == "huge":
        w *= 3e38 if dtype == torch.float32 else 1e38
    elif kind == "wide":  # a spread of magnitudes inside each block: many float8 subnormals and ties
        w *= torch.exp2(torch.randint(-30, 10, shape, generator=g).float())
    return w.to(dtype)


SHAPES = [(256, 384), (128, 128), (300, 200), (1, 5), (2, 130, 257), (3, 128, 256)]
KINDS = ["random", "zero", "zero_blocks", "tiny", "huge", "wide"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_equals_transformers_quantizer(kind, shape, dtype, device):
    if dtype == torch.float16 and kind in ("tiny", "huge"):
        pytest.skip("float16 cannot hold these magnitudes")
    w = weights(kind, shape, dtype)
    got_q, got_s = _ops.fp8_block_quantize(w.to(device))
    want_q, want_s = anchor(w)
    assert same_bits(got_q, want_q)
    assert same_bits(got_s, want_s)


def test_non_contiguous_and_other_blocks():
    w = weights("wide", (96, 160), torch.bfloat16)
    q, s = _ops.fp8_block_quantize(w.t(), 32, 64)  # transposed view: quantized as the tensor it shows
    rq, rs = _ops.fp8_block_quantize(w.t().contiguous(), 32, 64)
    assert same_bits(q, rq) and same_bits(s, rs) and s.shape == (5, 2)


def test_dequantized_close():
    w = weights("random", (256, 384), torch.float32)
    q, s = _ops.fp8_block_quantize(w)
    back = q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.allclose(back, w, rtol=2**-3, atol=s.max().item() * 2**-9)  # e4m3: 3 mantissa bits


def test_refuses_what_it_cannot_quantize():
    with pytest.raises(RuntimeError, match="2 or more dimensions"):
        _ops.fp8_block_quantize(torch.ones(5))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        _ops.fp8_block_quantize(torch.ones(4, 4, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    w = weights("random", (2, 130, 257), torch.bfloat16).to(device)
    torch.library.opcheck(torch.ops.fsdpfast.fp8_block_quantize.default, (w, 128, 128))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_vectorised_cpu_kernel_equals_the_scalar_one(kind, dtype):
    """The CPU kernel (lanes, a branch-free float8 cast) against the scalar one it replaced, kept as an op
    to measure beside it: the same bytes, NaN and infinities included, on partial blocks and small widths."""
    if dtype == torch.float16 and kind in ("tiny", "huge"):
        pytest.skip("float16 cannot hold these magnitudes")
    for shape in [(300, 200), (2, 130, 257), (129, 3)]:
        w = weights(kind, shape, dtype)
        w.view(-1)[7] = float("nan")
        w.view(-1)[-1] = float("-inf")
        got = torch.ops.fsdpfast.fp8_block_quantize(w, 128, 128)
        want = torch.ops.fsdpfast.fp8_block_quantize_scalar(w, 128, 128)
        assert same_bits(got[0], want[0]) and same_bits(got[1], want[1]), shape
