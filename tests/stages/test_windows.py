"""plan.windows: tensors made of windows of a plan's tensors, from their extents alone, place what torch slicing takes."""

from __future__ import annotations

import itertools

import pytest
import torch

from fsdpfast.geometry.boxes import box_extents
from fsdpfast.geometry.extent_boxes import run_boxes
from fsdpfast.plan.model import Extent, TensorPlan
from fsdpfast.plan.windows import Window, Windows


def _executed(plan: TensorPlan, source: torch.Tensor) -> torch.Tensor:
    """The tensor the plan's extents write from one flat source buffer (-1 where none writes)."""
    out = torch.full(plan.shape, -1.0, dtype=torch.float64)
    flat = out.view(-1)
    for e in plan.extents:
        for r in range(e.runs):
            src, dst = e.src_offset + r * e.src_stride, e.dst_offset + r * e.dst_stride
            assert torch.all(flat[dst : dst + e.count] == -1), "an element written twice"
            flat[dst : dst + e.count] = source[src : src + e.count]
    return out


class Corpus:
    """Tensors of distinct values, each held as pieces laid one after another in one source buffer."""

    def __init__(self):
        self.pieces: list[torch.Tensor] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.plans: list[TensorPlan] = []

    @property
    def at(self) -> int:
        return sum(p.numel() for p in self.pieces)

    def chunked(self, name: str, whole: torch.Tensor, cuts) -> None:
        """Held as the boxes between `cuts` (per dimension), each piece row-major (a DCP chunk)."""
        extents = []
        for box in itertools.product(*(list(zip(c, c[1:])) for c in cuts)):
            offsets, sizes = tuple(lo for lo, _ in box), tuple(hi - lo for lo, hi in box)
            extents += box_extents(0, self.at, whole.shape, offsets, sizes)
            self.pieces.append(whole[tuple(slice(lo, hi) for lo, hi in box)].reshape(-1))
        self._add(name, whole, extents)

    def flat(self, name: str, whole: torch.Tensor, cuts) -> None:
        """Held as flat runs between `cuts` of the flattened tensor, in reverse order (a DeepSpeed partition)."""
        extents, flat = [], whole.reshape(-1)
        for lo, hi in reversed(list(zip(cuts, cuts[1:]))):
            extents.append(Extent(0, self.at, hi - lo, lo))
            self.pieces.append(flat[lo:hi])
        self._add(name, whole, extents)

    def _add(self, name, whole, extents):
        self.tensors[name] = whole
        self.plans.append(TensorPlan(name, tuple(whole.shape), "float64", "float64", extents))

    def source(self) -> torch.Tensor:
        return torch.cat(self.pieces) if self.pieces else torch.zeros(0, dtype=torch.float64)


def _values(shape, start: float = 0.0) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).add(start).reshape(shape)


def test_a_run_is_at_most_two_boxes_a_dimension_less_one_and_exactly_its_elements():
    for shape in [(3,), (2, 3), (3, 4, 2), (2, 1, 3, 2)]:
        n = torch.Size(shape).numel()
        for start, count in ((a, c) for a in range(n) for c in range(1, n - a + 1)):
            seen = torch.zeros(shape, dtype=torch.int64)
            boxes = run_boxes(start, count, shape)
            for offsets, sizes in boxes:
                seen[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
            assert seen.view(-1).tolist() == [int(start <= i < start + count) for i in range(n)]
            assert len(boxes) <= 2 * len(shape) - 1


def _random_tensor(seed: int, most_dims: int, most_size: int):
    """A random draw, and tensor "t" of random shape held in random chunks or flat runs: (randint, its values, corpus)."""
    rng = torch.Generator().manual_seed(seed)

    def randint(low, high):  # low..high inclusive
        return int(torch.randint(low, high + 1, (1,), generator=rng))

    shape = tuple(randint(1, most_size) for _ in range(randint(1, most_dims)))
    whole = _values(shape)
    corpus = Corpus()
    if randint(0, 1):
        corpus.chunked("t", whole, [sorted({0, n, *(randint(1, n) for _ in range(randint(0, 2)))}) for n in shape])
    else:
        corpus.flat("t", whole, sorted({0, whole.numel(), *(randint(1, whole.numel()) for _ in range(randint(0, 4)))}))
    return randint, whole, corpus


@pytest.mark.parametrize("seed", range(300))
def test_random_windows_place_what_torch_slicing_takes(seed):
    randint, whole, corpus = _random_tensor(seed, 4, 6)
    shape, ndim = tuple(whole.shape), whole.dim()
    dropped = randint(0, ndim - 1)  # leading dimensions of size one the new tensor does not have
    starts = [randint(0, n - 1) for n in shape]
    sizes = [1 if d < dropped else randint(1, shape[d] - starts[d]) for d in range(ndim)]
    margin = [randint(0, 2) * randint(0, 1) for _ in range(ndim - dropped)]
    out_shape = tuple(s + m for s, m in zip(sizes[dropped:], margin))
    out_at = tuple(randint(0, m) for m in margin)
    made = Windows(corpus.plans).tensor("new", out_shape, [Window("t", tuple(starts), tuple(sizes), out_at)])
    expected = torch.full(out_shape, -1.0, dtype=torch.float64)
    window = whole[tuple(slice(s, s + n) for s, n in zip(starts, sizes))].reshape(sizes[dropped:])
    expected[tuple(slice(a, a + n) for a, n in zip(out_at, sizes[dropped:]))] = window
    assert torch.equal(_executed(made, corpus.source()), expected), (seed, shape, starts, sizes, out_shape, out_at)
    assert sum(e.numel for e in made.extents) == window.numel()


@pytest.mark.parametrize("seed", range(200))
def test_random_stepped_windows_place_what_strided_slicing_takes(seed):
    # a window landing every step-th slot of the new tensor (gpt-oss's gate rows at 0, 2, 4, ...)
    randint, whole, corpus = _random_tensor(seed, 3, 5)
    shape, ndim = tuple(whole.shape), whole.dim()
    starts = [randint(0, n - 1) for n in shape]
    sizes = [randint(1, n - s) for n, s in zip(shape, starts)]
    step = [randint(1, 3) for _ in range(ndim)]
    out_at = [randint(0, 2) for _ in range(ndim)]
    out_shape = tuple(a + (n - 1) * k + 1 + randint(0, 1) for a, n, k in zip(out_at, sizes, step))
    window = Window("t", tuple(starts), tuple(sizes), tuple(out_at), tuple(step))
    made = Windows(corpus.plans).tensor("new", out_shape, [window])
    expected = torch.full(out_shape, -1.0, dtype=torch.float64)
    taken = whole[tuple(slice(s, s + n) for s, n in zip(starts, sizes))]
    expected[tuple(slice(a, a + (n - 1) * k + 1, k) for a, n, k in zip(out_at, sizes, step))] = taken
    assert torch.equal(_executed(made, corpus.source()), expected), (seed, shape, starts, sizes, step, out_at)
    assert sum(e.numel for e in made.extents) == taken.numel()


def test_two_stepped_windows_interleave_rows_in_one_extent_a_piece():
    # fc1 (E, 2F, H) as [gate; up] chunks per expert, into rows gate 0, up 0, gate 1, ...: a strided extent per
    # chunk whatever F is (one window per row made an extent per row)
    experts, hidden = 3, 4
    counts = []
    for ffn in (2, 16):
        whole = _values((experts, 2 * ffn, hidden))
        corpus = Corpus()
        corpus.chunked("fc1", whole, [list(range(experts + 1)), [0, ffn, 2 * ffn], [0, hidden]])
        halves = [Window("fc1", (0, k * ffn, 0), (experts, ffn, hidden), (0, k, 0), (1, 2, 1)) for k in (0, 1)]
        made = Windows(corpus.plans).tensor("gate_up", whole.shape, halves)
        expected = torch.stack([whole[:, :ffn], whole[:, ffn:]], dim=2).reshape(whole.shape)
        assert torch.equal(_executed(made, corpus.source()), expected)
        counts.append(len(made.extents))
    assert counts == [2 * experts, 2 * experts]


def test_a_stacked_tensor_gives_each_layer_its_own_pieces_only():
    # (L, 2f, h) held a piece per layer and TP rank, rows split in two (Megatron's linear_fc1)
    layers, rows, hidden = 5, 8, 3
    whole = _values((layers, rows, hidden))
    corpus = Corpus()
    corpus.chunked("fc1", whole, [list(range(layers + 1)), [0, rows // 2, rows], [0, hidden]])
    windows, source = Windows(corpus.plans), corpus.source()
    for i in range(layers):
        gate = windows.tensor("gate", (rows // 2, hidden), [Window("fc1", (i, 0, 0), (1, rows // 2, hidden), (0, 0))])
        up = windows.tensor(
            "up", (rows // 2, hidden), [Window("fc1", (i, rows // 2, 0), (1, rows // 2, hidden), (0, 0))]
        )
        assert torch.equal(_executed(gate, source), whole[i, : rows // 2])
        assert torch.equal(_executed(up, source), whole[i, rows // 2 :])
        assert len(gate.extents) == len(up.extents) == 1  # one TP rank's piece each, whole


def test_columns_split_by_tp_stay_one_strided_extent_a_piece():
    # (L, h, n·d) split along its last dimension (Megatron's linear_proj): each piece is h runs
    layers, hidden, inner = 3, 4, 6
    whole = _values((layers, hidden, inner))
    corpus = Corpus()
    corpus.chunked("proj", whole, [list(range(layers + 1)), [0, hidden], [0, inner // 2, inner]])
    windows = Windows(corpus.plans)
    for i in range(layers):
        made = windows.tensor("o", (hidden, inner), [Window("proj", (i, 0, 0), (1, hidden, inner), (0, 0))])
        assert torch.equal(_executed(made, corpus.source()), whole[i])
        assert [e.runs for e in made.extents] == [hidden, hidden]


def test_a_fused_projection_split_per_group_into_parts():
    # q, k, v interleaved per query group (g groups of (n/g + 2)·d rows), held in two row pieces
    groups, per_group, d, hidden = 2, 2, 2, 3
    rows = groups * (per_group + 2) * d
    whole = _values((rows, hidden))
    corpus = Corpus()
    corpus.chunked("qkv", whole, [[0, rows // 2, rows], [0, hidden]])
    windows, view = Windows(corpus.plans), whole.view(groups, (per_group + 2) * d, hidden)
    for part, start, count in (("q", 0, per_group * d), ("k", per_group * d, d), ("v", (per_group + 1) * d, d)):
        made = windows.tensor(
            part,
            (groups * count, hidden),
            [
                Window("qkv", (g * (per_group + 2) * d + start, 0), (count, hidden), (g * count, 0))
                for g in range(groups)
            ],
        )
        assert torch.equal(_executed(made, corpus.source()), view[:, start : start + count].reshape(-1, hidden))


def test_windows_of_several_tensors_make_one_and_contiguous_pieces_join():
    corpus = Corpus()
    corpus.chunked("a", _values((2, 3)), [[0, 1, 2], [0, 3]])  # two row pieces, one after the other
    corpus.chunked("b", _values((4,), 100.0), [[0, 4]])
    made = Windows(corpus.plans).tensor(
        "ab", (3, 3), [Window("a", (0, 0), (2, 3), (0, 0)), Window("b", (0,), (3,), (2, 0))]
    )
    expected = torch.cat([_values((2, 3)), _values((4,), 100.0)[:3].view(1, 3)])
    assert torch.equal(_executed(made, corpus.source()), expected)
    assert len(made.extents) == 1  # a's pieces and b's elements lie one after another in the source


def test_a_layer_placed_into_a_stacked_tensor():
    # the other way round: per-layer tensors windowed into (L, r, c), leading dimensions added
    corpus = Corpus()
    for i in range(3):
        corpus.chunked(f"layer{i}", _values((2, 2), 10.0 * i), [[0, 2], [0, 1, 2]])
    made = Windows(corpus.plans).tensor(
        "stacked", (3, 2, 2), [Window(f"layer{i}", (0, 0), (2, 2), (i, 0, 0)) for i in range(3)]
    )
    assert torch.equal(_executed(made, corpus.source()), torch.stack([_values((2, 2), 10.0 * i) for i in range(3)]))


def test_odd_shapes():
    corpus = Corpus()
    corpus.chunked("scalar", _values(()), [])
    corpus.chunked("ones", _values((1, 1, 3)), [[0, 1], [0, 1], [0, 2, 3]])
    corpus.chunked("empty", _values((0, 4)), [[0], [0, 4]])
    windows, source = Windows(corpus.plans), corpus.source()
    assert torch.equal(_executed(windows.tensor("s", (), [Window("scalar", (), (), ())]), source), _values(()))
    made = windows.tensor("o", (3,), [Window("ones", (0, 0, 0), (1, 1, 3), (0,))])
    assert torch.equal(_executed(made, source), _values((3,)))
    made = windows.tensor("e", (0, 4), [Window("empty", (0, 0), (0, 4), (0, 0))])
    assert made.extents == () and made.shape == (0, 4)


def test_a_part_no_piece_fills_is_left_empty():
    corpus = Corpus()
    corpus.chunked("half", _values((4, 2)), [[0, 2], [0, 2]])  # rows 2..3 held by no piece
    corpus.plans[0] = TensorPlan("half", (4, 2), "float64", "float64", corpus.plans[0].extents)
    made = Windows(corpus.plans).tensor("h", (3, 2), [Window("half", (1, 0), (3, 2), (0, 0))])
    assert sum(e.numel for e in made.extents) == 2  # row 1 only: the caller compares with the shape


@pytest.mark.parametrize(
    "window, shape, mentions",
    [
        (Window("t", (3, 0), (2, 2), (0, 0)), (2, 2), "does not fit"),  # past the tensor's rows
        (Window("t", (0, 0), (2, 2), (1, 0)), (2, 2), "does not fit"),  # past the new tensor's rows
        (Window("t", (0, 0), (2, 2), (0,)), (2, 2), "does not fit"),  # `at` of another rank
        (Window("t", (0,), (2,), (0,)), (2,), "does not fit"),  # offsets of another rank
        (Window("t", (0, 0), (2, 2), (0,)), (4,), "does not fit"),  # two rows into a tensor of one
        (Window("t", (0, 0), (3, 2), (0, 0), (2, 1)), (4, 2), "does not fit"),  # row 2 at 4, past its rows
        (Window("t", (0, 0), (2, 2), (0, 0), (0, 1)), (2, 2), "does not fit"),  # a step of 0: rows on top
        (Window("t", (0, 0), (2, 2), (0, 0), (2,)), (4, 2), "does not fit"),  # a step of another rank
        (Window("missing", (0,), (1,), (0,)), (1,), "does not hold"),
    ],
)
def test_a_window_that_misses_is_refused(window, shape, mentions):
    corpus = Corpus()
    corpus.chunked("t", _values((4, 2)), [[0, 4], [0, 2]])
    with pytest.raises(ValueError, match=mentions):
        Windows(corpus.plans).tensor("new", shape, [window])


def test_windows_of_tensors_of_different_dtypes_are_refused():
    plans = [TensorPlan("a", (2,), "float32", "float32", [Extent(0, 0, 2, 0)])]
    plans.append(TensorPlan("b", (2,), "bfloat16", "bfloat16", [Extent(1, 0, 2, 0)]))
    with pytest.raises(ValueError, match="dtypes"):
        Windows(plans).tensor("ab", (4,), [Window("a", (0,), (2,), (0,)), Window("b", (0,), (2,), (2,))])
