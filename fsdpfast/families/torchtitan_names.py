"""torchtitan's tensor names as the Hub names them: the rules of its state-dict adapters' `to_hf`, as names and windows.

torchtitan (0.2.2 and 0.3.x) keeps a model's parameters under names of its own (`tok_embeddings.weight`,
`layers.N.attention.qkv_linear.wq.weight`, `layers.N.moe.routed_experts.inner_experts.w1_EFD`), which
neither transformers nor vLLM load. Its adapters (torchtitan.models.{llama3,qwen3,deepseek_v3}
.state_dict_adapter, 0.3.0) rename them; llama3's also permutes the rows of wq and wk (complex RoPE
pairs (2i, 2i+1) of a head become rotate_half's (i, i + head_dim/2)), which is two windows of whole
rows per tensor. Routed experts ([E, F, D], the orientation of per-expert nn.Linear weights) become
transformers 5's packed `mlp.experts.gate_up_proj` ([w1; w3] per expert) and `down_proj`; the Hub
layout transform (families.transform) then writes them one tensor per expert, as `to_hf` does.
0.2.2's names (`attention.wq`, `output`, `moe.experts.w1`, `moe.expert_bias`) are read as 0.3's first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..errors import BadInput, option
from ..plan.model import TensorPlan
from ..plan.windows import Window, Windows

# torchtitan's names, the way to tell its checkpoints from a Hugging Face model's
_TITAN = re.compile(
    r"tok_embeddings\.weight|(mtp_)?layers\.\d+\.(attention_norm\.weight|attention\.(qkv_linear\.)?wq\.weight)"
)

# 0.2.2 -> 0.3 (families.md §2.1); `attention.wq` moved under qkv_linear for llama3 and qwen3 only
_RENAMED_IN_030 = (
    (re.compile(r"output\.weight"), "lm_head.weight"),
    (re.compile(r"(.*)\.moe\.experts\.w([13])"), r"\1.moe.routed_experts.inner_experts.w\2_EFD"),
    (re.compile(r"(.*)\.moe\.experts\.w2"), r"\1.moe.routed_experts.inner_experts.w2_EDF"),
    (re.compile(r"(.*)\.moe\.expert_bias"), r"\1.moe.expert_bias_E"),
)
_QKV_022 = re.compile(r"(layers\.\d+)\.attention\.w([qkv])\.weight")

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_COMMON = {  # inside a layer, for every family
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_QKV = {f"attention.qkv_linear.w{p}.weight": f"self_attn.{p}_proj.weight" for p in "qkv"}
_QK_NORM = {"attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight"}
_ROUTER = {"moe.router.gate.weight": "mlp.gate.weight"}
_MLA = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.expert_bias_E": "mlp.gate.e_score_correction_bias",
    "enorm.weight": "enorm.weight",  # the multi-token prediction layers' own modules
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "mtp_norm.weight": "shared_head.norm.weight",
}
_EXPERTS = ("moe.routed_experts.inner_experts.w1_EFD", "moe.routed_experts.inner_experts.w3_EFD")
_DOWN = "moe.routed_experts.inner_experts.w2_EDF"
_BIAS = "moe.expert_bias_E"


@dataclass(frozen=True)
class TitanFamily:
    """One torchtitan model's map: names inside a layer, whether q/k rows are permuted, what `to_hf` drops."""

    name: str  # torchtitan's model name
    layer_names: dict[str, str]
    permuted: bool = False  # llama3: complex RoPE's row order -> rotate_half's
    dropped: tuple[str, ...] = ()  # no Hub name (load-balancing state): to_hf leaves them out


LLAMA3 = TitanFamily("llama3", {**_COMMON, **_QKV}, permuted=True)
QWEN3 = TitanFamily("qwen3", {**_COMMON, **_QKV, **_QK_NORM, **_ROUTER}, dropped=(_BIAS,))
DEEPSEEK_V3 = TitanFamily("deepseek_v3", {**_COMMON, **_ROUTER, **_MLA})

# config.json's model_type -> the torchtitan model whose adapter writes it
FAMILIES: dict[str, TitanFamily] = {"llama": LLAMA3, "qwen3": QWEN3, "qwen3_moe": QWEN3, "deepseek_v3": DEEPSEEK_V3}


def _config_option() -> str:
    return option("config", meta="HF_DIR")


_LAYER = re.compile(r"(?P<stack>mtp_layers|layers)\.(?P<layer>\d+)\.(?P<rest>.+)")


def is_torchtitan(names) -> bool:
    return any(_TITAN.fullmatch(name) for name in names)


def as_030(name: str, family: TitanFamily) -> str:
    """A 0.2.2 name as 0.3 spells it (0.3's names unchanged)."""
    for pattern, new in _RENAMED_IN_030:
        if pattern.fullmatch(name):
            return pattern.sub(new, name)
    if family is not DEEPSEEK_V3 and _QKV_022.fullmatch(name):
        return _QKV_022.sub(r"\1.attention.qkv_linear.w\2.weight", name)
    return name


@dataclass(frozen=True)
class Heads:
    """From config.json: the heads whose rows llama3's permutation reorders."""

    q: int
    kv: int
    head_dim: int | None


def hub_tensors(tensors: tuple[TensorPlan, ...], family: TitanFamily, heads: Heads | None, clean) -> tuple[list, list]:
    """The plan's tensors under the Hub's names (transformers 5's packed experts), and the names left out.
    `clean`: the written name of a checkpoint name (plan.normalise.clean_name)."""
    named: dict[str, TensorPlan] = {}
    for t in tensors:
        name = as_030(clean(t.name), family)
        if name in named:  # a 0.2.2 name and a 0.3 name of one tensor: which to write cannot be told
            raise BadInput(
                f"{named[name].name} and {t.name} are both torchtitan's {name}; the checkpoint mixes versions"
            )
        named[name] = t
    main = [int(m["layer"]) for n in named if (m := _LAYER.fullmatch(n)) and m["stack"] == "layers"]
    main_layers = 1 + max(main, default=-1)
    windows = Windows(tensors)
    out, dropped, experts = [], [], {}
    for name, tensor in named.items():
        layer = _LAYER.fullmatch(name)
        rest = layer["rest"] if layer else name
        if rest in family.dropped:
            dropped.append(tensor.name)
            continue
        if layer and rest in (*_EXPERTS, _DOWN):
            experts.setdefault(_hub_layer(layer, main_layers), {})[rest] = tensor
            continue
        hub = family.layer_names.get(rest) if layer else _TOP.get(name)
        if hub is None:
            raise BadInput(
                f"{tensor.name}: a torchtitan tensor with no Hugging Face name in the {family.name} map "
                f"(chosen by config.json's model_type); pass {_config_option()} with the base model the run started from"
            )
        hub = f"{_hub_layer(layer, main_layers)}.{hub}" if layer else hub
        if family.permuted and rest in ("attention.qkv_linear.wq.weight", "attention.qkv_linear.wk.weight"):
            out.append(permuted_rows(tensor, hub, _permuted_heads(tensor, rest, heads)))
        else:
            out.append(tensor if hub == tensor.name else replace(tensor, name=hub))
    for prefix, found in experts.items():
        out += _packed(windows, prefix, found)
    return out, dropped


def _hub_layer(layer, main_layers: int) -> str:
    """A layer's Hub prefix: the multi-token prediction layers follow the main ones (deepseek_v3's to_hf)."""
    index = int(layer["layer"]) + (main_layers if layer["stack"] == "mtp_layers" else 0)
    return f"model.layers.{index}"


def _permuted_heads(tensor: TensorPlan, rest: str, heads: Heads | None) -> int:
    if heads is None:
        raise BadInput(f"{tensor.name}: the RoPE permutation needs the heads: config.json has no num_attention_heads")
    n = heads.q if "wq" in rest else heads.kv
    rows = tensor.shape[0] if len(tensor.shape) == 2 else 0
    if not rows or rows % (2 * n) or (heads.head_dim is not None and rows != n * heads.head_dim):
        raise BadInput(
            f"{tensor.name}: {list(tensor.shape)} is not {n} heads of {heads.head_dim or 'even'} rows as config.json "
            f"says; pass {_config_option()} with the base model the run started from"
        )
    return n


def permuted_rows(tensor: TensorPlan, name: str, heads: int) -> TensorPlan:
    """`tensor` [heads * head_dim, cols] with each head's rows 2i + j moved to j * head_dim/2 + i: torchtitan's
    `w.view(heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)`, as two windows of strided
    rows (j = 0, 1). Seen as [heads, head_dim/2, 2 * cols], row pair i of a head is one row, and j its half;
    the output seen as [heads, head_dim, cols] takes half j of every pair at rows j * head_dim/2 + i."""
    rows, cols = tensor.shape
    half = rows // heads // 2
    source = replace(tensor, shape=(heads, half, 2 * cols))  # the same elements in the same order: a view
    windows = [Window(tensor.name, (0, 0, j * cols), (heads, half, cols), (0, j * half, 0)) for j in (0, 1)]
    built = Windows([source]).whole(name, (heads, 2 * half, cols), windows)
    return replace(built, shape=(rows, cols))


def _packed(windows: Windows, prefix: str, found: dict[str, TensorPlan]) -> list[TensorPlan]:
    """A layer's routed experts as transformers 5 packs them: gate_up_proj [E, 2F, D] = [w1; w3] per expert."""
    if set(found) != {*_EXPERTS, _DOWN}:
        raise BadInput(f"{prefix}: torchtitan's routed experts are w1, w2 and w3; this layer holds {sorted(found)}")
    w1, w3 = (found[k] for k in _EXPERTS)
    if len(w1.shape) != 3 or w1.shape != w3.shape:
        raise BadInput(f"{w1.name} {list(w1.shape)} and {w3.name} {list(w3.shape)}: experts are [E, F, D] alike")
    experts, hidden, dim = w1.shape
    gate_up = windows.whole(
        f"{prefix}.mlp.experts.gate_up_proj",
        (experts, 2 * hidden, dim),
        [Window(w1.name, (0, 0, 0), w1.shape, (0, 0, 0)), Window(w3.name, (0, 0, 0), w3.shape, (0, hidden, 0))],
    )
    return [gate_up, replace(found[_DOWN], name=f"{prefix}.mlp.experts.down_proj")]
