"""The native conversions equal torch's Tensor.to() bit for bit, special values included.

torch's vectorised CPU kernels are the reference: they handle contiguous data whose length is
a multiple of the vector width, so references are computed on lengths that are multiples of 64
(torch's scalar tail writes other NaN bit patterns for a few trailing elements).
"""

from __future__ import annotations

import pytest
import torch

from fsdpfast import _ops

pytestmark = [
    pytest.mark.skipif(not _ops.torch_ops(), reason=f"torch ops not built: {_ops.torch_ops_error()}"),
    pytest.mark.torch_ops,
]

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
PAIRS = [(a, b) for a in FLOATS for b in FLOATS if a is not b]
_INT_VIEW = {4: torch.int32, 2: torch.int16}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_reference(x: torch.Tensor, to: torch.dtype) -> torch.Tensor:
    """x.to(to) computed on a copy padded to a multiple of 64 elements, then cut back."""
    pad = -x.numel() % 64
    padded = torch.cat([x, torch.zeros(pad, dtype=x.dtype)]) if pad else x
    return padded.to(to)[: x.numel()]


def native_gather_convert(x: torch.Tensor, to: torch.dtype, src_offset=0, dst_offset=0) -> torch.Tensor:
    """Convert with the CPU gather_convert op, reading and writing at element offsets."""
    n = x.numel() - src_offset
    out_size = torch.empty(0, dtype=to).element_size()
    out = torch.full(((n + dst_offset) * out_size,), 0xAB, dtype=torch.uint8)
    plan = torch.tensor(
        [
            [
                0,
                0,
                _ops.code(_name(x.dtype)),
                _ops.code(_name(to)),
                x.element_size(),
                out_size,
                src_offset,
                n,
                dst_offset,
                1,
                0,
                0,
            ]
        ],
        dtype=torch.int64,
    )
    _ops.gather_convert([x.view(torch.uint8)], [out], plan)
    return out[dst_offset * out_size :].view(to)


def native_file_convert(x: torch.Tensor, to: torch.dtype, src_offset=0, dst_offset=0) -> torch.Tensor:
    """Convert with the torch-free module's file writer (what the cpu engine runs), small chunks."""
    import tempfile
    from array import array

    n = x.numel() - src_offset
    out_size = torch.empty(0, dtype=to).element_size()
    row = [0, 0, _ops.code(_name(x.dtype)), _ops.code(_name(to)), x.element_size(), out_size, src_offset, n, 0, 1, 0, 0]
    with tempfile.TemporaryFile() as f:
        if n:
            _ops.native().gather_convert_to_file(
                [memoryview(x.view(torch.uint8).numpy())],
                array("q", row),
                array("q", [dst_offset * out_size]),
                array("q", [n * out_size]),
                f.fileno(),
                4096,
                2,
            )
        f.seek(dst_offset * out_size)
        data = bytearray(f.read())
    return torch.frombuffer(data, dtype=to) if data else torch.empty(0, dtype=to)


def scalar_convert(x: torch.Tensor, to: torch.dtype) -> torch.Tensor:
    """The element-by-element conversion the CUDA kernels run, executed on the CPU."""
    return _ops.convert_scalar(x.view(torch.uint8), _ops.code(_name(x.dtype)), _ops.code(_name(to))).view(to)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, source: torch.Tensor) -> None:
    got_bits = got.view(_INT_VIEW[got.element_size()])
    want_bits = want.view(_INT_VIEW[want.element_size()])
    bad = (got_bits != want_bits).nonzero().reshape(-1)
    src_bits = source.view(_INT_VIEW[source.element_size()])
    examples = [
        (hex(int(src_bits[i]) & 0xFFFFFFFF), hex(int(got_bits[i]) & 0xFFFFFFFF), hex(int(want_bits[i]) & 0xFFFFFFFF))
        for i in bad[:5]
    ]
    assert bad.numel() == 0, f"{bad.numel()} elements differ (source, got, torch): {examples}"


def every_16bit_value(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


def float32_specials() -> torch.Tensor:
    bits = [
        0x00000000,
        0x80000000,
        0x7F800000,
        0xFF800000,  # +-0, +-Inf
        0x7FC00000,
        0xFFC00000,
        0x7F800001,
        0xFFFFFFFF,
        0x7FBFFFFF,
        0x7FD55555,  # NaNs: quiet, signalling, payloads
        0x00000001,
        0x807FFFFF,
        0x00400000,
        0x00800000,  # float32 subnormals and the smallest normal
        0x3F808000,
        0x3F818000,
        0x3F808001,
        0x3F80FFFF,  # bfloat16 halfway cases: to even, to odd+1, above
        0x3F801000,
        0x3F803000,
        0x3F801001,  # float16 halfway cases
        0x477FE000,
        0x477FEFFF,
        0x477FF000,
        0x477FFFFF,
        0x7F7FFFFF,
        0xFF7FFFFF,  # float16 / bfloat16 overflow edges
        0x33000000,
        0x33000001,
        0x33800000,
        0x387FC000,
        0x387FE000,
        0x38800000,  # float16 subnormal edges
        0x7F7F8000,
        0x7F7F7FFF,  # bfloat16 overflow to Inf
    ]
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("target", FLOATS)
@pytest.mark.parametrize(
    "convert",
    [native_gather_convert, native_file_convert, scalar_convert],
    ids=["gather_convert", "file_writer", "scalar"],
)
def test_every_16bit_value(source, target, convert):
    if source is target:
        pytest.skip("same dtype")
    x = every_16bit_value(source)
    assert_same_bits(convert(x, target), torch_reference(x, target), x)


@pytest.mark.parametrize("target", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "convert",
    [native_gather_convert, native_file_convert, scalar_convert],
    ids=["gather_convert", "file_writer", "scalar"],
)
def test_float32_specials_and_random_bits(target, convert):
    generator = torch.Generator().manual_seed(7)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (1 << 21,), generator=generator, dtype=torch.int64).to(torch.int32)
    x = torch.cat([float32_specials(), random_bits.view(torch.float32)])
    assert_same_bits(convert(x, target), torch_reference(x, target), x)


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{_name(a)}-{_name(b)}" for a, b in PAIRS])
@pytest.mark.parametrize("length", [0, 1, 7, 63, 64, 1000, 65537, 200_003])
@pytest.mark.parametrize("offsets", [(0, 0), (1, 3), (5, 0)])
@pytest.mark.parametrize("convert", [native_gather_convert, native_file_convert], ids=["gather_convert", "file_writer"])
def test_lengths_and_unaligned_offsets(source, target, length, offsets, convert):
    src_offset, dst_offset = offsets
    generator = torch.Generator().manual_seed(length)
    x = (torch.randn(length + src_offset, generator=generator) * 1000).to(source)
    got = convert(x, target, src_offset, dst_offset)
    assert_same_bits(got, torch_reference(x[src_offset:], target), x[src_offset:])


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.bool, torch.float8_e4m3fn, torch.uint8, torch.float64, torch.int16]
)
def test_other_dtypes_are_copied_exactly(dtype):
    generator = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (8 * 1001,), generator=generator, dtype=torch.int64).to(torch.uint8)
    x = raw.view(dtype)
    size = x.element_size()
    out = torch.zeros_like(raw)
    plan = torch.tensor([[0, 0, 0, 0, size, size, 0, x.numel(), 0, 1, 0, 0]], dtype=torch.int64)
    _ops.gather_convert([raw], [out], plan)
    assert torch.equal(out, raw)


def test_strided_runs_land_like_a_slice_assignment():
    # A Shard(1) piece: 300 rows of 70 columns into columns 70..139 of a 300 x 210 tensor.
    local = torch.randn(300, 70)
    out = torch.zeros(300, 210, dtype=torch.bfloat16)
    plan = torch.tensor([[0, 0, 1, 2, 4, 2, 0, 70, 70, 300, 70, 210]], dtype=torch.int64)
    _ops.gather_convert([local.view(-1).view(torch.uint8)], [out.view(-1).view(torch.uint8)], plan)
    expected = torch.zeros(300, 210, dtype=torch.bfloat16)
    expected[:, 70:140] = local.to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_out_of_bounds_plans_are_refused():
    src = torch.zeros(16, dtype=torch.uint8)
    dst = torch.zeros(16, dtype=torch.uint8)
    plan = torch.tensor([[0, 0, 1, 1, 4, 4, 2, 3, 0, 1, 0, 0]], dtype=torch.int64)  # reads elements 2..4 of 4
    with pytest.raises(RuntimeError, match="reads past"):
        _ops.gather_convert([src], [dst], plan)
    plan = torch.tensor([[0, 1, 1, 1, 4, 4, 0, 1, 0, 1, 0, 0]], dtype=torch.int64)  # no destination 1
    with pytest.raises(RuntimeError, match="bad destination"):
        _ops.gather_convert([src], [dst], plan)
