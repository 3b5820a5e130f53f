"""DeepSpeed AutoEP checkpoints: the experts each rank trains, put back on one expert axis, in transformers' names.

AutoEP (DeepSpeed >= 0.19, `expert_parallel.enabled`) replaces each MoE layer's packed experts of a
transformers 5 model by GroupedExperts `<layer>.mlp.experts.w1` [E, F, H] (gate), `w3` (up), `w2`
[E, H, F] (down), spread over the expert-parallel ranks, and its router by `mlp.router.gate.weight`.
`save_checkpoint` writes a file per MoE layer and expert (`layer_{l}_expert_{e}_mp_rank_00_model_states.pt`,
the module's weights) and, in each rank's optimizer file, a parameter group of its own experts' fp32
master weights; `mp_rank_00_model_states.pt` records `ds_autoep_layers` (which ranks hold which
experts). The masters are read, as for every other parameter (readers.deepspeed_zero); the per-expert
files are checked to be there. The conversion then writes transformers 5's packed tensors
(`gate_up_proj` = [w1; w3] per expert, `down_proj` = w2, the router as `mlp.gate.weight`, DeepSeek-V3's
router correction bias, which AutoEP keeps as `mlp.router.e_score_correction_bias`, as
`mlp.gate.e_score_correction_bias`), which the
Hub layout transform (families.transform) writes one tensor per expert. Expert data parallelism
(more ranks than experts' shards) and ZeRO stage 3 are refused in one line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from math import prod

from ..errors import BadInput
from ..plan.model import Extent, MergePlan, TensorPlan
from ..plan.transform import NamesOnly
from ..plan.windows import Window, Windows

EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt")
_GROUPED = re.compile(r"(?P<prefix>.*)\.experts\.w(?P<which>[123])")
# the router's weight, and DeepSeek-V3's correction bias (a buffer AutoEP copies onto its router)
_ROUTER = re.compile(r"(?P<prefix>.*)\.router\.(?P<what>gate\.weight|e_score_correction_bias)")
_OLD_GATE = re.compile(r"(?P<prefix>.*)\.gate\.gate\.weight")  # the replaced router, kept by AutoEP untrained


def autoep_layers(model: dict) -> list[dict] | None:
    """The AutoEP layers a model-states file records, or None for a checkpoint without AutoEP."""
    layers = model.get("ds_autoep_layers")
    return layers if isinstance(layers, list) and layers and all(isinstance(x, dict) for x in layers) else None


def check_expert_files(tag_dir: str, entries: list[str], layers: list[dict]) -> None:
    """Every (MoE layer, expert) file the AutoEP layers promise is there, and nothing else of MoE."""
    found = {(int(m[1]), int(m[2])) for e in entries if (m := EXPERT_FILE.fullmatch(e))}
    wanted = {(int(layer["moe_layer_id"]), e) for layer in layers for e in range(int(layer["num_experts"]))}
    if wanted - found:
        layer, expert = min(wanted - found)
        raise BadInput(
            f"{os.path.join(tag_dir, f'layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt')} is missing: "
            "an AutoEP checkpoint holds one file per MoE layer and expert"
        )


@dataclass(frozen=True)
class _Placement:
    num_experts: int
    first: dict[int, int]  # rank -> its first global expert


def _placements(layers: list[dict], path: str) -> dict[str, _Placement]:
    """Per grouped-experts parameter name (`<prefix>.w1` ...), where each rank's experts sit on the global axis."""
    out = {}
    for layer in layers:
        placement = layer.get("expert_placement") or {}
        first = {}
        for entry in placement.get("ranks") or ():
            experts = list(entry.get("experts") or ())
            if not experts or experts != list(range(experts[0], experts[0] + len(experts))):
                raise BadInput(
                    f"{path}: AutoEP places experts {experts} on rank {entry.get('rank')}, not a run of experts"
                )
            first[int(entry["rank"])] = experts[0]
        prefix = layer.get("expert_key_prefix")
        if not isinstance(prefix, str) or not first:
            raise BadInput(f"{path}: ds_autoep_layers has a layer without expert_key_prefix or expert placement")
        if int(layer.get("expert_data_parallel_world_size", 1)) != 1:
            raise BadInput(
                f"{path}: AutoEP with expert data parallelism (experts sharded over "
                f"{layer['expert_data_parallel_world_size']} ranks each) is not supported yet"
            )
        for which in ("w1", "w2", "w3"):
            out[f"{prefix}.{which}"] = _Placement(int(layer["num_experts"]), first)
    return out


def expert_tensors(
    layers: list[dict],
    path: str,
    group: dict[str, tuple[int, ...]],
    ranks: list[tuple[int, int, int]],
    paddings: tuple[int, ...],
    dtype: str,
) -> dict[str, TensorPlan]:
    """The grouped-experts parameters of one optimizer group that each rank holds whole for its own experts
    (ranks[r]: its partition's source, offset, length), on the global expert axis."""
    placements = _placements(layers, path)
    out = {}
    offset = 0
    for (name, local), padding in zip(group.items(), paddings):
        placement = placements.get(name)
        if placement is None:
            raise BadInput(f"{path}: {name} is in a parameter group of experts but no AutoEP layer names it")
        numel = prod(local)
        per_expert = numel // local[0] if local and local[0] else 0
        extents = []
        for r, (source, start, length) in enumerate(ranks):
            if r not in placement.first:
                raise BadInput(f"{path}: AutoEP names no experts for rank {r}")
            if offset + numel > length:
                raise BadInput(f"{path}: rank {r}'s expert partition ends at element {length}, inside {name}")
            extents.append(Extent(source, start + offset, numel, placement.first[r] * per_expert))
        shape = (placement.num_experts, *local[1:])
        if sum(e.count for e in extents) != prod(shape):
            raise BadInput(
                f"{path}: {name}: the ranks hold {sum(e.count for e in extents)} elements of its {list(shape)}"
            )
        out[name] = TensorPlan(name, shape, dtype, dtype, tuple(sorted(extents, key=lambda e: e.dst_offset)))
        offset += numel + padding
    return out


@dataclass(frozen=True)
class AutoEpToTransformers(NamesOnly):
    """AutoEP's names onto transformers 5's: [w1; w3] -> gate_up_proj, w2 -> down_proj, router.gate -> gate,
    router.e_score_correction_bias -> gate.e_score_correction_bias."""

    def apply(self, plan: MergePlan, models=None) -> MergePlan:
        windows = Windows(plan.tensors)
        by_name = {t.name: t for t in plan.tensors}
        out, done, stale = [], set(), []
        for tensor in plan.tensors:
            old = _OLD_GATE.fullmatch(tensor.name)
            if old is not None and f"{old['prefix']}.router.gate.weight" in by_name:
                stale.append(tensor.name)  # not the router the model computes with: router.gate is (trained)
                continue
            grouped = _GROUPED.fullmatch(tensor.name)
            if grouped is None:
                router = _ROUTER.fullmatch(tensor.name)
                out.append(tensor if router is None else _renamed(tensor, _router_name(router)))
                continue
            prefix = grouped["prefix"]
            if prefix in done:
                continue
            done.add(prefix)
            w1, w2, w3 = (by_name.get(f"{prefix}.experts.w{i}") for i in (1, 2, 3))
            if w1 is None or w2 is None or w3 is None or w1.shape != w3.shape or len(w1.shape) != 3:
                raise BadInput(f"{prefix}.experts: AutoEP's w1, w2 and w3 are not all there with matching shapes")
            experts, rows, columns = w1.shape
            gate_up = f"{prefix}.experts.gate_up_proj"
            out.append(
                windows.whole(
                    gate_up,
                    (experts, 2 * rows, columns),
                    [
                        Window(w1.name, (0, 0, 0), w1.shape, (0, 0, 0)),
                        Window(w3.name, (0, 0, 0), w3.shape, (0, rows, 0)),
                    ],
                )
            )
            out.append(_renamed(w2, f"{prefix}.experts.down_proj"))
        return plan.but(tensors=tuple(out)).noted(
            "DeepSpeed AutoEP's grouped experts (w1, w3, w2 per MoE layer, from every expert-parallel rank) "
            "written as transformers 5 holds them (gate_up_proj = [w1; w3], down_proj = w2; the router as mlp.gate)",
            f"left out: {len(stale)} copies of the replaced routers AutoEP keeps untrained ({stale[0]}, ...)"
            if stale
            else "",
        )


def _router_name(router: re.Match) -> str:
    """transformers' name of an AutoEP router tensor: `router.gate.weight` -> `gate.weight`,
    `router.e_score_correction_bias` -> `gate.e_score_correction_bias` (DeepSeek-V3's TopkRouter holds both)."""
    what = "weight" if router["what"] == "gate.weight" else router["what"]
    return f"{router['prefix']}.gate.{what}"


def _renamed(tensor: TensorPlan, name: str) -> TensorPlan:
    return replace(tensor, name=name)
