"""A Hugging Face config.json built from the training args a Megatron run saved in common.pt.

Used when no config.json is given or found. Only what the args record is written, each under
Megatron-LM's argparse name: num_layers, hidden_size, ffn_hidden_size, num_attention_heads,
num_query_groups (with group_query_attention), kv_channels (Megatron's default: hidden / heads),
norm_epsilon, rotary_base, max_position_embeddings. What the tensors show is taken from them:
vocab_size is the embedding's rows, padding included (Megatron pads the vocabulary; the tokenizer's
own size is not in the args), tied embeddings are the absence of output_layer.weight, the dtype is
the weights'. The family: q/k layernorms (qk_layernorm) are Qwen3's; QKV bias without other biases is Qwen2; otherwise Llama, since Llama and
Mistral without a sliding window are one computation with the same names and the args cannot tell
them apart. A size the family needs that the args do not record, or a feature its config cannot
express, is refused: --config then names the model. The args have been checked against the tensors
before (readers.megatron_checks), as they are when a config.json is given.
"""

from __future__ import annotations

from ..errors import BadInput, option
from .megatron_args import COMMON, TrainingArgs

# Megatron-LM arg -> config.json key; the args must record these (no default of ours stands in)
_NEEDED = (
    ("num_layers", "num_hidden_layers"),
    ("hidden_size", "hidden_size"),
    ("ffn_hidden_size", "intermediate_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("norm_epsilon", "rms_norm_eps"),
    ("rotary_base", "rope_theta"),
)
# Features a built config would have to name but the args do not describe fully: --config says
_NEEDS_CONFIG = (
    ("use_rope_scaling", lambda v: v is True, "RoPE scaling"),
    ("rotary_seq_len_interpolation_factor", lambda v: v is not None, "RoPE sequence interpolation"),
    ("window_size", lambda v: v is not None, "sliding-window attention"),
    ("rotary_percent", lambda v: v is not None and v != 1.0, "RoPE on part of each head, GLM-4.5's"),
)


def build(
    folder: str,
    args: TrainingArgs,
    *,
    rows: int,
    tied: bool,
    qkv_bias: bool,
    qk_norm: bool,
    experts: int,
    mla: bool,
    dtype: str,
) -> tuple[dict, str]:
    """(config.json's values, a note saying where they came from)."""
    r = args.recorded
    how = f"pass {option('config', meta='DIR')} (a folder with the model's config.json)"
    if mla:
        raise BadInput(
            f"{folder}: no config.json, and the checkpoint has multi-latent attention (DeepSeek-V3), whose "
            f"config.json is not built from the training args in {COMMON}; {how}"
        )
    if experts:  # the routing (top-k, normalisation, which layers) is more than these args are checked for
        raise BadInput(
            f"{folder}: no config.json, and the checkpoint holds MoE layers ({experts} experts), whose config.json "
            f"is not built from the training args in {COMMON}; {how}"
        )
    if qk_norm and qkv_bias:
        raise BadInput(
            f"{folder}: no config.json, and the checkpoint has both a QKV bias and q/k layernorms, which no "
            f"Hugging Face family the megatron layout writes has; {how}"
        )
    missing = [f"{arg} ({key})" for arg, key in _NEEDED if not _number(r.get(arg))]
    if args.groups is None and args.heads:  # group_query_attention without num_query_groups
        missing.append("num_query_groups (num_key_value_heads)")
    if r.get("swiglu") is not True:
        missing.append("swiglu True (hidden_act silu)")
    if missing:
        raise BadInput(
            f"{folder}: no config.json, and the training args in {COMMON} do not record {', '.join(missing)}, "
            f"which the model's config.json needs; {how}"
        )
    for arg, is_on, what in _NEEDS_CONFIG:
        if is_on(r.get(arg)):
            raise BadInput(
                f"{folder}: no config.json, and the training args in {COMMON} have {arg} {r[arg]!r} ({what}), "
                f"which a config built from them would not describe exactly; {how}"
            )
    family = "qwen3" if qk_norm else "qwen2" if qkv_bias else "llama"
    architecture = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(family, "LlamaForCausalLM")
    values = {
        "architectures": [architecture],
        "model_type": family,
        "hidden_size": args.hidden,
        "intermediate_size": args.ffn,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.groups,
        "head_dim": args.head_dim,
        "vocab_size": rows,
        "hidden_act": "silu",
        "rms_norm_eps": r["norm_epsilon"],
        "rope_theta": float(r["rotary_base"]),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(r["rotary_base"])},
        "tie_word_embeddings": tied,
        "dtype": dtype,
    }
    if _number(r.get("max_position_embeddings")):
        values["max_position_embeddings"] = r["max_position_embeddings"]
    if family == "llama":  # Llama's attention_bias would put a bias on o_proj too: Megatron's QKV bias is Qwen2's
        values.update(attention_bias=False, mlp_bias=False)
    elif family == "qwen3":  # no bias (Qwen3's would be on o_proj too), no sliding window; head_dim given above
        values.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
    else:  # Qwen2's q/k/v carry a bias by design; no sliding window (refused above when the args have one)
        values.update(use_sliding_window=False, sliding_window=None)
    unrecorded = (
        "" if "max_position_embeddings" in values else "; max_position_embeddings not recorded: transformers' default"
    )
    chosen = (
        "Qwen3ForCausalLM (q/k layernorms)"
        if qk_norm
        else "Qwen2ForCausalLM (QKV bias)"
        if qkv_bias
        else "LlamaForCausalLM (the args cannot tell Llama from Mistral: without a sliding window they are one model)"
    )
    note = (
        f"config.json built from the training args in {COMMON} as {chosen}; vocab_size {rows}: every embedding row, "
        f"Megatron's vocabulary padding included{unrecorded}; no tokenizer files: pass {option('config', meta='DIR')} "
        "for them (and to name another model class or trim the padding)"
    )
    return values, note


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
