"""MoE experts as the Hub names them: one tensor per expert and projection, not transformers 5's packed ones.

transformers 5 holds an MoE layer's experts packed (`mlp.experts.gate_up_proj` [E, 2I, H], gate
rows first, then up; `mlp.experts.down_proj` [E, H, I]), so that is what a training checkpoint
holds. For the families below, loading converts the Hub's per-expert tensors into the packed
ones and `save_pretrained` converts them back (transformers 5.24, conversion_mapping.py: the
`qwen2_moe` and `mixtral` patterns and the model types that use them). Each expert's projection is a
contiguous block of rows of the packed tensor, so splitting it out is a window (plan.windows).
Families whose Hub checkpoints keep the packed names (gpt-oss, Llama 4, Qwen3.5) are not listed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..errors import BadInput
from ..plan.model import TensorPlan
from ..plan.windows import Window, Windows


@dataclass(frozen=True)
class ExpertNames:
    """A family's Hub names of an MoE layer: the module holding router and experts, each expert's projections."""

    module: str
    gate: str
    up: str
    down: str
    # (what transformers holds, what its save writes): a family's renames beside its experts', as name endings
    renames: tuple[tuple[str, str], ...] = ()

    def expert(self, prefix: str, e: int, projection: str) -> str:
        return f"{prefix}.{self.module}.experts.{e}.{projection}.weight"


_QWEN2_MOE = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
_MIXTRAL = ExpertNames("block_sparse_moe", "w1", "w3", "w2")  # the router too: block_sparse_moe.gate.weight
# transformers 5.25's exaone_moe and ernie4_5_moe rules add to qwen2_moe's a rename of the router's correction
# bias, which their save reverses
_EXAONE_MOE = replace(_QWEN2_MOE, renames=((".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"),))
_ERNIE4_5_MOE = replace(
    _QWEN2_MOE,
    renames=((".mlp.gate.moe_statics.e_score_correction_bias", ".mlp.moe_statics.e_score_correction_bias"),),
)

# model_type -> Hub names (transformers 5.24's _MODEL_TO_CONVERSION_PATTERN, the two MoE patterns; 5.25 adds
# qwen3_5_moe_text: the prefix change it drops when saving a model it did not load, then the qwen2_moe pattern)
PER_EXPERT: dict[str, ExpertNames] = {
    **dict.fromkeys(("mixtral", "minimax", "minimax_m2"), _MIXTRAL),
    **dict.fromkeys(
        (
            "qwen2_moe",
            "afmoe",
            "deepseek_v2",
            "deepseek_v3",
            "deepseek_v32",
            "dots1",
            "glm4_moe",
            "glm4_moe_lite",
            "glm_moe_dsa",
            "glm4v_moe",
            "longcat_flash",
            "solar_open",
            "mellum",
            "qwen3_moe",
            "beam",
            "qwen3_omni_moe",
            "qwen3_omni_moe_thinker",
            "qwen3_omni_moe_text",
            "qwen3_next",
            "hunyuan_v1_moe",
            "flex_olmo",
            "olmoe",
            "sarvam_mla",
            "cohere2_moe",
            "qwen3_5_moe_text",
        ),
        _QWEN2_MOE,
    ),
    "exaone_moe": _EXAONE_MOE,
    "ernie4_5_moe": _ERNIE4_5_MOE,
}

# Families whose Hub checkpoints hold the packed experts transposed ([E, H, 2I], [E, I, H]; loading
# transposes them: transformers' conversion_mapping Transpose(1, 2, check_dims=True), vLLM's
# is_fused_checkpoint_transposed): each expert's matrix written transposed (plan.windows.transposed).
# transformers 5.25's save_pretrained writes them as held (its reverse Transpose compares the tensor
# with the parameter's own shape, finds them equal and keeps it), which vLLM's loader transposes wrongly.
TRANSPOSED = ("qwen3_vl_moe",)


def expert_names(config: dict) -> ExpertNames | None:
    """The Hub names of the experts of the model config.json describes, or None where its Hub checkpoints keep
    the packed tensors. transformers looks its conversion up per sub-model too, so a vision-language model's
    text model (Qwen3.5-MoE's `qwen3_5_moe_text` under `qwen3_5_moe`) counts as well."""
    found = PER_EXPERT.get(_model_type(config))
    text = config.get("text_config")
    return found if found is not None or not isinstance(text, dict) else PER_EXPERT.get(_model_type(text))


def is_transposed(config: dict) -> bool:
    return _model_type(config) in TRANSPOSED


def _model_type(config: dict) -> str:
    found = config.get("model_type")
    return found if isinstance(found, str) else ""


_PACKED = re.compile(r"(?P<prefix>.*)\.mlp\.experts\.(?P<what>gate_up_proj|down_proj)")
_MLP = re.compile(r"(?P<prefix>.*)\.mlp\.(?P<rest>.+)")


def hub_parts(name: str, shape: tuple[int, ...], names: ExpertNames) -> list[tuple[str, tuple[int, ...], Window]] | str:
    """What tensor `name` is in the Hub layout: its new name (a rename, or `name` itself), or, for
    packed experts, (Hub name, shape, the window of `name` it is) for each tensor it becomes."""
    packed = _PACKED.fullmatch(name)
    if packed is None:
        for held, written in names.renames:
            if name.endswith(held):
                return name[: -len(held)] + written
        mlp = _MLP.fullmatch(name)
        if mlp is not None and names.module != "mlp":  # the router (and all else of the MoE module) moves
            return f"{mlp['prefix']}.{names.module}.{mlp['rest']}"
        return name
    if len(shape) != 3:
        raise BadInput(f"{name}: packed experts have 3 dimensions (experts, rows, columns), this one has {list(shape)}")
    experts, rows, columns = shape
    prefix = packed["prefix"]
    if packed["what"] == "down_proj":
        return [
            (names.expert(prefix, e, names.down), (rows, columns), Window(name, (e, 0, 0), (1, rows, columns), (0, 0)))
            for e in range(experts)
        ]
    if rows % 2:
        raise BadInput(
            f"{name}: {list(shape)} packs each expert's gate and up projections as rows [gate; up], "
            f"but {rows} rows do not split in two"
        )
    half = rows // 2
    return [
        (names.expert(prefix, e, projection), (half, columns), Window(name, (e, start, 0), (1, half, columns), (0, 0)))
        for e in range(experts)
        for projection, start in ((names.gate, 0), (names.up, half))
    ]


def hub_shapes(shapes: dict[str, tuple[int, ...]], names: ExpertNames) -> dict[str, tuple[int, ...]]:
    """A model's state dict shapes (its packed names) as the Hub layout names them: what the merge must write."""
    out = {}
    for name, shape in shapes.items():
        parts = hub_parts(name, shape, names)
        if isinstance(parts, str):
            out[parts] = shape
        else:
            out.update((part, part_shape) for part, part_shape, _ in parts)
    return out


def transposed_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A model's shapes with its packed experts transposed, as a TRANSPOSED family's Hub checkpoints hold them."""
    return {
        name: (*shape[:-2], shape[-1], shape[-2]) if _PACKED.fullmatch(name) and len(shape) == 3 else shape
        for name, shape in shapes.items()
    }


def transpose_experts(tensors: tuple[TensorPlan, ...], clean) -> tuple[list[TensorPlan], list[str]]:
    """The plan's tensors with each packed expert tensor written transposed ([E, R, C] -> [E, C, R]);
    and the names whose matrices are square, whose orientation a loader cannot tell from the shape."""
    windows = Windows(tensors)
    out, square = [], []
    for tensor in tensors:
        if not _PACKED.fullmatch(clean(tensor.name)):
            out.append(tensor)
            continue
        if len(tensor.shape) != 3:
            raise BadInput(
                f"{clean(tensor.name)}: packed experts have 3 dimensions (experts, rows, columns), "
                f"this one has {list(tensor.shape)}"
            )
        if tensor.shape[1] == tensor.shape[2]:
            square.append(clean(tensor.name))
        whole = Window(tensor.name, (0, 0, 0), tensor.shape, (0, 0, 0))
        out.append(windows.transposed(tensor.name, whole))
    return out, square


def has_packed(tensors, clean) -> bool:
    return any(_PACKED.fullmatch(clean(t.name)) for t in tensors)


def split_experts(tensors: tuple[TensorPlan, ...], names: ExpertNames, clean) -> list[TensorPlan]:
    """The plan's tensors in the Hub layout: packed experts split per expert, the MoE module renamed.
    `clean`: the written name of a checkpoint name (plan.normalise.clean_name)."""
    windows = Windows(tensors)
    out = []
    for tensor in tensors:
        parts = hub_parts(clean(tensor.name), tensor.shape, names)
        if isinstance(parts, str):
            out.append(tensor if parts == clean(tensor.name) else replace(tensor, name=parts))
            continue
        for name, shape, window in parts:
            out.append(windows.whole(name, shape, [replace(window, tensor=tensor.name)]))
    return out
