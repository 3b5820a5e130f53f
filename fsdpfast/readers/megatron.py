"""Megatron-Core torch_dist checkpoints of GPT models, written as Hugging Face Llama / Mistral / Qwen2 models.

The folder is a DCP folder (read by readers.dcp) whose tensors carry Megatron's names and global
shapes: TP, PP and virtual pipeline stages only decide which chunks exist, so all are handled by
the chunk boxes. Layer tensors are stacked: `decoder.layers.self_attention.linear_qkv.weight` is
(L, (n + 2g)·d, h), layer i at index i whatever the pipeline stage that saved it (per-layer
`decoder.layers.{i}.` names, as a heterogeneous checkpoint has them, are read too). The plan holds
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
    EMBED,
    FC1,
    FC2,
    FINAL_NORM,
    LAYER,
    NORMS,
    OUTPUT,
    PROJ,
    QKV,
    MegatronToHuggingFace,
    Sizes,
    layer_tensors,
)
from .reader import Reader

NAME = "megatron"
DESCRIPTION = "metadata.json (torch_dist) + .metadata + .distcp: Megatron-Core dist_checkpointing (iter_N/ folders)"
_MODEL_TYPES = ("llama", "mistral", "qwen2")  # whose Hugging Face names and layout this mapping writes
_NOT_MODEL = ("optimizer.", "rng_state", "rerun_state_machine")  # a training checkpoint's other parts
# What unknown names reveal, for the refusal: (a piece of the name, what it means)
_KNOWN_UNSUPPORTED = (
    (".experts.", "MoE layers"),
    ("mlp.router", "MoE layers"),
    ("shared_experts", "MoE layers"),
    ("linear_q_down_proj", "multi-latent attention (MLA)"),
    ("linear_kv_down_proj", "multi-latent attention (MLA)"),
    ("q_layernorm", "QK layernorm"),
    ("k_layernorm", "QK layernorm"),
    ("position_embeddings", "learned position embeddings (not RoPE)"),
    ("layer_norm_bias", "LayerNorm (not RMSNorm)"),
    ("mtp", "multi-token prediction layers"),
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
        megatron_checks.refuse_what_hf_does_not_compute(folder, args)
        megatron_checks.check_against_tensors(folder, args, found)
    config, config_note = _config_dir(folder, config, args is not None, args_note)
    built, positions_note = None, None
    if config is None:  # no config.json anywhere: the run's own args say what the model is
        built, config_note = megatron_config.build(
            folder, args, rows=found.rows, tied=found.tied, qkv_bias=found.qkv_bias, dtype=model[EMBED].dtype
        )
        source = f"config.json built from {COMMON}"
        sizes = _sizes(built, source)
        _check_shapes(folder, source, model, layers, sizes)
    else:
        source = os.path.join(config, "config.json")
        values = load_config(source)
        sizes = _sizes(values, source)
        _check_shapes(folder, source, model, layers, sizes)
        _check_family(folder, source, values, found.qkv_bias)
        if args is not None:  # what the shapes cannot tell: which heads, epsilon, RoPE, activation, padding
            positions_note = megatron_checks.check_against_config(folder, source, values, sizes, args, found)
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
    plan = plan.noted(
        f"Megatron GPT: {sizes.layers} layers, {sizes.heads} heads in {sizes.groups} query groups of "
        f"head dim {sizes.head_dim}, from {source}",
        config_note,
        args_note,
        f"config.json's sizes agree with the training args in {COMMON}" if args is not None and built is None else None,
        positions_note,
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
    head_dim = number("head_dim") if values.get("head_dim") is not None else hidden // heads
    tied = values.get("tie_word_embeddings")
    return Sizes(
        hidden,
        heads,
        groups,
        head_dim,
        number("intermediate_size"),
        number("num_hidden_layers"),
        number("vocab_size"),
        tied is True,  # absent (or not a bool): untied, the default of Llama, Mistral and Qwen2
        isinstance(tied, bool),
    )


def _tensor_sizes(model: dict, layers: dict) -> megatron_checks.TensorSizes:
    """What the tensors show, for the checks of the args (a missing dimension reads 0)."""

    def layer_shape(key):
        found = layers[key]
        return found[None].shape[1:] if None in found else next(iter(found.values())).shape

    def dim(shape, i):
        return shape[i] if len(shape) > i else 0

    qkv = layers[QKV[0]]
    embedding = model[EMBED].shape
    return megatron_checks.TensorSizes(
        rows=dim(embedding, 0),
        hidden=dim(embedding, 1),
        layers=dim(qkv[None].shape, 0) if None in qkv else len(qkv),
        qkv_rows=dim(layer_shape(QKV[0]), 0),
        attention=dim(layer_shape(PROJ), 1),
        fc1_rows=dim(layer_shape(FC1), 0),
        ffn=dim(layer_shape(FC2), 1),
        tied=OUTPUT not in model,
        qkv_bias=QKV[1] in layers,
    )


def _check_family(folder: str, path: str, values: dict, qkv_bias: bool) -> None:
    """A QKV bias is Qwen2's (q, k and v carry one, o does not); Llama's attention_bias puts one on o_proj
    too, and Mistral has none: the other pairings load with biases dropped or missing."""
    model_type = values["model_type"]
    wants = model_type == "qwen2" or (model_type == "llama" and values.get("attention_bias") is True)
    if (model_type == "qwen2") if qkv_bias else not wants:
        return
    found = "holds linear_qkv.bias (a bias on q, k and v only)" if qkv_bias else "holds no linear_qkv.bias"
    given = (
        f"model_type {model_type!r}"
        + (f" with attention_bias {values.get('attention_bias')!r}" if model_type == "llama" else "")
        + (", whose q, k and v carry a bias" if wants else "")
    )
    fits = "a qwen2 config" if qkv_bias else "a llama or mistral config without attention_bias"
    raise BadInput(
        f"{folder}: the checkpoint {found}, but {path} has {given}: the config is not this checkpoint's model; "
        f"pass {option('config', meta='DIR')} with {fits}"
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
    known_layer = set(NORMS) | set(QKV) | {PROJ, FC1, FC2}
    unknown = [
        name
        for name in model
        if not (LAYER.fullmatch(name) and LAYER.fullmatch(name).group(2) in known_layer)
        and name not in (EMBED, OUTPUT, FINAL_NORM)
    ]
    if unknown:
        kinds = list(dict.fromkeys(what for name in unknown for piece, what in _KNOWN_UNSUPPORTED if piece in name))
        shown = ", ".join(unknown[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        found = f"{' and '.join(kinds)} ({shown})" if kinds else f"tensors it cannot map ({shown})"
        raise BadInput(
            f"{folder}: a Megatron model with {found}; the megatron layout reads GPT models with RMSNorm, "
            "SwiGLU and RoPE (Llama, Mistral, Qwen2) only"
        )
    for needed in (EMBED, FINAL_NORM):
        if needed not in model:
            raise BadInput(f"{folder}: no {needed} in the checkpoint; not a whole Megatron GPT model")
    for names in _LAYER_NEEDED:
        present = [key for key in names if key in layers]
        if len(present) > 1:
            raise BadInput(
                f"{folder}: holds both decoder.layers.{present[0]} and decoder.layers.{present[1]}, two names "
                "for one norm; the checkpoint is not one model"
            )
        if not present:
            raise BadInput(
                f"{folder}: no decoder.layers.{names[0]} in the checkpoint; not a Megatron GPT model "
                "with SwiGLU and RMSNorm"
            )


# Each layer's tensors (alternatives: the TransformerEngine name, the local spec's)
_LAYER_NEEDED = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    (QKV[0],),
    (PROJ,),
    (FC1,),
    (FC2,),
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
    }
    why = {
        QKV[0]: f"({s.heads} heads + 2 x {s.groups} key/value heads) x head dim {s.head_dim}, hidden_size {s.hidden}",
        PROJ: f"hidden_size {s.hidden}, {s.heads} heads x head dim {s.head_dim}",
        FC1: f"2 x intermediate_size {s.ffn}, hidden_size {s.hidden}",
        FC2: f"hidden_size {s.hidden}, intermediate_size {s.ffn}",
    }
    why[QKV[1]] = why[QKV[0]]
    for key, found in layers.items():
        indices = sorted(found) if None not in found else list(range(found[None].shape[0]))
        if indices != list(range(s.layers)):
            have = len(indices) if None not in found else found[None].shape[0]
            raise BadInput(
                f"{folder}: decoder.layers.{key} holds {have} layers; {path} has num_hidden_layers {s.layers}"
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


def _tensor(tensor: dcp.ChunkedTensor) -> TensorPlan:
    """A tensor of the checkpoint under its own name and global shape, its chunks placed."""
    extents = [
        e for c in tensor.chunks for e in box_extents(c.source, c.element_offset, tensor.shape, c.offsets, c.sizes)
    ]
    return TensorPlan(tensor.name, tensor.shape, tensor.dtype, tensor.dtype, extents)


READER = Reader(NAME, DESCRIPTION, sniff=matches, read=read, reads_config=True)
