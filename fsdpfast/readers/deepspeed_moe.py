"""Native DeepSpeed MoE checkpoints (`deepspeed.moe.layer.MoE` layers): each rank's experts on one expert axis,
then in the names transformers 5 holds them.

A model whose MoE blocks are `deepspeed.moe.layer.MoE` holds, per block `P`, the router
`P.deepspeed_moe.gate.wg.weight` [E, H] and each expert module under `P.deepspeed_moe.experts.deepspeed_experts.{i}`,
`i` counting the experts this expert-parallel rank holds. `engine.save_checkpoint` (ZeRO 1/2) writes
`layer_{l}_expert_{e}_mp_rank_00_model_states.pt` per MoE layer and global expert (the module's weights,
renamed to the global id `ep_rank * local_experts + i`), `mp_rank_00_model_states.pt` (the rest, routers
included; `num_experts`, one count per MoE layer) and, in each rank's optimizer file, the experts'
fp32 masters as a group of their own, partitioned over the expert-data-parallel ranks. The masters are
read as for every other parameter (readers.deepspeed_zero), each rank's under its global ids; the
per-expert files are checked to be there.

The names say nothing of the Hugging Face family the model is (the expert module is the user's), so
config.json (beside the checkpoint, or `--config`) says it: the experts are written as transformers 5
holds that family's (`P.experts.gate_up_proj` [E, 2I, H] = each expert's [gate; up],
`P.experts.down_proj` [E, H, I], the router as `P.gate.weight`), which the Hub layout transform
(families.transform) writes as `save_pretrained` does. The expert's projections are read under the Hub's
names of either convention (gate_proj/up_proj/down_proj, or Mixtral's w1/w3/w2).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from math import prod

from ..errors import BadInput, option
from ..families.hub_experts import PER_EXPERT, TRANSPOSED, expert_names, is_transposed
from ..families.plan_config import config_of, model_type
from ..plan.model import Extent, MergePlan, TensorPlan
from ..plan.transform import NamesOnly
from ..plan.windows import Window, Windows
from .deepspeed_experts import EXPERT_FILE

_EXPERT = re.compile(
    r"(?P<block>.*)\.deepspeed_moe\.experts\.deepspeed_experts\.(?P<expert>\d+)\.(?P<projection>[^.]+)\.(?P<what>\w+)"
)
_ROUTER = re.compile(r"(?P<block>.*)\.deepspeed_moe\.gate\.wg\.weight")
_PROJECTIONS = ({"gate_proj": 0, "up_proj": 1, "down_proj": 2}, {"w1": 0, "w3": 1, "w2": 2})


def native_moe_layers(model: dict, tag_dir: str, entries: list[str]) -> tuple[int, ...] | None:
    """The experts of each native MoE layer mp_rank_00_model_states.pt counts (its expert files checked),
    or None for a checkpoint without per-expert files."""
    found = {(int(m[1]), int(m[2])) for e in entries if (m := EXPERT_FILE.fullmatch(e))}
    if not found:
        return None
    counts = model.get("num_experts")
    path = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    if not isinstance(counts, (list, tuple)) or not counts or not all(isinstance(c, int) and c > 0 for c in counts):
        raise BadInput(
            f"{path}: per-expert files (layer_*_expert_*) but num_experts is {counts!r:.60}, not a count per MoE layer"
        )
    wanted = {(layer, e) for layer, count in enumerate(counts) for e in range(count)}
    if wanted - found:
        layer, expert = min(wanted - found)
        raise BadInput(
            f"{os.path.join(tag_dir, f'layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt')} is missing: "
            f"a DeepSpeed MoE checkpoint holds one file per MoE layer and expert ({list(counts)} experts)"
        )
    if found - wanted:
        layer, expert = min(found - wanted)
        raise BadInput(
            f"{os.path.join(tag_dir, f'layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt')}: "
            f"{path} counts {list(counts)} experts per MoE layer; the files come from different runs"
        )
    return tuple(counts)


def expert_tensors(
    counts: tuple[int, ...],
    path: str,
    group: dict[str, tuple[int, ...]],
    ranks: list[tuple[int, int, int]],
    paddings: tuple[int, ...],
    dtype: str,
) -> dict[str, TensorPlan]:
    """An expert group each rank holds whole for its own experts (expert data parallelism 1: as many
    expert-parallel ranks as ranks; ranks[r]: its partition's source, offset, length), under the
    experts' global ids `r * local + i` (DeepSpeed's, as its per-expert files name them)."""
    local: dict[str, set[int]] = {}
    for name in group:
        match = _EXPERT.fullmatch(name)
        if match is None:
            raise BadInput(f"{path}: {name} is in a parameter group of experts but is no DeepSpeed MoE expert's")
        local.setdefault(match["block"], set()).add(int(match["expert"]))
    if len(local) != len(counts):
        raise BadInput(
            f"{path}: the experts' group holds {len(local)} MoE blocks' experts, num_experts counts {len(counts)}"
        )
    ep = len(ranks)
    for (block, ids), count in zip(local.items(), counts):
        if ids != set(range(len(ids))) or len(ids) * ep != count:
            raise BadInput(
                f"{path}: {block} holds experts {sorted(ids)} on each of {ep} expert-parallel ranks, "
                f"but num_experts counts {count}"
            )
    out = {}
    for r, (source, start, length) in enumerate(ranks):
        offset = 0
        for (name, shape), padding in zip(group.items(), paddings):
            match = _EXPERT.fullmatch(name)
            numel = prod(shape)
            if offset + numel > length:
                raise BadInput(f"{path}: rank {r}'s expert partition ends at element {length}, inside {name}")
            expert = r * len(local[match["block"]]) + int(match["expert"])
            global_name = f"{match['block']}.deepspeed_moe.experts.deepspeed_experts.{expert}.{match['projection']}.{match['what']}"
            out[global_name] = TensorPlan(global_name, shape, dtype, dtype, (Extent(source, start + offset, numel, 0),))
            offset += numel + padding
        if offset != length:
            raise BadInput(f"{path}: rank {r}'s expert partition holds {length} elements, its experts fill {offset}")
    return out


def moe_block(block: str, hub_module: str) -> str:
    """transformers 5's name of the MoE block (`mlp`) for a block the run named as the Hub does (`block_sparse_moe`)."""
    parent, _, last = block.rpartition(".")
    return f"{parent}.mlp" if last == hub_module and parent else block


@dataclass(frozen=True)
class NativeMoeToTransformers(NamesOnly):
    """DeepSpeed MoE's names onto transformers 5's, for the family config.json names."""

    first_file: str  # one of the per-expert files, for the refusal without config.json

    def apply(self, plan: MergePlan, models=None) -> MergePlan:
        found = model_type(plan)
        if found is None:
            raise BadInput(
                f"{self.first_file}: native DeepSpeed MoE experts (deepspeed_moe.experts.deepspeed_experts), whose "
                f"names do not say which Hugging Face model the run trained; pass {option('config', meta='HF_DIR')} "
                "with the model's config.json"
            )
        names = expert_names(config_of(plan))
        if names is None and not is_transposed(config_of(plan)):
            families = {*PER_EXPERT, *TRANSPOSED}
            named = ", ".join(f for f in ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe") if f in families)
            raise BadInput(
                f"native DeepSpeed MoE experts with a config.json of model_type {found!r}: they are written as "
                f"transformers packs the experts of the MoE families it saves per expert ({named}, ...: "
                f"{len(families)} in all) only; pass {option('config', meta='HF_DIR')} with the trained model's"
            )
        hub_module = names.module if names is not None else "mlp"
        experts: dict[str, dict[int, dict[int, TensorPlan]]] = {}
        out = []
        for tensor in plan.tensors:
            router = _ROUTER.fullmatch(tensor.name)
            if router is not None:
                out.append(replace(tensor, name=f"{moe_block(router['block'], hub_module)}.gate.weight"))
                continue
            expert = _EXPERT.fullmatch(tensor.name)
            if expert is None:
                if ".deepspeed_moe." in tensor.name:
                    raise BadInput(f"{tensor.name}: a DeepSpeed MoE tensor no Hugging Face MoE family holds")
                out.append(tensor)
                continue
            which = next((p[expert["projection"]] for p in _PROJECTIONS if expert["projection"] in p), None)
            if which is None or expert["what"] != "weight" or len(tensor.shape) != 2:
                raise BadInput(
                    f"{tensor.name}: a DeepSpeed MoE expert's tensor that is no weight of gate_proj/up_proj/down_proj "
                    "(or w1/w3/w2), the projections Hugging Face MoE families name"
                )
            experts.setdefault(expert["block"], {}).setdefault(int(expert["expert"]), {})[which] = tensor
        windows = Windows(plan.tensors)
        for block, by_expert in experts.items():
            out += _packed(windows, moe_block(block, hub_module), block, by_expert)
        return plan.but(tensors=tuple(out)).noted(
            f"native DeepSpeed MoE: {len(experts)} MoE blocks' experts (every expert-parallel rank's, under their "
            f"global ids) and routers written as transformers 5 holds {found}'s (gate_up_proj = [gate; up], "
            "down_proj, the router as gate)"
        )


def _packed(windows: Windows, target: str, block: str, by_expert: dict[int, dict[int, TensorPlan]]) -> list:
    count = len(by_expert)
    if set(by_expert) != set(range(count)):
        raise BadInput(f"{block}: DeepSpeed MoE experts {sorted(by_expert)}, not 0 to {count - 1}")
    first = by_expert[0]
    if set(first) != {0, 1, 2}:
        raise BadInput(f"{block}: DeepSpeed MoE expert 0 has not all three of its gate, up and down projections")
    inner, hidden = first[0].shape
    wanted = {0: (inner, hidden), 1: (inner, hidden), 2: (hidden, inner)}
    for e, parts in by_expert.items():
        if set(parts) != {0, 1, 2} or any(parts[k].shape != wanted[k] for k in wanted):
            raise BadInput(
                f"{block}: DeepSpeed MoE expert {e}'s projections are not expert 0's "
                f"(gate and up {list(wanted[0])}, down {list(wanted[2])})"
            )
    gate_up = [Window(by_expert[e][k].name, (0, 0), wanted[k], (e, k * inner, 0)) for e in range(count) for k in (0, 1)]
    down = [Window(by_expert[e][2].name, (0, 0), wanted[2], (e, 0, 0)) for e in range(count)]
    return [
        windows.whole(f"{target}.experts.gate_up_proj", (count, 2 * inner, hidden), gate_up),
        windows.whole(f"{target}.experts.down_proj", (count, hidden, inner), down),
    ]
