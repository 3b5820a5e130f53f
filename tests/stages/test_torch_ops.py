"""Every torch op of the extension (torch.ops.fsdpfast.*) equals a pure-torch reference and passes opcheck.

One class per op, each with the same parts: the op, `sample_inputs(device)`, `reference(*args)` (what
the op returns, or what it leaves in the tensors it writes, computed with plain torch), a correctness
test and a `torch.library.opcheck` test (schema, fake tensors, functionalised graphs). They run on the
CPU and, when a GPU and the CUDA ops are there, on CUDA; an op is checked on the devices it has
implementations for. The bit-for-bit checks against torch's own conversions (NaNs, every 16-bit value)
and against peft's merges are in test_native_convert.py, test_cuda_engine.py and test_lora_merge_op.py.
"""

from __future__ import annotations

import pytest
import torch

from fsdpfast import _ops

pytestmark = [
    pytest.mark.torch_ops,
    pytest.mark.skipif(not _ops.torch_ops(), reason=f"fsdpfast torch ops not built: {_ops.torch_ops_error()}"),
]

CUDA_RUNS = torch.cuda.is_available() and _ops.native_cuda_built()
CPU = pytest.param("cpu", id="cpu")
CUDA = pytest.param(
    "cuda",
    id="cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA_RUNS, reason="needs a GPU and the CUDA ops")],
)

DTYPE_OF_CODE = {code: getattr(torch, name) for name, code in _ops.CODES.items()}
FLOAT_PAIRS = [(a, b) for a in DTYPE_OF_CODE.values() for b in DTYPE_OF_CODE.values() if a is not b]


def code_of(dtype: torch.dtype) -> int:
    return _ops.code(str(dtype).removeprefix("torch."))


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (
        got.dtype == want.dtype
        and got.shape == want.shape
        and torch.equal(
            got.detach().cpu().contiguous().view(torch.uint8), want.detach().cpu().contiguous().view(torch.uint8)
        )
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class OpTests:
    """The checks every op gets; a subclass names the op and gives its sample inputs and reference."""

    op: torch._ops.OpOverload

    @pytest.fixture(params=[CPU, CUDA])
    def device(self, request) -> str:
        return request.param

    def sample_inputs(self, device: str) -> list[tuple]:
        raise NotImplementedError

    def reference(self, *args) -> list[torch.Tensor]:
        raise NotImplementedError

    def outcome(self, args: tuple) -> list[torch.Tensor]:
        """What the op gives for `args`: its result (ops that return one)."""
        return [self.op(*args)]

    def test_correctness(self, device):
        for args in self.sample_inputs(device):
            want = self.reference(*args)
            got = self.outcome(args)
            assert len(got) == len(want) and all(same_bits(g, w) for g, w in zip(got, want))

    def test_opcheck(self, device):
        for args in self.sample_inputs(device):
            torch.library.opcheck(self.op, args)


# --- gather_convert: plan rows of extents from byte views into byte views ---


def plan_row(
    source, destination, from_dtype, to_dtype, src_offset, count, dst_offset, runs=1, src_stride=0, dst_stride=0
):
    """One row of the plan (csrc/plan_rows.h); offsets, counts and strides in elements."""
    codes_and_sizes = [code_of(from_dtype), code_of(to_dtype), from_dtype.itemsize, to_dtype.itemsize]
    return [source, destination, *codes_and_sizes, src_offset, count, dst_offset, runs, src_stride, dst_stride]


def byte_view(values: torch.Tensor, device: str, lead: int = 0) -> torch.Tensor:
    """`values` as uint8 on `device`, starting `lead` bytes into a larger buffer (a view at any byte)."""
    raw = values.contiguous().view(-1).view(torch.uint8)
    buffer = torch.zeros(lead + raw.numel(), dtype=torch.uint8, device=device)
    buffer[lead:] = raw.to(device)
    return buffer[lead:]


def filled(nbytes: int, device: str, lead: int = 0) -> torch.Tensor:
    """A destination of `nbytes` holding 0xAB, so that bytes the plan leaves alone are seen to stay."""
    return torch.full((lead + nbytes,), 0xAB, dtype=torch.uint8, device=device)[lead:]


def gather_samples(device: str) -> list[tuple]:
    """(sources, destinations, plan) triples: conversions, plain copies, strided runs, odd byte offsets."""
    f32 = torch.randn(100, generator=seeded(1)) * 100
    bf16 = (torch.randn(6 * 7, generator=seeded(2)) * 100).to(torch.bfloat16)
    f16 = (torch.randn(64, generator=seeded(3)) * 100).to(torch.float16)
    int64 = torch.randint(-(2**40), 2**40, (9,), generator=seeded(4))
    plans = []
    # One conversion, offsets at both ends.
    plans.append(
        (
            [byte_view(f32, device)],
            [filled(100 * 2, device)],
            [plan_row(0, 0, torch.float32, torch.bfloat16, 3, 90, 5)],
        )
    )
    # A Shard(1) piece (7 columns of 6 rows into columns 4..10 of 20) beside whole tensors, two
    # sources into two destinations, a plain copy of another element type, a row that writes nothing.
    plans.append(
        (
            [byte_view(bf16, device), byte_view(f16, device), byte_view(int64, device)],
            [filled(6 * 20 * 4 + 64 * 4, device), filled(64 * 2 + 9 * 8, device)],
            [
                plan_row(0, 0, torch.bfloat16, torch.float32, 0, 7, 4, runs=6, src_stride=7, dst_stride=20),
                plan_row(1, 0, torch.float16, torch.float32, 0, 64, 6 * 20),
                plan_row(1, 1, torch.float16, torch.bfloat16, 0, 64, 0),
                plan_row(2, 1, torch.int64, torch.int64, 0, 9, 16),
                plan_row(1, 1, torch.float16, torch.bfloat16, 0, 0, 0),
            ],
        )
    )
    # Views starting at odd bytes (a 2- or 4-byte access there faults on a GPU), a same-code copy.
    plans.append(
        (
            [byte_view(f16, device, lead=1), byte_view(f32[:64], device, lead=3)],
            [filled(64 * 4, device, lead=1), filled(64 * 2 * 2, device, lead=3)],
            [
                plan_row(0, 0, torch.float16, torch.float32, 0, 64, 0),
                plan_row(1, 1, torch.float32, torch.float16, 0, 64, 0),
                plan_row(0, 1, torch.float16, torch.float16, 0, 64, 64),
            ],
        )
    )
    return [(sources, destinations, torch.tensor(rows, dtype=torch.int64)) for sources, destinations, rows in plans]


def reference_gather_convert(sources, destinations, plan) -> list[torch.Tensor]:
    """The destinations after the plan, by slicing and Tensor.to() (the samples hold no NaNs, whose
    patterns torch's scalar and vector paths write differently)."""
    sources = [s.cpu() for s in sources]
    written = [d.cpu().clone() for d in destinations]
    for row in plan.tolist():
        source, destination, from_code, to_code, in_size, out_size, src_offset, count, dst_offset, runs = row[:10]
        src_stride, dst_stride = row[10:]
        for run in range(runs):
            start, begin = src_offset + run * src_stride, dst_offset + run * dst_stride
            piece = sources[source][start * in_size : (start + count) * in_size].clone()
            if from_code != to_code:
                piece = piece.view(DTYPE_OF_CODE[from_code]).to(DTYPE_OF_CODE[to_code]).view(torch.uint8)
            written[destination][begin * out_size : (begin + count) * out_size] = piece
    return written


class TestGatherConvert(OpTests):
    op = torch.ops.fsdpfast.gather_convert.default

    def sample_inputs(self, device):
        return gather_samples(device)

    def reference(self, sources, destinations, plan):
        return reference_gather_convert(sources, destinations, plan)

    def outcome(self, args):
        self.op(*args)
        return args[1]


class TestGatherConvertStaged(OpTests):
    """The CUDA pipeline: CPU views in and out, through pinned and device staging buffers."""

    op = torch.ops.fsdpfast.gather_convert_staged.default

    @pytest.fixture(params=[CUDA])  # the op has no CPU implementation
    def device(self, request) -> str:
        return request.param

    def sample_inputs(self, device):
        samples = []
        # Two slots of 64 bytes make every row cross buffers; three of 4 KB hold whole batches.
        for slots, nbytes in ((2, 64), (3, 4096)):
            for sources, destinations, plan in gather_samples("cpu"):
                pinned = [[torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)] for _ in "io"]
                on_device = [
                    [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(slots)] for _ in "io"
                ]
                samples.append((sources, destinations, plan, *pinned, *on_device))
        return samples

    def reference(self, sources, destinations, plan, *staging):
        return reference_gather_convert(sources, destinations, plan)

    def outcome(self, args):
        self.op(*args)
        return args[1]

    def test_opcheck(self, device):
        # Functionalised graphs (test_aot_dispatch_dynamic) hand the op clones of the tensors it
        # writes, and a clone of a pinned buffer is not pinned, which the op refuses. The CUDA
        # engine calls it eagerly (execute/cuda.py), so the schema and fake-tensor checks are the ones that bear.
        for args in self.sample_inputs(device):
            torch.library.opcheck(
                self.op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor")
            )


# --- convert_scalar: the CUDA kernels' element conversions, run on the CPU ---


class TestConvertScalar(OpTests):
    op = torch.ops.fsdpfast.convert_scalar.default

    @pytest.fixture(params=[CPU])  # a CPU op by design: it checks the device code's conversions anywhere
    def device(self, request) -> str:
        return request.param

    def sample_inputs(self, device):
        specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1.0, -65504.0, 3.0e38, 1.0e-40])
        samples = []
        for seed, (source, target) in enumerate(FLOAT_PAIRS):
            # 128 elements: torch's vectorised Tensor.to(), the reference, converts all of them.
            values = torch.cat([specials, torch.randn(120, generator=seeded(seed)) * 1000]).to(source)
            samples.append((values.view(torch.uint8).to(device), code_of(source), code_of(target)))
        return samples

    def reference(self, source, source_code, target_code):
        return [source.view(DTYPE_OF_CODE[source_code]).to(DTYPE_OF_CODE[target_code]).view(torch.uint8)]


# --- lora_merge, lora_merge_bias: a LoRA adapter fused into a weight, as peft merges it ---


def reference_lora_merge(weight, lora_A, lora_B, scaling, fan_in_fan_out, embedding):
    """peft's merge (csrc/lora_merge.cpp says which calls, in which dtypes) in plain torch."""
    dtype = lora_A.dtype if embedding else lora_B.dtype
    widen = weight.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    a, b = (lora_A.float(), lora_B.float()) if widen else (lora_A, lora_B)
    product = b @ a
    if embedding or fan_in_fan_out:
        product = product.T
    delta = product * scaling
    if widen:
        delta = delta.to(dtype)
    if embedding:
        delta = delta.to(weight.dtype)
    merged = weight.clone()
    merged += delta  # in place: a mixed sum is rounded into the weight's dtype
    return merged


class TestLoraMerge(OpTests):
    op = torch.ops.fsdpfast.lora_merge.default

    def sample_inputs(self, device):
        samples = []
        g = seeded(0)
        for weight_dtype, adapter_dtype in (
            (torch.float32, torch.float32),
            (torch.bfloat16, torch.bfloat16),
            (torch.float16, torch.float16),
            (torch.bfloat16, torch.float32),  # peft's autocast_adapter_dtype
        ):
            weight, a, b = (torch.randn(s, generator=g) for s in ((24, 40), (6, 40), (24, 6)))
            table, embedding_a = torch.randn(37, 24, generator=g), torch.randn(6, 37, generator=g)
            weight, table = weight.to(weight_dtype).to(device), table.to(weight_dtype).to(device)
            a, b, embedding_a = (t.to(adapter_dtype).to(device) for t in (a, b, embedding_a))
            samples.append((weight, a, b, 1.5, False, False))  # Linear
            samples.append((weight.t().contiguous(), a, b, 1.5, True, False))  # Conv1D: weight stored (in, out)
            samples.append((table, embedding_a, b, 0.25, False, True))  # Embedding
        return samples

    def reference(self, *args):
        return [reference_lora_merge(*args)]


class TestLoraMergeBias(OpTests):
    op = torch.ops.fsdpfast.lora_merge_bias.default

    def sample_inputs(self, device):
        g = seeded(5)
        pairs = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32))
        return [
            (torch.randn(24, generator=g).to(bias).to(device), torch.randn(24, generator=g).to(lora).to(device), 0.5)
            for bias, lora in pairs
        ]

    def reference(self, bias, lora_bias, scaling):
        merged = bias.clone()
        merged += lora_bias * scaling
        return [merged]


# --- transposed, transpose_copy: the last two dimensions swapped (every dtype and shape: tests/families/test_transpose_kernel.py) ---


def transpose_samples(device: str) -> list[torch.Tensor]:
    g = seeded(6)
    return [
        torch.randn(3, 33, 17, generator=g).to(device),
        (torch.randn(65, 7, generator=g) * 100).to(torch.bfloat16).to(device),
        torch.randint(-100, 100, (2, 5, 40), generator=g).to(device),
    ]


class TestTransposed(OpTests):
    op = torch.ops.fsdpfast.transposed.default

    def sample_inputs(self, device):
        return [(x,) for x in transpose_samples(device)]

    def reference(self, source):
        return [source.transpose(-2, -1).contiguous()]


class TestTransposeCopy(OpTests):
    op = torch.ops.fsdpfast.transpose_copy.default

    def sample_inputs(self, device):
        out = lambda x, dtype: torch.empty((*x.shape[:-2], x.shape[-1], x.shape[-2]), dtype=dtype, device=device)  # noqa: E731
        f32, bf16, int64 = transpose_samples(device)
        return [(f32, out(f32, torch.bfloat16)), (bf16, out(bf16, torch.float32)), (int64, out(int64, torch.int64))]

    def reference(self, source, destination):
        return [source.cpu().transpose(-2, -1).contiguous().to(destination.dtype)]

    def outcome(self, args):
        self.op(*args)
        return [args[1]]


# --- fp8_block_quantize: float8_e4m3fn per 128x128 block and its scale_inv (every input kind: test_fp8_block_op.py) ---


class TestFp8BlockQuantize(OpTests):
    op = torch.ops.fsdpfast.fp8_block_quantize.default

    def sample_inputs(self, device):
        g = seeded(7)
        whole = torch.randn(128, 256, generator=g) * 10
        partial = (torch.randn(2, 130, 257, generator=g) * 1000).to(torch.bfloat16)  # partial blocks, a lead axis
        return [(x.to(device), 128, 128) for x in (whole, partial)]

    def reference(self, weight, block_rows, block_cols):
        from fp8_anchor import anchor

        return list(anchor(weight.cpu()))

    def outcome(self, args):
        return [t.cpu() for t in self.op(*args)]


class TestFp8BlockQuantizeScalar(TestFp8BlockQuantize, OpTests):  # OpTests: listed as its own op
    """The scalar CPU kernel the vectorised one replaced, kept to measure beside it (CPU only)."""

    op = torch.ops.fsdpfast.fp8_block_quantize_scalar.default

    @pytest.fixture(params=[CPU])
    def device(self, request) -> str:
        return request.param


# --- the library as a whole ---

# Each op's arguments it writes into, as its schema must declare them (Tensor(a!)).
WRITTEN = {
    "gather_convert": {"destinations"},
    "gather_convert_staged": {"destinations", "pinned_in", "pinned_out", "device_in", "device_out"},
    "convert_scalar": set(),
    "lora_merge": set(),
    "lora_merge_bias": set(),
    "transposed": set(),
    "transpose_copy": {"destination"},
    "fp8_block_quantize": set(),
    "fp8_block_quantize_scalar": set(),
}


def fsdpfast_ops() -> set[str]:
    return {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("fsdpfast::")}


def test_every_schema_is_defined_and_declares_what_the_op_writes():
    # ops.cpp defines every schema, the CUDA op's too, so a CPU build knows all of them.
    assert fsdpfast_ops() == set(WRITTEN)
    for name, written in WRITTEN.items():
        schema = getattr(torch.ops.fsdpfast, name).default._schema
        assert {arg.name for arg in schema.arguments if arg.alias_info and arg.alias_info.is_write} == written, name


def test_every_op_has_its_tests_here():
    tested = {cls.op.name().split("::")[1] for cls in OpTests.__subclasses__()}
    assert tested == fsdpfast_ops()
