"""readers.megatron_names on its own (fast, no fixture): the windows and extents a gpt-oss layer's plan is
made of do not grow with the experts' rows, and the interleaved gate_up_proj they make is fc1's rows dealt
out in turn (gate row j at 2j, up row j at 2j + 1). The merges themselves: tests/readers/test_megatron.py."""

from __future__ import annotations

import itertools

import torch

from fsdpfast.geometry.boxes import box_extents
from fsdpfast.plan.model import TensorPlan, Transposed
from fsdpfast.plan.windows import Windows
from fsdpfast.readers import megatron_names as names

LAYERS, EXPERTS, HIDDEN = 2, 4, 6


def _stacked(ffn: int) -> dict[str, tuple[tuple[int, ...], list[list[int]]]]:
    """Each expert tensor of a gpt-oss MoE layer stack: its global shape and the cuts of its chunks, as
    megatron-core saves them (a chunk per layer and expert, fc1's gate and up rows chunks of their own)."""
    layers, experts, rows = list(range(LAYERS + 1)), list(range(EXPERTS + 1)), [0, ffn, 2 * ffn]
    return {
        names.ROUTER: ((LAYERS, EXPERTS, HIDDEN), [layers, [0, EXPERTS], [0, HIDDEN]]),
        names.ROUTER_BIAS: ((LAYERS, EXPERTS), [layers, [0, EXPERTS]]),
        names.EXPERT_FC1: ((LAYERS, EXPERTS, 2 * ffn, HIDDEN), [layers, experts, rows, [0, HIDDEN]]),
        names.EXPERT_FC1_BIAS: ((LAYERS, EXPERTS, 2 * ffn), [layers, experts, rows]),
        names.EXPERT_FC2: ((LAYERS, EXPERTS, HIDDEN, ffn), [layers, experts, [0, HIDDEN], [0, ffn]]),
        names.EXPERT_FC2_BIAS: ((LAYERS, EXPERTS, HIDDEN), [layers, experts, [0, HIDDEN]]),
    }


def _plan(ffn: int) -> tuple[dict[str, TensorPlan], dict[str, torch.Tensor], torch.Tensor]:
    """The layer tensors' plans (one source buffer, the chunks one after another), their values, the buffer."""
    plans, values, pieces, at = {}, {}, [], 0
    for key, (shape, cuts) in _stacked(ffn).items():
        name = "decoder.layers." + key
        whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).add(at).reshape(shape)
        extents = []
        for box in itertools.product(*(list(zip(c, c[1:])) for c in cuts)):
            offsets, sizes = tuple(lo for lo, _ in box), tuple(hi - lo for lo, hi in box)
            extents += box_extents(0, at, shape, offsets, sizes)
            piece = whole[tuple(slice(lo, hi) for lo, hi in box)].reshape(-1)
            pieces.append(piece)
            at += piece.numel()
        plans[name] = TensorPlan(name, shape, "float64", "float64", extents)
        values[key] = whole
    return plans, values, torch.cat(pieces)


def _layer(ffn: int, i: int = 1):
    """Layer i's gpt-oss expert tensors (name -> (plan, windows)), as MegatronToHuggingFace makes them."""
    plans, values, source = _plan(ffn)
    sizes = names.Sizes(HIDDEN, 1, 1, HIDDEN, 0, LAYERS, 8, False, True, experts=EXPERTS, expert_ffn=ffn)
    windows, made = Windows(plans.values()), {}
    for name, shape, parts in names._gpt_oss_moe(names.layer_tensors(plans), i, sizes, "layer."):
        if isinstance(parts, names.Swapped):
            made[name] = windows.transposed_of(name, parts.shape, parts.windows), parts.windows
        else:
            made[name] = windows.whole(name, shape, parts), parts
    return made, values, source


def _executed(plan: TensorPlan, source: torch.Tensor, shape) -> torch.Tensor:
    out = torch.full((plan.numel,), -1.0, dtype=torch.float64)
    for e in plan.extents:
        for r in range(e.runs):
            src, dst = e.src_offset + r * e.src_stride, e.dst_offset + r * e.dst_stride
            out[dst : dst + e.count] = source[src : src + e.count]
    return out.view(shape)


def test_a_gpt_oss_layer_plan_does_not_grow_with_the_expert_rows():
    # one window per fc1 row made 2F windows and an extent per row and chunk (368,817 extents at hidden 2880)
    sizes = {}
    for ffn in (3, 40):
        made, _, _ = _layer(ffn)
        sizes[ffn] = {name: (len(windows), len(plan.extents)) for name, (plan, windows) in made.items()}
    assert sizes[3] == sizes[40]
    assert sizes[40]["layer.mlp.experts.gate_up_proj"] == (2, 2 * EXPERTS)  # gate and up: one extent a chunk
    assert sizes[40]["layer.mlp.experts.gate_up_proj_bias"] == (2, 2 * EXPERTS)


def test_a_gpt_oss_layer_interleaves_gate_and_up_rows():
    ffn, i = 5, 1
    made, values, source = _layer(ffn, i)
    plan, _ = made["layer.mlp.experts.gate_up_proj"]
    fc1 = values[names.EXPERT_FC1][i]  # (E, 2F, H): [gate; up]
    assert isinstance(plan.compute, Transposed) and plan.shape == (EXPERTS, HIDDEN, 2 * ffn)
    rows = _executed(plan, source, (EXPERTS, 2 * ffn, HIDDEN))  # the extents fill it untransposed
    assert torch.equal(rows[:, 0::2], fc1[:, :ffn]) and torch.equal(rows[:, 1::2], fc1[:, ffn:])
    bias, _ = made["layer.mlp.experts.gate_up_proj_bias"]
    fc1_bias = values[names.EXPERT_FC1_BIAS][i]
    got = _executed(bias, source, (EXPERTS, 2 * ffn))
    assert torch.equal(got[:, 0::2], fc1_bias[:, :ffn]) and torch.equal(got[:, 1::2], fc1_bias[:, ffn:])
