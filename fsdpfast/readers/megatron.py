"""Megatron-Core torch_dist checkpoints of GPT models, written as Hugging Face Llama / Mistral / Qwen2 / Qwen3 /
Qwen3-MoE / Mixtral / DeepSeek-V3 / GLM-4.5 / gpt-oss models.

The folder is a DCP folder (read by readers.dcp) whose tensors carry Megatron's names and global
shapes: TP, PP, virtual pipeline stages, expert parallelism (EP) and expert tensor parallelism (ETP)
only decide which chunks exist, so all are handled by the chunk boxes. Layer tensors are stacked:
`decoder.layers.self_attention.linear_qkv.weight` is (L, (n + 2g)·d, h), layer i at index i whatever
the pipeline stage that saved it (per-layer `decoder.layers.{i}.` names, as a heterogeneous checkpoint
or an MoE model with dense layers has them, are read too); routed experts are stacked on a global
expert axis too, whatever the EP rank that saved them. The plan holds
those tensors under their own names; the map onto Hugging Face names (q/k/v and gate/up splits,
per-layer tensors, the vocabulary padding left out) is the plan transform readers.megatron_names
attaches (MergePlan.conversions), which the pipeline applies before any check.
No output_layer.weight means tied embeddings. Embedding rows past config.json's vocab_size are
Megatron's vocabulary padding and are left out. The model's sizes come from config.json (--config,
or huggingface/ in or beside the folder); without one, from the training args a run keeps in common.pt
(readers.megatron_args), which then give the output's config.json (readers.megatron_config). Every
tensor's shape is checked against the sizes, and the args, where common.pt holds them, against the
tensors and config.json alike (readers.megatron_checks).
Optimizer state beside the model is not merged.
"""

from __future__ import annotations

import os

from ..errors import BadInput, option
from ..geometry.boxes import box_extents
from ..hf.config import load_config
from ..plan.model import MergePlan, TensorPlan
from . import dcp, megatron_checks, megatron_config
from .megatron_args import COMMON, read_training_args
from .megatron_folder import is_torch_dist
from .megatron_names import (
    DENSE_KEYS,
    EMBED,
    EXPERT_BIAS,
    EXPERT_FC1,
    EXPERT_FC1_BIAS,
    EXPERT_FC2,
    EXPERT_FC2_BIAS,
    FC1,
    FC2,
    FINAL_NORM,
    GPT_OSS_KEYS,
    GPT_OSS_MOE_KEYS,
    LAYER,
    MLA,
    MLA_MARKS,
    MOE_KEYS,
    MTP,
    MTP_INNER,
    MTP_OWN,
    NORMS,
    OUTPUT,
    PROJ,
    QK_NORMS,
    QKV,
    ROUTER,
    ROUTER_BIAS,
    SHARED_FC1,
    SHARED_KEYS,
    MegatronToHuggingFace,
    Sizes,
    layer_tensors,
    mla_shapes,
    mtp_tensors,
)
from .reader import Reader

NAME = "megatron"
DESCRIPTION = "metadata.json (torch_dist) + .metadata + .distcp: Megatron-Core dist_checkpointing (iter_N/ folders)"
_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "deepseek_v3",
    "glm4_moe",
    "mixtral",
    "gpt_oss",
)  # whose Hugging Face names and layout this writes
_QK_NORM = ("qwen3", "qwen3_moe")  # families with an RMSNorm over each head of q and k
_MOE = ("qwen3_moe", "deepseek_v3", "glm4_moe", "mixtral", "gpt_oss")  # the MoE families this layout writes
# DeepSeek-V3's MoE (layers from first_k_dense_replace on, shared experts, the router's correction bias, MTP layers)
_DEEPSEEK_MOE = ("deepseek_v3", "glm4_moe")
_MOE_LAYER = (*MOE_KEYS, *SHARED_KEYS, EXPERT_BIAS, *GPT_OSS_MOE_KEYS)  # tensors of the layers with experts only
_HEAD_DIM = {"qwen3": 128}  # config.json without head_dim: transformers' default (others: hidden / heads)
_NOT_MODEL = ("optimizer.", "rng_state", "rerun_state_machine")  # a training checkpoint's other parts
# What unknown names reveal, for the refusal: (a piece of the name, what it means)
_KNOWN_UNSUPPORTED = (  # the first piece a name holds says what it is
    ("mtp.", "multi-token prediction (MTP) layers"),
    ("shared_experts", "shared experts"),
    ("router.expert_bias", "a router expert_bias (balancing without an auxiliary loss)"),
    ("router.bias", "a router bias"),
    ("linear_fc1.bias", "MLP biases"),
    ("linear_fc2.bias", "MLP biases"),
    ("linear_proj.bias", "an attention output bias"),
    ("position_embeddings", "learned position embeddings (not RoPE)"),
    ("layer_norm_bias", "LayerNorm (not RMSNorm)"),
    ("vision", "a vision tower"),
)


def matches(folder: str) -> bool:
    return is_torch_dist(folder) and os.path.isfile(os.path.join(folder, ".metadata"))


def read(folder: str, config: str | None = None) -> MergePlan:
    chunked = dcp.read_chunks(folder)
    model = {k: t for k, t in chunked.tensors.items() if not k.startswith(_NOT_MODEL)}
    layers = _layer_tensors(folder, model)
    _refuse_unknown(folder, model, layers)  # before asking for a config: no config makes an MoE model mergeable
    args, args_note = read_training_args(folder)
    found = _tensor_sizes(model, layers)
    if args is not None:  # the args against the tensors first: with a config.json or without, the same checks
        megatron_checks.refuse_what_hf_does_not_compute(folder, args, gpt_oss=found.gpt_oss)
        megatron_checks.check_against_tensors(folder, args, found)
    config, config_note = _config_dir(folder, config, args is not None, args_note)
    built, positions_note, eps_note = None, None, None
    if config is None and found.gpt_oss:  # the args cannot build a gpt_oss config (sinks, windows, clamped GLU)
        raise BadInput(
            f"{folder}: a Megatron gpt-oss checkpoint (attention sinks, biases) with no Hugging Face config; pass "
            f"{option('config', meta='DIR')} (a folder with the model's gpt_oss config.json)"
        )
    if config is None:  # no config.json anywhere: the run's own args say what the model is
        built, config_note = megatron_config.build(
            folder,
            args,
            rows=found.rows,
            tied=found.tied,
            qkv_bias=found.qkv_bias,
            qk_norm=found.qk_norm,
            experts=found.experts,
            mla=found.mla,
            dtype=model[EMBED].dtype,
        )
        source = f"config.json built from {COMMON}"
        sizes = _sizes(built, source)
        _check_shapes(folder, source, model, layers, sizes)
    else:
        source = os.path.join(config, "config.json")
        values = load_config(source)
        sizes = _sizes(values, source)
        _check_family(folder, source, values, found, sizes)
        _check_shapes(folder, source, model, layers, sizes)
        if args is not None:  # what the shapes cannot tell: which heads, epsilon, RoPE, activation, padding
            positions_note = megatron_checks.check_against_config(folder, source, values, sizes, args, found)
        eps_note = _latent_norms_note(values) if sizes.mla else None
    tensors = [_tensor(tensor) for tensor in model.values()]
    conversion = MegatronToHuggingFace(folder, sizes)
    plan = MergePlan(
        NAME,
        chunked.world_size,
        chunked.sources,
        tensors,
        config_dir=config,
        built_config=built,
        conversions=(conversion,),
    )
    moe = (
        f", {len(sizes.moe_layers)} of them MoE with {sizes.experts} experts of ffn size {sizes.expert_ffn}"
        if sizes.moe_layers
        else ""
    )
    plan = plan.noted(
        f"Megatron GPT: {sizes.layers} layers{moe}, "
        + (
            f"{sizes.mtp} MTP layer{'s' if sizes.mtp > 1 else ''} (model.layers.{sizes.layers}...), "
            if sizes.mtp
            else ""
        )
        + (
            f"multi-latent attention with {sizes.heads} heads, "
            if sizes.mla
            else f"{sizes.heads} heads in {sizes.groups} query groups of head dim {sizes.head_dim}, "
        )
        + f"from {source}",
        config_note,
        args_note,
        f"config.json's sizes agree with the training args in {COMMON}" if args is not None and built is None else None,
        positions_note,
        eps_note,
    )
    if model[EMBED].shape[0] > sizes.vocab:
        plan = plan.noted(
            f"left out: embedding rows {sizes.vocab}..{model[EMBED].shape[0] - 1}, Megatron's vocabulary "
            f"padding past config.json's vocab_size {sizes.vocab}"
        )
    others = [k for k in chunked.tensors if k not in model] + [k for k in chunked.others if "_extra_state" not in k]
    if others:
        plan = plan.noted(
            f"not merged: {len(others)} other entries ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})"
        )
    return plan


def _latent_norms_note(values: dict) -> str | None:
    """transformers' DeepseekV3 normalises the q and kv latents (q_a_layernorm, kv_a_layernorm) with eps 1e-6
    whatever rms_norm_eps says; megatron-core's MLA with the run's epsilon. Another epsilon changes no weight,
    but transformers' logits then differ a little from Megatron's (3e-5 on the test fixture with 1e-5)."""
    eps = values.get("rms_norm_eps")
    if not isinstance(eps, (int, float)) or eps == 1e-6:
        return None
    return (
        f"rms_norm_eps {eps} kept: transformers' DeepseekV3 computes q_a_layernorm and kv_a_layernorm with eps 1e-6 "
        "whatever config.json says (Megatron with the run's epsilon), so its logits differ slightly from Megatron's"
    )


def _config_dir(folder: str, given: str | None, has_args: bool, args_note: str | None) -> tuple[str | None, str | None]:
    """(the folder with config.json, a note where found); (None, None): none, but the args can build one."""
    if given:
        return given, None
    parent = os.path.dirname(os.path.abspath(folder))
    for candidate in (os.path.join(folder, "huggingface"), folder, os.path.join(parent, "huggingface")):
        if os.path.isfile(os.path.join(candidate, "config.json")):
            beside = not os.path.abspath(candidate).startswith(os.path.abspath(folder) + os.sep) and candidate != folder
            return candidate, (f"config.json from {candidate}, beside the checkpoint folder" if beside else None)
    if has_args:
        return None, None
    why = f" ({args_note})" if args_note else ""
    raise BadInput(
        f"{folder}: a Megatron checkpoint with no Hugging Face config and no training args in {COMMON}{why}; pass "
        f"{option('config', meta='DIR')} (a folder with the model's config.json: its sizes place the tensors, "
        "and it is copied to the output)"
    )


def _sizes(values: dict, path: str) -> Sizes:
    model_type = values.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise BadInput(
            f"{path}: model_type {model_type!r}; the megatron layout writes {', '.join(_MODEL_TYPES)} models "
            "(Megatron GPT with RMSNorm, SwiGLU, RoPE)"
        )

    def number(key, default=None):
        value = values.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise BadInput(f"{path}: {key} is {value!r}, not a positive whole number")
        return value

    hidden, heads = number("hidden_size"), number("num_attention_heads")
    groups = number("num_key_value_heads", heads)
    if heads % groups:
        raise BadInput(f"{path}: {heads} attention heads do not divide into {groups} key/value heads")
    head_dim = number("head_dim") if values.get("head_dim") is not None else _HEAD_DIM.get(model_type, hidden // heads)
    tied = values.get("tie_word_embeddings")
    layers = number("num_hidden_layers")
    if model_type == "deepseek_v3":
        return _deepseek_sizes(values, path, number, hidden, heads, tied)
    moe = {}
    if model_type == "glm4_moe":  # grouped attention as Qwen2 / Qwen3 (q/k norms with use_qk_norm), DeepSeek-V3's MoE
        moe = _deepseek_moe(values, path, number, layers)
    elif model_type == "qwen3_moe":  # transformers' rule: a layer has experts unless in mlp_only_layers, every step-th
        step = number("decoder_sparse_step", 1)
        dense = values.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise BadInput(f"{path}: mlp_only_layers is {dense!r}, not a list of layer numbers")
        moe = dict(
            experts=number("num_experts"),
            expert_ffn=number("moe_intermediate_size"),
            moe_layers=frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
        )
    elif model_type in ("mixtral", "gpt_oss"):  # every layer has experts; intermediate_size is each expert's
        moe = dict(
            experts=number("num_local_experts"),
            expert_ffn=number("intermediate_size"),
            moe_layers=frozenset(range(layers)),
            expert_keys=("num_local_experts", "intermediate_size"),
        )
    return Sizes(
        hidden,
        heads,
        groups,
        head_dim,
        number("intermediate_size"),
        layers,
        number("vocab_size"),
        tied is True,  # absent (or not a bool): untied, the default of Llama, Mistral and Qwen2
        isinstance(tied, bool),
        qk_norm=model_type in _QK_NORM or (model_type == "glm4_moe" and values.get("use_qk_norm") is True),
        gpt_oss=model_type == "gpt_oss",
        **moe,
    )


def _deepseek_sizes(values: dict, path: str, number, hidden: int, heads: int, tied) -> Sizes:
    """DeepSeek-V3: MLA (no query groups; o_proj's columns are heads x v_head_dim) and its MoE."""
    layers, q_rank = number("num_hidden_layers"), values.get("q_lora_rank")
    return Sizes(
        hidden,
        heads,
        heads,
        number("v_head_dim"),
        number("intermediate_size"),
        layers,
        number("vocab_size"),
        tied is True,
        isinstance(tied, bool),
        mla=True,
        q_rank=0 if q_rank is None else number("q_lora_rank"),
        kv_rank=number("kv_lora_rank"),
        nope=number("qk_nope_head_dim"),
        rope=number("qk_rope_head_dim"),
        **_deepseek_moe(values, path, number, layers),
    )


def _deepseek_moe(values: dict, path: str, number, layers: int) -> dict:
    """DeepSeek-V3's and GLM-4.5's MoE sizes: layers from first_k_dense_replace on with routed experts, the shared
    ones and the router's correction bias; num_nextn_predict_layers MTP layers after the model."""
    expert_ffn = number("moe_intermediate_size")
    counts = {}
    for key in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
        counts[key] = values.get(key) or 0
        if not isinstance(counts[key], int) or isinstance(counts[key], bool) or counts[key] < 0:
            raise BadInput(f"{path}: {key} is {counts[key]!r}, not a whole number")
    return dict(
        experts=number("n_routed_experts"),
        expert_ffn=expert_ffn,
        moe_layers=frozenset(range(counts["first_k_dense_replace"], layers)),
        shared_ffn=counts["n_shared_experts"] * expert_ffn,
        expert_bias=True,  # their gate always has e_score_correction_bias
        mtp=counts["num_nextn_predict_layers"],
        expert_keys=("n_routed_experts", "moe_intermediate_size"),
        leading_dense=True,
    )


def _tensor_sizes(model: dict, layers: dict) -> megatron_checks.TensorSizes:
    """What the tensors show, for the checks of the args (a missing dimension reads 0)."""

    def layer_shape(key):
        found = layers[key]
        return found[None].shape[1:] if None in found else next(iter(found.values())).shape

    def dim(shape, i):
        return shape[i] if len(shape) > i else 0

    def first(key, i):
        return dim(layer_shape(key), i) if key in layers else 0

    proj = layers[PROJ]
    embedding = model[EMBED].shape
    mla = any(key in layers for key in MLA_MARKS)
    return megatron_checks.TensorSizes(
        rows=dim(embedding, 0),
        hidden=dim(embedding, 1),
        layers=dim(proj[None].shape, 0) if None in proj else len(proj),
        qkv_rows=first(QKV[0], 0),
        attention=dim(layer_shape(PROJ), 1),
        fc1_rows=first(FC1, 0),
        ffn=first(FC2, 1),
        tied=OUTPUT not in model,
        qkv_bias=QKV[1] in layers,
        qk_norm=any(key in layers for key in QK_NORMS) and not mla,
        experts=first(ROUTER, 0),
        mla=mla,
        shared=SHARED_FC1 in layers,
        expert_bias=EXPERT_BIAS in layers,
        gpt_oss=any(key in layers for key in (*GPT_OSS_KEYS, *GPT_OSS_MOE_KEYS)),
    )


def _check_family(folder: str, path: str, values: dict, found: megatron_checks.TensorSizes, sizes: Sizes) -> None:
    """The tensors against config.json's family, for what the shapes cannot tell: the other pairings load with
    weights dropped or missing, or compute another model.
    - A QKV bias is Qwen2's (q, k and v carry one, o does not); Llama's attention_bias puts one on o_proj too,
      Mistral and Qwen3 have none.
    - q_layernorm / k_layernorm are Qwen3's q_norm / k_norm (Qwen3 and Qwen3-MoE have them, the others not).
    - Multi-latent attention is DeepSeek-V3's; shared experts and the router's expert_bias are DeepSeek-V3's and
      GLM-4.5's (whose QKV bias and q/k norms are attention_bias and use_qk_norm).
    - Routed experts are Qwen3-MoE's, Mixtral's, DeepSeek-V3's, GLM-4.5's or gpt-oss's; those have experts."""
    model_type = values["model_type"]
    how = f"pass {option('config', meta='DIR')} with"
    gpt_oss = model_type == "gpt_oss"
    if found.gpt_oss != gpt_oss:
        holds = (
            "holds gpt-oss's attention sinks and biases (core_attention.softmax_offset, linear_proj.bias, "
            "router.bias, expert biases)"
            if found.gpt_oss
            else "holds no attention sinks (core_attention.softmax_offset) nor output and MoE biases"
        )
        fits = "a gpt_oss config" if found.gpt_oss else "a config of another family (not gpt_oss)"
        raise BadInput(
            f"{folder}: the checkpoint {holds}, but {path} has model_type {model_type!r}: the config is not this "
            f"checkpoint's model; {how} {fits}"
        )
    if gpt_oss:  # gpt-oss has all of them, on q, k, v and o alike (attention_bias, true in its configs)
        if values.get("attention_bias", True) is not True or not found.qkv_bias:
            raise BadInput(
                f"{folder}: {path} is a gpt_oss config with attention_bias {values.get('attention_bias')!r} and the "
                f"checkpoint {'holds' if found.qkv_bias else 'holds no'} linear_qkv.bias: the config is not this "
                f"checkpoint's model; {how} its own"
            )
    mla = model_type == "deepseek_v3"
    if found.mla != mla:
        holds = (
            "holds multi-latent attention (self_attention.linear_q_down_proj / linear_kv_down_proj)"
            if found.mla
            else "holds no multi-latent attention (linear_qkv)"
        )
        fits = "a deepseek_v3 config" if found.mla else "a config without multi-latent attention (not deepseek_v3)"
        raise BadInput(
            f"{folder}: the checkpoint {holds}, but {path} has model_type {model_type!r}: the config is not this "
            f"checkpoint's model; {how} {fits}"
        )
    if model_type in _DEEPSEEK_MOE:
        for present, wanted, what in (
            (
                found.shared,
                bool(sizes.shared_ffn),
                f"shared experts (n_shared_experts {values.get('n_shared_experts')!r})",
            ),
            (found.expert_bias, bool(found.experts), "the router's expert_bias (e_score_correction_bias)"),
        ):
            if present != wanted:
                raise BadInput(
                    f"{folder}: the checkpoint holds {'' if present else 'no '}{what.split(' (')[0]}, but {path} "
                    f"{'has none' if present else 'has ' + what}: the config is not this checkpoint's model"
                )
    glm = model_type == "glm4_moe"  # its attention_bias: a bias on q, k and v (Megatron's QKV bias)
    has_flag = model_type in ("llama", *_QK_NORM, "glm4_moe")  # attention_bias (Llama's, Qwen3's: on o_proj too)
    wants = model_type == "qwen2" or (has_flag and values.get("attention_bias") is True)
    if glm:
        refused = found.qkv_bias != wants
    else:  # a QKV bias is Qwen2's only; without one, any config that wants none
        refused = (model_type != "qwen2") if found.qkv_bias else wants
    if not gpt_oss and refused:
        holds = "holds linear_qkv.bias (a bias on q, k and v only)" if found.qkv_bias else "holds no linear_qkv.bias"
        given = (
            f"model_type {model_type!r}"
            + (f" with attention_bias {values.get('attention_bias')!r}" if has_flag else "")
            + (", whose q, k and v carry a bias" if wants else "")
        )
        if found.qkv_bias and model_type in _QK_NORM:
            fits = "a qwen2 config, or a glm4_moe one with attention_bias true (Qwen3 has no QKV bias)"
        elif found.qkv_bias:
            fits = "a qwen2 config, or a glm4_moe one with attention_bias true"
        else:
            fits = "a llama, mistral, qwen3 or glm4_moe config without attention_bias"
        raise BadInput(
            f"{folder}: the checkpoint {holds}, but {path} has {given}: the config is not this checkpoint's model; "
            f"{how} {fits}"
        )
    if model_type not in _DEEPSEEK_MOE and (found.shared or found.expert_bias):
        what = "shared experts" if found.shared else "a router expert_bias"
        raise BadInput(
            f"{folder}: the checkpoint holds {what}, which {model_type!r} models have not; the megatron layout writes "
            f"them as DeepSeek-V3's or GLM-4.5's; {how} a deepseek_v3 or glm4_moe config"
        )
    if found.qk_norm != sizes.qk_norm:
        holds = (
            "holds self_attention.q_layernorm / k_layernorm (Qwen3's q_norm / k_norm)"
            if found.qk_norm
            else "holds no self_attention.q_layernorm / k_layernorm"
        )
        if glm:
            given = f"model_type 'glm4_moe' with use_qk_norm {values.get('use_qk_norm')!r}"
            raise BadInput(
                f"{folder}: the checkpoint {holds}, but {path} has {given}: the config is not this checkpoint's "
                f"model; {how} use_qk_norm {str(found.qk_norm).lower()}"
            )
        fits = (
            "a qwen3, qwen3_moe or glm4_moe (use_qk_norm true) config"
            if found.qk_norm
            else "a config without per-head q/k norms (not qwen3)"
        )
        raise BadInput(
            f"{folder}: the checkpoint {holds}, but {path} has model_type {model_type!r}: the config is not this "
            f"checkpoint's model; {how} {fits}"
        )
    if bool(found.experts) != (model_type in _MOE):
        holds = (
            f"holds MoE layers ({found.experts} experts: decoder.layers.{ROUTER})"
            if found.experts
            else "holds no MoE layers (no decoder.layers.mlp.router.weight)"
        )
        fits = (
            "a qwen3_moe, mixtral, deepseek_v3, glm4_moe or gpt_oss config (the MoE families the megatron layout writes)"
            if found.experts
            else "a dense one"
        )
        raise BadInput(
            f"{folder}: the checkpoint {holds}, but {path} has model_type {model_type!r}: the config is not this "
            f"checkpoint's model; {how} {fits}"
        )


def _layer_tensors(folder: str, model: dict) -> dict[str, dict[int | None, dcp.ChunkedTensor]]:
    """Layer key -> {layer index: tensor} for per-layer names, or {None: the stacked tensor}."""
    layers = layer_tensors(model)
    mixed = [key for key, found in layers.items() if None in found and len(found) > 1]
    if mixed:
        raise BadInput(
            f"{folder}: decoder.layers.{mixed[0]} is both stacked and per layer; the checkpoint is not one model"
        )
    return layers


def _refuse_unknown(folder: str, model: dict, layers: dict) -> None:
    known_layer = (
        set(NORMS)
        | set(QKV)
        | set(QK_NORMS)
        | set(MLA)
        | {PROJ, *DENSE_KEYS, *MOE_KEYS, *SHARED_KEYS, EXPERT_BIAS, *GPT_OSS_KEYS, *GPT_OSS_MOE_KEYS}
    )

    def known(name: str) -> bool:
        layer, mtp = LAYER.fullmatch(name), MTP.fullmatch(name)
        if mtp:  # an MTP block's own tensors, or its decoder layer's
            key = mtp.group(2)
            return key in MTP_OWN or (key.startswith(MTP_INNER) and key[len(MTP_INNER) :] in known_layer)
        return (layer is not None and layer.group(2) in known_layer) or name in (EMBED, OUTPUT, FINAL_NORM)

    unknown = [name for name in model if not known(name)]
    if unknown:
        kinds = list(
            dict.fromkeys(
                what
                for name in unknown
                for what in [next((what for piece, what in _KNOWN_UNSUPPORTED if piece in name), None)]
                if what
            )
        )
        shown = ", ".join(unknown[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        found = f"{' and '.join(kinds)} ({shown})" if kinds else f"tensors it cannot map ({shown})"
        raise BadInput(
            f"{folder}: a Megatron model with {found}; the megatron layout reads GPT models with RMSNorm, "
            "SwiGLU and RoPE (Llama, Mistral, Qwen2, Qwen3), Qwen3-MoE, Mixtral, DeepSeek-V3 and GLM-4.5 (with "
            "their MTP layers) and gpt-oss only"
        )
    for needed in (EMBED, FINAL_NORM):
        if needed not in model:
            raise BadInput(f"{folder}: no {needed} in the checkpoint; not a whole Megatron GPT model")
    for names in _LAYER_NEEDED:
        present = [key for key in names if key in layers]
        both = [i for i in layers.get(present[0], {}) if all(i in layers[key] for key in present)] if present else []
        if len(present) > 1 and both:
            raise BadInput(
                f"{folder}: holds both decoder.layers.{present[0]} and decoder.layers.{present[1]}, two forms "
                "of one tensor; the checkpoint is not one model"
            )
        if not present:
            raise BadInput(
                f"{folder}: no decoder.layers.{names[0]} in the checkpoint; not a Megatron GPT model "
                "with SwiGLU and RMSNorm"
            )
    gpt_oss = (*GPT_OSS_KEYS, *GPT_OSS_MOE_KEYS)
    for kind in (DENSE_KEYS, MOE_KEYS, SHARED_KEYS, gpt_oss):  # a dense MLP's or an MoE layer's tensors: all or none
        present = [key for key in kind if key in layers]
        if present and len(present) < len(kind):
            missing = next(key for key in kind if key not in layers)
            raise BadInput(
                f"{folder}: holds decoder.layers.{present[0]} but no decoder.layers.{missing}; not a whole "
                "Megatron GPT model"
            )
    if not any(key in layers for key in (FC1, ROUTER)):
        raise BadInput(f"{folder}: no decoder.layers.{FC1} in the checkpoint (nor MoE experts); not a whole GPT model")


# Each layer's tensors (alternatives: the TransformerEngine name, the local spec's; an MoE layer of
# the TransformerEngine spec names its pre-MLP norm pre_mlp_layernorm, a dense one linear_fc1.layer_norm_weight)
_LAYER_NEEDED = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    (QKV[0], *MLA_MARKS),  # attention: grouped q/k/v, or multi-latent (q from a LoRA pair or one projection)
    (PROJ,),
)


def _check_shapes(folder: str, path: str, model: dict, layers: dict, sizes: Sizes) -> None:
    """Every tensor's shape against config.json's sizes; the first that differs is refused in one line."""
    s = sizes
    qkv_rows = (s.heads + 2 * s.groups) * s.head_dim
    expected = {
        QKV[0]: (qkv_rows, s.hidden),
        QKV[1]: (qkv_rows,),
        PROJ: (s.hidden, s.heads * s.head_dim),
        FC1: (2 * s.ffn, s.hidden),
        FC2: (s.hidden, s.ffn),
        **{key: (s.hidden,) for key in NORMS},
        **{key: (s.head_dim,) for key in QK_NORMS},
        ROUTER: (s.experts, s.hidden),
        EXPERT_FC1: (s.experts, 2 * s.expert_ffn, s.hidden),
        EXPERT_FC2: (s.experts, s.hidden, s.expert_ffn),
        EXPERT_BIAS: (s.experts,),
        GPT_OSS_KEYS[0]: (s.hidden,),
        GPT_OSS_KEYS[1]: (s.heads,),
        ROUTER_BIAS: (s.experts,),
        EXPERT_FC1_BIAS: (s.experts, 2 * s.expert_ffn),
        EXPERT_FC2_BIAS: (s.experts, s.hidden),
        SHARED_KEYS[0]: (2 * s.shared_ffn, s.hidden),
        SHARED_KEYS[1]: (s.hidden, s.shared_ffn),
        **(mla_shapes(s) if s.mla else {}),  # MLA's q_layernorm is over the q LoRA rank, not a head
    }
    experts_key, ffn_key = s.expert_keys
    why = {
        QKV[0]: f"({s.heads} heads + 2 x {s.groups} key/value heads) x head dim {s.head_dim}, hidden_size {s.hidden}",
        PROJ: f"hidden_size {s.hidden}, {s.heads} heads x head dim {s.head_dim}",
        FC1: f"2 x intermediate_size {s.ffn}, hidden_size {s.hidden}",
        FC2: f"hidden_size {s.hidden}, intermediate_size {s.ffn}",
        **{key: f"head_dim {s.head_dim}" for key in QK_NORMS},
        ROUTER: f"{experts_key} {s.experts}, hidden_size {s.hidden}",
        EXPERT_FC1: f"{experts_key} {s.experts}, 2 x {ffn_key} {s.expert_ffn}, hidden_size {s.hidden}",
        EXPERT_FC2: f"{experts_key} {s.experts}, hidden_size {s.hidden}, {ffn_key} {s.expert_ffn}",
        GPT_OSS_KEYS[1]: f"num_attention_heads {s.heads}",
        ROUTER_BIAS: f"{experts_key} {s.experts}",
        EXPERT_FC1_BIAS: f"{experts_key} {s.experts}, 2 x {ffn_key} {s.expert_ffn}",
        EXPERT_FC2_BIAS: f"{experts_key} {s.experts}, hidden_size {s.hidden}",
        SHARED_KEYS[0]: f"2 x shared experts' size {s.shared_ffn}, hidden_size {s.hidden}",
        SHARED_KEYS[1]: f"hidden_size {s.hidden}, shared experts' size {s.shared_ffn}",
        **{
            key: f"q_lora_rank {s.q_rank}, kv_lora_rank {s.kv_rank}, {s.heads} heads x (qk_nope_head_dim {s.nope} + "
            f"qk_rope_head_dim {s.rope} or v_head_dim {s.head_dim}), hidden_size {s.hidden}"
            for key in MLA
        },
    }
    why[QKV[1]] = why[QKV[0]]
    every = set(range(s.layers))
    dense = every - s.moe_layers

    def held(key) -> set[int]:
        found = layers.get(key, {})
        return set(range(found[None].shape[0])) if None in found else set(found)

    for key, found in layers.items():
        if key in NORMS:  # the pre-MLP norm may have a dense layer's name in some layers, an MoE layer's in others
            indices, wanted = set().union(*(held(k) for k in NORMS if NORMS[k] == NORMS[key])), every
        else:
            indices, wanted = held(key), (dense if key in DENSE_KEYS else s.moe_layers if key in _MOE_LAYER else every)
        if indices != wanted:
            listed = bool(s.experts) and key in (*DENSE_KEYS, *_MOE_LAYER)
            raise BadInput(
                f"{folder}: decoder.layers.{key} holds {_layers_named(indices, listed)}; {path} gives "
                f"{_layers_named(wanted, listed)} ({_which_layers(key, s)}): the config is not this checkpoint's model"
            )
        for index, tensor in found.items():
            shape = tensor.shape[1:] if index is None else tensor.shape
            if shape != expected[key]:
                raise BadInput(
                    f"{folder}: {tensor.name} has layer shape {list(shape)}; {path} gives {list(expected[key])} "
                    f"({why.get(key, f'hidden_size {s.hidden}')}): the config is not this checkpoint's model"
                )
    for name in (EMBED, OUTPUT):
        if name in model and (model[name].shape[1:] != (s.hidden,) or model[name].shape[0] < s.vocab):
            raise BadInput(
                f"{folder}: {name} is {list(model[name].shape)}; {path} gives vocab_size {s.vocab} and hidden_size "
                f"{s.hidden}: the config is not this checkpoint's model"
            )
    _check_mtp(folder, path, model, s, expected, why)
    if model[FINAL_NORM].shape != (s.hidden,):
        raise BadInput(
            f"{folder}: {FINAL_NORM} is {list(model[FINAL_NORM].shape)}; {path} gives hidden_size {s.hidden}"
        )
    if s.tied == (OUTPUT in model):
        holds = (
            "holds output_layer.weight (untied)"
            if OUTPUT in model
            else "holds no output_layer.weight (tied embeddings)"
        )
        raise BadInput(
            f"{folder}: the checkpoint {holds}, but {path} has "
            + (f"tie_word_embeddings {str(s.tied).lower()}" if s.tie_stated else "no tie_word_embeddings (untied)")
            + f": the config is not this checkpoint's model; pass {option('config', meta='DIR')} with its own"
        )


def _check_mtp(folder: str, path: str, model: dict, s: Sizes, expected: dict, why: dict) -> None:
    """DeepSeek-V3's and GLM-4.5's multi-token prediction blocks against num_nextn_predict_layers: as many, each
    whole (its norms, eh_proj, and a decoder layer with experts as the model's own), each tensor of the config's
    shape."""
    blocks = mtp_tensors(model)
    if sorted(blocks) != list(range(s.mtp)):
        found = f"MTP layers {sorted(blocks)}" if blocks else "no MTP layers"
        raise BadInput(
            f"{folder}: the checkpoint holds {found}; {path} gives num_nextn_predict_layers {s.mtp} "
            f"(deepseek_v3 and glm4_moe configs): the config is not this checkpoint's model; pass "
            f"{option('config', meta='DIR')} with its own"
        )
    inner_needed = (
        [PROJ, *MOE_KEYS] + ([EXPERT_BIAS] if s.expert_bias else []) + (list(SHARED_KEYS) if s.shared_ffn else [])
    )
    own_shapes = {key: ((s.hidden, 2 * s.hidden) if key == "eh_proj.weight" else (s.hidden,)) for key in MTP_OWN}
    for k, block in blocks.items():
        inner = {key[len(MTP_INNER) :]: t for key, t in block.items() if key.startswith(MTP_INNER)}
        missing = [f"mtp.layers.{k}.{key}" for key in MTP_OWN if key not in block]
        missing += [f"mtp.layers.{k}.{MTP_INNER}{key}" for key in inner_needed if key not in inner]
        if missing:
            raise BadInput(f"{folder}: no {missing[0]} in the checkpoint; not a whole MTP layer")
        shapes = [(t, own_shapes[key], f"hidden_size {s.hidden}") for key, t in block.items() if key in MTP_OWN]
        shapes += [(t, expected[key], why.get(key, f"hidden_size {s.hidden}")) for key, t in inner.items()]
        for tensor, wanted, reason in shapes:
            if tensor.shape != wanted:
                raise BadInput(
                    f"{folder}: {tensor.name} has shape {list(tensor.shape)}; {path} gives {list(wanted)} "
                    f"({reason}): the config is not this checkpoint's model"
                )


def _layers_named(indices: set[int], listed: bool) -> str:
    """`listed`: the layers by number (which layers have experts), else how many from 0 (the layer count)."""
    if not indices:
        return "no layers"
    if not listed and indices == set(range(len(indices))):
        return f"{len(indices)} layer{'s' if len(indices) > 1 else ''}"
    return f"layers {sorted(indices)}"


def _which_layers(key: str, s: Sizes) -> str:
    which = "first_k_dense_replace" if s.leading_dense else "mlp_only_layers, decoder_sparse_step"
    if key in _MOE_LAYER:
        return f"the layers with experts: {which}" if s.experts else "no MoE"
    if key in DENSE_KEYS and s.experts:
        return f"the layers without experts: {which}"
    return f"num_hidden_layers {s.layers}"


def _tensor(tensor: dcp.ChunkedTensor) -> TensorPlan:
    """A tensor of the checkpoint under its own name and global shape, its chunks placed."""
    extents = [
        e for c in tensor.chunks for e in box_extents(c.source, c.element_offset, tensor.shape, c.offsets, c.sizes)
    ]
    return TensorPlan(tensor.name, tensor.shape, tensor.dtype, tensor.dtype, extents)


READER = Reader(NAME, DESCRIPTION, sniff=matches, read=read, reads_config=True)
