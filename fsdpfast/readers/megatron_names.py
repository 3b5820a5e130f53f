"""Megatron-Core GPT names and shapes onto Hugging Face Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral /
DeepSeek-V3 / GLM-4.5 / gpt-oss ones: a plan transform.

readers.megatron reads the checkpoint's own tensors (Megatron's names and global shapes, layer
tensors stacked (L, ...) or per layer), checks them against the model's sizes, and attaches this
conversion to its plan (MergePlan.conversions), which the pipeline applies before any check. Each
Hugging Face tensor is a set of windows of those tensors (plan.windows), so the split is byte
placement, no arithmetic:
- linear_qkv interleaves q, k, v per query group: layer i viewed as (g, (n/g + 2)·d, h), per group
  the first (n/g)·d rows are q, the next d rows k, the last d v; q_proj is the groups' q rows in
  order, and so on. Its bias (Qwen2) is split the same way.
- linear_fc1 is [gate; up] (f rows each) whatever the TP;
- the norms carry TransformerEngine's names (linear_qkv.layer_norm_weight is input_layernorm);
  Qwen3's per-head q_layernorm / k_layernorm are self_attn.q_norm / k_norm, one to one.
- MoE layers (Qwen3-MoE): the router is mlp.gate; the routed experts are stacked on a global expert
  axis whatever the expert parallelism (experts.experts.linear_fc1.weight (L, E, 2F, H), each
  expert's rows [gate; up] as the dense fc1; linear_fc2 (L, E, H, F)), so layer i is transformers'
  packed mlp.experts.gate_up_proj (E, 2F, H) and down_proj (E, H, F); families.hub_experts then
  writes them one tensor per expert, as save_pretrained does (or keeps them packed).
- gpt-oss (megatron-bridge's map): the Hub keeps its experts packed and transposed, gate and up
  interleaved: gate_up_proj[e] (H, 2F) is the (2F, H) matrix whose row 2j is fc1[e]'s gate row j and row
  2j+1 its up row j (two windows landing every second row: plan.windows.Window.step), written transposed (plan.model.Transposed); its bias interleaved
  alike; down_proj[e] (F, H) is fc2[e] transposed; self_attn.sinks is core_attention.softmax_offset; the
  attention, router and expert biases beside their weights.
- DeepSeek-V3: multi-latent attention, the shared experts (fc1 [gate; up] as the dense one) and the
  router's expert_bias (e_score_correction_bias) are one-to-one renames (megatron-bridge's map); MTP block k
  is the Hub's model.layers.{L+k}.
- GLM-4.5 (glm4_moe): grouped attention with Qwen2's QKV bias and, with use_qk_norm, Qwen3's q/k norms (its
  partial RoPE changes no weight), and DeepSeek-V3's MoE and MTP names (megatron-bridge's GLM map).
Embedding rows past config.json's vocab_size are Megatron's vocabulary padding and are left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod

from ..errors import BadInput
from ..plan.model import MergePlan, TensorPlan
from ..plan.transform import ExpectedModels, NamesOnly
from ..plan.windows import Window, Windows

LAYER = re.compile(r"decoder\.layers\.(?:(\d+)\.)?(.+)")
# DeepSeek-V3's multi-token prediction block k: its own tensors, and a decoder layer under transformer_layer.
MTP = re.compile(r"mtp\.layers\.(\d+)\.(.+)")
MTP_INNER = "transformer_layer."
MTP_OWN = {  # Megatron key -> Hugging Face name in model.layers.{L+k} (the Hub's, megatron-bridge's map)
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}
NORMS = {  # Megatron layer key -> Hugging Face name in the layer (TransformerEngine names, and the local spec's)
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
QKV = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
PROJ, FC1, FC2 = "self_attention.linear_proj.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"
QK_NORMS = {
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
ROUTER = "mlp.router.weight"
EXPERT_FC1, EXPERT_FC2 = "mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc2.weight"
MOE_KEYS = (ROUTER, EXPERT_FC1, EXPERT_FC2)
EXPERT_BIAS = "mlp.router.expert_bias"  # DeepSeek-V3's e_score_correction_bias (float32 by design)
# gpt-oss: biases on o_proj, the router and the experts; the attention sinks (a learnable softmax offset per head)
PROJ_BIAS, SINKS = "self_attention.linear_proj.bias", "self_attention.core_attention.softmax_offset"
ROUTER_BIAS = "mlp.router.bias"
EXPERT_FC1_BIAS, EXPERT_FC2_BIAS = "mlp.experts.experts.linear_fc1.bias", "mlp.experts.experts.linear_fc2.bias"
GPT_OSS_KEYS = (PROJ_BIAS, SINKS)
GPT_OSS_MOE_KEYS = (ROUTER_BIAS, EXPERT_FC1_BIAS, EXPERT_FC2_BIAS)
SHARED_FC1, SHARED_FC2 = "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"
SHARED_KEYS = (SHARED_FC1, SHARED_FC2)
# Multi-latent attention (DeepSeek-V3), one to one: Megatron key -> Hugging Face name in the layer. The local
# spec's q/kv norms are q_layernorm / kv_layernorm, TransformerEngine's the up projections' layer_norm_weight.
MLA = {
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",  # q_lora_rank None
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}
MLA_MARKS = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_q_proj.weight")  # one per MLA layer
DENSE_KEYS = (FC1, FC2)
EMBED, OUTPUT, FINAL_NORM = "embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"


@dataclass(frozen=True)
class Sizes:
    """The model's sizes, from config.json."""

    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    layers: int
    vocab: int
    tied: bool
    tie_stated: bool  # False: config.json does not say, and means untied (transformers' default)
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and of k
    experts: int = 0  # routed experts of an MoE layer (Qwen3-MoE); 0: a dense model
    expert_ffn: int = 0  # each expert's intermediate size
    moe_layers: frozenset[int] = frozenset()  # the layers with experts; the others have a dense MLP
    shared_ffn: int = 0  # the shared experts' intermediate size (DeepSeek-V3); 0: none
    expert_bias: bool = False  # the router's expert_bias (DeepSeek-V3's e_score_correction_bias)
    mla: bool = False  # multi-latent attention (DeepSeek-V3): head_dim is then v_head_dim
    q_rank: int = 0  # q_lora_rank; 0: q is one projection (linear_q_proj)
    kv_rank: int = 0
    nope: int = 0  # qk_nope_head_dim
    rope: int = 0  # qk_rope_head_dim
    mtp: int = 0  # multi-token prediction layers (num_nextn_predict_layers), written as layers L..L+mtp-1
    gpt_oss: bool = False  # gpt-oss: biases, attention sinks, experts packed transposed with gate/up interleaved
    leading_dense: bool = (
        False  # config.json's first_k_dense_replace says which layers are dense (DeepSeek-V3, GLM-4.5)
    )
    expert_keys: tuple[str, str] = ("num_experts", "moe_intermediate_size")  # config.json's, for the messages


def mla_shapes(s: Sizes) -> dict[str, tuple[int, ...]]:
    """Each MLA tensor's layer shape (Megatron key -> shape) from config.json's sizes."""
    q_rows, h = s.heads * (s.nope + s.rope), s.hidden
    return {
        "self_attention.linear_q_down_proj.weight": (s.q_rank, h),
        "self_attention.q_layernorm.weight": (s.q_rank,),
        "self_attention.linear_q_up_proj.layer_norm_weight": (s.q_rank,),
        "self_attention.linear_q_up_proj.weight": (q_rows, s.q_rank),
        "self_attention.linear_q_proj.weight": (q_rows, h),
        "self_attention.linear_kv_down_proj.weight": (s.kv_rank + s.rope, h),
        "self_attention.kv_layernorm.weight": (s.kv_rank,),
        "self_attention.linear_kv_up_proj.layer_norm_weight": (s.kv_rank,),
        "self_attention.linear_kv_up_proj.weight": (s.heads * (s.nope + s.head_dim), s.kv_rank),
    }


def mtp_tensors(tensors: dict) -> dict[int, dict[str, object]]:
    """MTP block k -> {its key (transformer_layer.X for its decoder layer): tensor}."""
    blocks: dict[int, dict] = {}
    for name, tensor in tensors.items():
        match = MTP.fullmatch(name)
        if match:
            blocks.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
    return blocks


def layer_tensors(tensors: dict) -> dict[str, dict]:
    """Layer key -> {layer index: tensor} for per-layer names, or {None: the stacked tensor}."""
    layers: dict[str, dict] = {}
    for name, tensor in tensors.items():
        match = LAYER.fullmatch(name)
        if match:
            index = None if match.group(1) is None else int(match.group(1))
            layers.setdefault(match.group(2), {})[index] = tensor
    return layers


@dataclass(frozen=True)
class MegatronToHuggingFace(NamesOnly):
    """The plan transform (plan.transform.PlanTransform) of a Megatron plan read with these sizes."""

    folder: str  # the checkpoint folder, for the messages
    sizes: Sizes

    def apply(self, plan: MergePlan, models: ExpectedModels | None = None) -> MergePlan:
        tensors = {t.name: t for t in plan.tensors}
        windows = Windows(plan.tensors)
        made = [
            self._made(windows, name, shape, parts)
            for name, shape, parts in _outputs(tensors, layer_tensors(tensors), self.sizes)
        ]
        return plan.but(tensors=made)

    def _made(self, windows: Windows, name: str, shape: tuple[int, ...], parts) -> TensorPlan:
        if isinstance(parts, Swapped):
            return windows.transposed_of(name, parts.shape, parts.windows)
        tensor = windows.tensor(name, shape, parts)
        covered = sum(e.numel for e in tensor.extents)
        if covered != prod(shape):
            raise BadInput(
                f"{self.folder}: the chunks of {parts[0].tensor} cover {covered} of the "
                f"{prod(shape)} elements of {name}; the checkpoint is incomplete"
            )
        return tensor


@dataclass(frozen=True)
class Swapped:
    """An output written transposed: the tensor of `shape` the windows fill, its last two dimensions swapped."""

    shape: tuple[int, ...]
    windows: list[Window]


def _outputs(model: dict, layers: dict, s: Sizes):
    """(Hugging Face name, shape, the windows it is made of), in the model's order."""

    def whole(tensor: TensorPlan, rows=None) -> list[Window]:
        ndim = len(tensor.shape)
        sizes = tensor.shape if rows is None else (rows, *tensor.shape[1:])
        return [Window(tensor.name, (0,) * ndim, sizes, (0,) * ndim)]

    yield "model.embed_tokens.weight", (s.vocab, s.hidden), whole(model[EMBED], s.vocab)
    for i in range(s.layers):
        yield from _layer(layers, i, s, i in s.moe_layers)
    yield "model.norm.weight", (s.hidden,), whole(model[FINAL_NORM])
    if OUTPUT in model:
        yield "lm_head.weight", (s.vocab, s.hidden), whole(model[OUTPUT], s.vocab)
    for k, block in sorted(mtp_tensors(model).items()):  # the Hub's model.layers.{L+k}, after the model
        i, h = s.layers + k, s.hidden
        for key, hf in MTP_OWN.items():
            shape = (h, 2 * h) if key == "eh_proj.weight" else (h,)
            yield f"model.layers.{i}.{hf}", shape, whole(block[key])
        inner = {key[len(MTP_INNER) :]: {i: t} for key, t in block.items() if key.startswith(MTP_INNER)}
        yield from _layer(inner, i, s, ROUTER in inner)


def _layer(layers: dict, i: int, s: Sizes, moe: bool):
    """Layer i's Hugging Face tensors from its Megatron ones (layer key -> {index or None: tensor})."""
    prefix = f"model.layers.{i}."
    for key, hf in NORMS.items():  # per layer: a TE-spec dense layer fuses its pre-MLP norm, an MoE layer does not
        if key in layers and i in _held(layers[key]):
            yield prefix + hf, (s.hidden,), _layer_window(layers[key], i, ((0, s.hidden),))
    for key in QKV:
        if key in layers:
            yield from _qkv(layers[key], i, s, prefix, key.rsplit(".", 1)[1])
    if s.mla:
        shapes = mla_shapes(s)
        for key, hf in MLA.items():
            if key in layers and i in _held(layers[key]):
                shape = shapes[key]
                yield prefix + hf, shape, _layer_window(layers[key], i, tuple((0, n) for n in shape))
    h, inner, d = s.hidden, s.heads * s.head_dim, s.head_dim
    yield prefix + "self_attn.o_proj.weight", (h, inner), _layer_window(layers[PROJ], i, ((0, h), (0, inner)))
    if s.gpt_oss:
        yield prefix + "self_attn.o_proj.bias", (h,), _layer_window(layers[PROJ_BIAS], i, ((0, h),))
        yield prefix + "self_attn.sinks", (s.heads,), _layer_window(layers[SINKS], i, ((0, s.heads),))
    for key, hf in QK_NORMS.items():
        if key in layers and not s.mla:
            yield prefix + hf, (d,), _layer_window(layers[key], i, ((0, d),))
    if moe and s.gpt_oss:
        yield from _gpt_oss_moe(layers, i, s, prefix)
        return
    if moe:
        e, f = s.experts, s.expert_ffn
        yield prefix + "mlp.gate.weight", (e, h), _layer_window(layers[ROUTER], i, ((0, e), (0, h)))
        if s.expert_bias:
            bias = "mlp.gate.e_score_correction_bias"
            yield prefix + bias, (e,), _layer_window(layers[EXPERT_BIAS], i, ((0, e),))
        if s.shared_ffn:
            g, fc1, fc2 = s.shared_ffn, layers[SHARED_FC1], layers[SHARED_FC2]
            yield prefix + "mlp.shared_experts.gate_proj.weight", (g, h), _layer_window(fc1, i, ((0, g), (0, h)))
            yield prefix + "mlp.shared_experts.up_proj.weight", (g, h), _layer_window(fc1, i, ((g, g), (0, h)))
            yield prefix + "mlp.shared_experts.down_proj.weight", (h, g), _layer_window(fc2, i, ((0, h), (0, g)))
        box = ((0, e), (0, 2 * f), (0, h))
        yield prefix + "mlp.experts.gate_up_proj", (e, 2 * f, h), _layer_window(layers[EXPERT_FC1], i, box)
        box = ((0, e), (0, h), (0, f))
        yield prefix + "mlp.experts.down_proj", (e, h, f), _layer_window(layers[EXPERT_FC2], i, box)
        return
    yield prefix + "mlp.gate_proj.weight", (s.ffn, h), _layer_window(layers[FC1], i, ((0, s.ffn), (0, h)))
    yield prefix + "mlp.up_proj.weight", (s.ffn, h), _layer_window(layers[FC1], i, ((s.ffn, s.ffn), (0, h)))
    yield prefix + "mlp.down_proj.weight", (h, s.ffn), _layer_window(layers[FC2], i, ((0, h), (0, s.ffn)))


def _gpt_oss_moe(layers: dict, i: int, s: Sizes, prefix: str):
    """Layer i's router and packed experts as gpt-oss's Hub holds them (megatron-bridge's map): fc1's gate row j
    at row 2j and up row j at 2j+1 of (E, 2F, H), written transposed as (E, H, 2F); its bias (E, 2F) interleaved
    alike; down_proj fc2 (E, H, F) written transposed as (E, F, H)."""
    e, f, h = s.experts, s.expert_ffn, s.hidden
    yield prefix + "mlp.router.weight", (e, h), _layer_window(layers[ROUTER], i, ((0, e), (0, h)))
    yield prefix + "mlp.router.bias", (e,), _layer_window(layers[ROUTER_BIAS], i, ((0, e),))
    fc1, fc1_bias = layers[EXPERT_FC1], layers[EXPERT_FC1_BIAS]
    # gate (fc1 rows 0..F) to every second row from 0, up (rows F..2F) from 1: two windows, whatever F is
    halves = ((0, 0), (f, 1))  # (fc1 row, first interleaved row)
    weight = [
        w
        for row, at in halves
        for w in _layer_window(fc1, i, ((0, e), (row, f), (0, h)), at=(0, at, 0), step=(1, 2, 1))
    ]
    yield prefix + "mlp.experts.gate_up_proj", (e, h, 2 * f), Swapped((e, 2 * f, h), weight)
    bias = [w for row, at in halves for w in _layer_window(fc1_bias, i, ((0, e), (row, f)), at=(0, at), step=(1, 2))]
    yield prefix + "mlp.experts.gate_up_proj_bias", (e, 2 * f), bias
    down = _layer_window(layers[EXPERT_FC2], i, ((0, e), (0, h), (0, f)))
    yield prefix + "mlp.experts.down_proj", (e, f, h), Swapped((e, h, f), down)
    box = ((0, e), (0, h))
    yield prefix + "mlp.experts.down_proj_bias", (e, h), _layer_window(layers[EXPERT_FC2_BIAS], i, box)


def _held(found: dict) -> set[int]:
    """The layers a stacked or per-layer tensor holds."""
    return set(range(found[None].shape[0])) if None in found else set(found)


def _layer_window(
    found: dict, i: int, box, at_row: int = 0, at: tuple[int, ...] | None = None, step: tuple[int, ...] | None = None
) -> list[Window]:
    """Layer i's box ((start, size) per dimension) of a stacked or per-layer tensor, placed at row `at_row`
    (or at `at`), every `step`-th slot per dimension (plan.windows.Window)."""
    offsets, sizes = tuple(start for start, _ in box), tuple(size for _, size in box)
    at = at if at is not None else (at_row,) + (0,) * (len(box) - 1)
    if None in found:
        return [Window(found[None].name, (i, *offsets), (1, *sizes), at, None if step is None else (1, *step))]
    return [Window(found[i].name, offsets, sizes, at, step)]


def _qkv(found: dict, i: int, s: Sizes, prefix: str, kind: str):
    """q_proj, k_proj, v_proj of layer i: per query group, (n/g)·d rows of q, then d of k, then d of v."""
    per_group, d = s.heads // s.groups, s.head_dim
    group_rows = (per_group + 2) * d
    tail = ((0, s.hidden),) if kind == "weight" else ()
    parts = (("q", 0, per_group * d), ("k", per_group * d, d), ("v", (per_group + 1) * d, d))
    for proj, start, rows in parts:
        windows = [
            w
            for group in range(s.groups)
            for w in _layer_window(found, i, ((group * group_rows + start, rows), *tail), at_row=group * rows)
        ]
        shape = (s.groups * rows, s.hidden) if kind == "weight" else (s.groups * rows,)
        yield f"{prefix}self_attn.{proj}_proj.{kind}", shape, windows
