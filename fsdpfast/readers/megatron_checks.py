"""The training args in a Megatron checkpoint's common.pt, checked against its tensors and against config.json.

Every check of the args is here, so a merge with a config.json (--config, or huggingface/ found beside
the folder) and one whose config.json is built from the args see the same ones, in this order:
1. what the args say no Hugging Face Llama / Mistral / Qwen2 computes (rotary_interleaved, ...), or with
   gpt-oss's tensors (sinks, biases) no gpt_oss;
2. the args against the tensors (layers, hidden size, heads x head dim, ffn size, padded vocabulary,
   tied embeddings, biases, experts): a contradiction means common.pt is not these tensors' run;
3. the args against config.json, for what the tensors cannot tell (4 heads of 16 or 8 heads of 8,
   norm epsilon, RoPE base and scaling, activation, sliding window, gpt-oss's clamp, how much of the
   vocabulary is padding).
config.json against the tensors is readers.megatron's shape check; it runs between 2 and 3, so the
args against config.json only ever meet a config whose shapes fit. Each refusal is one line naming
both values and which side to fix. An arg that is not recorded is not checked.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BadInput, option
from .megatron_args import COMMON, TrainingArgs

# Features a Hugging Face Llama / Mistral / Qwen2 does not compute, whatever its config says (RoPE on part of
# each head, rotary_percent, is GLM-4.5's: checked against config.json, _rotary_contradiction)
NOT_HF = (
    ("rotary_interleaved", lambda v: v is True, "interleaved rotary embeddings"),
    ("apply_layernorm_1p", lambda v: v is True, "zero-centred norm weights (apply_layernorm_1p)"),
    ("normalization", lambda v: v is not None and v != "RMSNorm", "a norm other than RMSNorm"),
    ("position_embedding_type", lambda v: v is not None and v != "rope", "position embeddings other than RoPE"),
    ("swiglu", lambda v: v is False, "an MLP other than SwiGLU"),
)
# gpt-oss's MLP (told by its tensors: attention sinks and biases) is not SwiGLU but Megatron-LM's quick_geglu,
# with 1 added to the linear half (glu_linear_offset) and both halves clamped (activation_func_clamp_value)
GPT_OSS_NOT_HF = (
    ("quick_geglu", lambda v: v is False, "an MLP other than gpt-oss's quick GeGLU"),
    ("glu_linear_offset", lambda v: v is not None and v != 1.0, "a GLU offset other than gpt-oss's 1"),
)
_SILU = ("silu", "swish")  # transformers' two names for the activation Megatron's swiglu gates with
# Megatron-LM's own RoPE scalings and the rope_type each is in config.json: llama3 (use_rope_scaling,
# factor rope_scaling_factor) and linear (rotary_seq_len_interpolation_factor)
_LLAMA3, _LINEAR = "llama3", "linear"


@dataclass(frozen=True)
class TensorSizes:
    """What the checkpoint's tensors show, whatever the args or config.json say."""

    rows: int  # embedding rows, Megatron's vocabulary padding included
    hidden: int  # embedding columns
    layers: int
    qkv_rows: int  # (heads + 2 x query groups) x head dim
    attention: int  # linear_proj columns: heads x head dim
    fc1_rows: int  # gate and up: 2 x ffn
    ffn: int  # linear_fc2 columns
    tied: bool  # no output_layer.weight
    qkv_bias: bool
    qk_norm: bool = False  # self_attention.q_layernorm / k_layernorm (Qwen3)
    experts: int = 0  # the router's rows; 0: no MoE layer
    mla: bool = False  # multi-latent attention (no linear_qkv: qkv_rows is 0)
    shared: bool = False  # shared experts
    expert_bias: bool = False  # the router's expert_bias
    gpt_oss: bool = False  # gpt-oss's tensors: attention sinks (core_attention.softmax_offset) and biases


def refuse_what_hf_does_not_compute(folder: str, args: TrainingArgs, gpt_oss: bool = False) -> None:
    """Args that say the run computed something no Llama / Mistral / Qwen2 does (with gpt-oss's tensors:
    that gpt-oss does not): one line."""
    checks = [c for c in NOT_HF if c[0] != "swiglu"] + list(GPT_OSS_NOT_HF) if gpt_oss else NOT_HF
    family = "gpt_oss" if gpt_oss else "Llama / Mistral / Qwen2"
    for arg, is_on, what in checks:
        if arg in args.recorded and is_on(args.recorded[arg]):
            raise BadInput(
                f"{folder}: the training args in {COMMON} have {arg} {args.recorded[arg]!r}: the model uses {what}, "
                f"which Hugging Face {family} does not compute; the megatron layout cannot write it"
            )


def check_against_tensors(folder: str, args: TrainingArgs, found: TensorSizes) -> None:
    """The args against what the tensors show: the first contradiction, in one line."""
    r = args.recorded
    qkv = "decoder.layers.self_attention.linear_qkv"
    attention = None
    if args.heads and args.groups and args.head_dim and found.qkv_rows:  # MLA has no linear_qkv
        n, g, d = args.heads, args.groups, args.head_dim
        names = f"num_attention_heads {n}, num_query_groups {g}, kv_channels {d}"
        if (n + 2 * g) * d != found.qkv_rows:
            attention = f"{names}", f"{qkv}.weight has {found.qkv_rows} rows per layer, not ({n} + 2 x {g}) x {d}"
        elif n * d != found.attention:
            attention = (
                f"{names}",
                f"decoder.layers.self_attention.linear_proj.weight has {found.attention} columns, not {n} x {d}",
            )
    ffn = args.ffn
    contradictions = (
        (args.layers is not None and args.layers != found.layers)
        and (f"num_layers {args.layers}", f"decoder.layers.* hold {found.layers} layers"),
        (args.hidden is not None and args.hidden != found.hidden)
        and (f"hidden_size {args.hidden}", f"embedding.word_embeddings.weight has {found.hidden} columns"),
        attention,
        (ffn is not None and found.fc1_rows and (2 * ffn != found.fc1_rows or ffn != found.ffn))
        and (
            f"ffn_hidden_size {ffn}",
            f"decoder.layers.mlp.linear_fc1.weight has {found.fc1_rows} rows and linear_fc2.weight {found.ffn} "
            f"columns, not 2 x {ffn} and {ffn}",
        ),
        (_whole(r.get("padded_vocab_size")) and r["padded_vocab_size"] != found.rows)
        and (f"padded_vocab_size {r['padded_vocab_size']}", f"embedding.word_embeddings.weight has {found.rows} rows"),
        (args.tied is not None and args.tied != found.tied)
        and (
            f"untie_embeddings_and_output_weights {not args.tied}",
            "the checkpoint holds output_layer.weight (untied)"
            if not found.tied
            else "the checkpoint holds no output_layer.weight (tied embeddings)",
        ),
        _biases(r, found),
        (isinstance(r.get("qk_layernorm"), bool) and r["qk_layernorm"] != found.qk_norm)
        and (
            f"qk_layernorm {r['qk_layernorm']}",
            f"{'a' if found.qk_norm else 'no'} self_attention.q_layernorm.weight is in the checkpoint",
        ),
        (_whole(r.get("num_experts")) and r["num_experts"] != found.experts)
        and (
            f"num_experts {r['num_experts']}",
            f"decoder.layers.mlp.router.weight has {found.experts} rows"
            if found.experts
            else "the checkpoint holds no expert tensors (a dense model)",
        ),
        (found.experts and "num_experts" in r and not _whole(r.get("num_experts")))
        and (f"num_experts {r['num_experts']!r}", f"the checkpoint holds MoE layers of {found.experts} experts"),
    )
    for contradiction in contradictions:
        if contradiction:
            recorded, shown = contradiction
            raise BadInput(
                f"{folder}: the training args in {COMMON} have {recorded}, but {shown}: {COMMON} is not these "
                f"tensors' run; merge the checkpoint the args belong to, or correct {COMMON}"
            )


def _biases(r: dict, found: TensorSizes):
    """Megatron puts a bias on linear_qkv with add_qkv_bias, and on every linear layer with add_bias_linear
    (gpt-oss's; readers.megatron refuses those biases in any other family's tensors)."""
    every = r.get("add_bias_linear")
    if every is True and not found.gpt_oss:
        return "add_bias_linear True", "the checkpoint has no bias on linear_proj, linear_fc1 or linear_fc2"
    if every is False and found.gpt_oss:
        return "add_bias_linear False", "the checkpoint has gpt-oss's biases on linear_proj, linear_fc1 and linear_fc2"
    present = found.qkv_bias
    if isinstance(r.get("add_qkv_bias"), bool) and (r["add_qkv_bias"] or every is True) != present:
        return f"add_qkv_bias {r['add_qkv_bias']}", f"{'a' if present else 'no'} linear_qkv.bias is in the checkpoint"
    return None


def check_against_config(
    folder: str, path: str, values: dict, sizes, args: TrainingArgs, found: TensorSizes
) -> str | None:
    """The args against config.json (whose shapes fit the tensors): the first contradiction in one line.

    `sizes`: config.json's sizes as readers.megatron reads them. Returns a note for a difference that
    changes no weight and nothing computed up to the trained length (max_position_embeddings), or a window
    one key narrower than the run's, as megatron-bridge maps it (_window_note)."""
    r = args.recorded
    rope = _rope_scaling(values)
    theta = values.get("rope_parameters") if isinstance(values.get("rope_parameters"), dict) else {}
    act = values.get("hidden_act", "silu")  # Llama's, Mistral's and Qwen2's default
    contradictions = (
        _differ("num_layers", args.layers, "num_hidden_layers", sizes.layers),
        _differ("hidden_size", args.hidden, "hidden_size", sizes.hidden),
        _differ("num_attention_heads", args.heads, "num_attention_heads", sizes.heads),
        _differ("num_query_groups", args.groups, "num_key_value_heads", sizes.groups),
        _differ("kv_channels", args.head_dim, "head_dim", sizes.head_dim),
        # with experts in every layer no tensor has ffn_hidden_size's shape (Mixtral's intermediate_size is the experts')
        None
        if len(sizes.moe_layers) == sizes.layers
        else _differ("ffn_hidden_size", args.ffn, "intermediate_size", sizes.ffn),
        sizes.experts
        and _differ(
            "moe_ffn_hidden_size", _number(r.get("moe_ffn_hidden_size")), "the experts' ffn size", sizes.expert_ffn
        ),
        _differ("norm_epsilon", _number(r.get("norm_epsilon")), "rms_norm_eps", _number(values.get("rms_norm_eps"))),
        _differ(
            "rotary_base",
            _number(r.get("rotary_base")),
            "rope_theta",
            _number(theta.get("rope_theta", values.get("rope_theta"))),
        ),
        (r.get("swiglu") is True and act not in _SILU) and ("swiglu True (SiLU)", f"hidden_act {act!r}"),
        *_rope_contradictions(r, rope),
        _rotary_contradiction(r, values, rope),
        _window_contradiction(r, values),
        *(_gpt_oss_contradictions(r, values) if found.gpt_oss else ()),
        _vocab_contradiction(r, sizes.vocab, found.rows),
    )
    for contradiction in contradictions:
        if contradiction:
            recorded, given = contradiction
            raise BadInput(
                f"{folder}: the training args in {COMMON} have {recorded}; {path} gives {given}: the config is not "
                f"this checkpoint's model; pass {option('config', meta='DIR')} with the model's own config.json"
            )
    notes = [_positions_note(r, values), _window_note(r, values)]
    return "; ".join(note for note in notes if note) or None


def _positions_note(r: dict, values: dict) -> str | None:
    trained, served = _whole(r.get("max_position_embeddings")), _whole(values.get("max_position_embeddings"))
    if trained and served and trained != served:
        return (
            f"config.json's max_position_embeddings {served} kept; the run trained with {trained} ({COMMON}), "
            "which changes no weight"
        )
    return None


def _differ(arg: str, recorded, key: str, given):
    """A contradiction where both say and disagree (10000 and 10000.0 agree)."""
    if recorded is not None and given is not None and recorded != given:
        return f"{arg} {recorded}", f"{key} {given}"
    return None


def _rope_scaling(values: dict) -> dict:
    """config.json's RoPE scaling as transformers reads it: rope_scaling (the older key) wins over rope_parameters."""
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(values.get(key), dict):
            return values[key]
    return {}


def _rope_contradictions(r: dict, rope: dict):
    """Megatron-LM's two RoPE scalings against config.json's: each changes the rotation at every
    position, so a config with the other (or none) computes another model. Scalings Megatron-LM
    does not train with (yarn, dynamic, ...) are a serving choice and pass."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    factor = _number(rope.get("factor"))
    llama3 = r.get("use_rope_scaling")
    if llama3 is True:
        wanted = _number(r.get("rope_scaling_factor"))
        yield (kind != _LLAMA3) and ("use_rope_scaling True", f"rope_type {kind!r}, not {_LLAMA3!r}")
        yield (kind == _LLAMA3) and _differ("rope_scaling_factor", wanted, "factor", factor)
    elif llama3 is False:
        yield (kind == _LLAMA3) and ("use_rope_scaling False", f"rope_type {_LLAMA3!r}")
    linear = _number(r.get("rotary_seq_len_interpolation_factor"))
    if linear:
        yield (kind != _LINEAR) and (
            f"rotary_seq_len_interpolation_factor {linear}",
            f"rope_type {kind!r}, not {_LINEAR!r}",
        )
        yield (kind == _LINEAR) and _differ("rotary_seq_len_interpolation_factor", linear, "factor", factor)
    elif "rotary_seq_len_interpolation_factor" in r and kind == _LINEAR:
        yield "rotary_seq_len_interpolation_factor None", f"rope_type {_LINEAR!r}"


def _rotary_contradiction(r: dict, values: dict, rope: dict):
    """Megatron's rotary_percent, the part of each head RoPE turns, against GLM-4.5's partial_rotary_factor
    (transformers reads the RoPE dict's before config.json's top-level one, and takes 0.5 when neither says); the
    other families the megatron layout writes turn the whole head."""
    percent = _number(r.get("rotary_percent"))
    if percent is None:
        return None
    if values.get("model_type") == "glm4_moe":
        factor = rope.get("partial_rotary_factor", values.get("partial_rotary_factor", 0.5))
        return _differ("rotary_percent", percent, "partial_rotary_factor", _number(factor))
    if percent != 1.0:
        return (
            f"rotary_percent {percent} (RoPE on part of each head)",
            f"model_type {values.get('model_type')!r}, which turns the whole of each head (glm4_moe turns part)",
        )
    return None


def _window_contradiction(r: dict, values: dict):
    """A run with sliding-window attention needs a config with the same window on the same layers (full
    attention, or another window, computes other outputs past it); a window in the config that the run did
    not train with only limits what the model sees of longer inputs, a serving choice, and passes.

    Megatron's window_size (left, right) lets query i attend to keys i - left ... i + right (left + 1 of them
    in a causal model, as flash-attn counts); transformers' sliding_window counts the query itself
    (keys j > i - sliding_window): window_size (W, 0) is sliding_window W + 1."""
    window = r.get("window_size")
    has = values.get("sliding_window") is not None and values.get("use_sliding_window", True) is not False
    if window is None:
        return None
    if not has:
        return f"window_size {window!r} (sliding-window attention)", "no sliding window (full attention)"
    if not (isinstance(window, (tuple, list)) and len(window) == 2 and all(_whole(w) or w == 0 for w in window)):
        return f"window_size {window!r}", "a sliding window (the args' window is not (left, 0))"
    left, right = window
    if right:
        return f"window_size {window!r} (each token attends to {right} after it)", "a causal sliding window"
    if values["sliding_window"] not in (left + 1, left):  # left: megatron-bridge's mapping, noted (_window_note)
        return (
            f"window_size {window!r} (each token attends to itself and the {left} before it)",
            f"sliding_window {values['sliding_window']!r} (transformers counts the token itself: the run's window "
            f"is sliding_window {left + 1})",
        )
    return _window_layers_contradiction(r, values)


def _window_note(r: dict, values: dict) -> str | None:
    """megatron-bridge maps the Hub's sliding_window W to window_size (W, 0) and back, one key wider than the
    Hub's window in Megatron's attention: a run converted that way (gpt-oss's 128) is merged with its config's W,
    as bridge exports it, and the one-key difference said."""
    window = r.get("window_size")
    if isinstance(window, (tuple, list)) and len(window) == 2 and values.get("sliding_window") == window[0]:
        return (
            f"config.json's sliding_window {window[0]} kept: the run's window_size {tuple(window)!r} attended to "
            f"{window[0] + 1} keys (megatron-bridge maps sliding_window {window[0]} to it); sliding_window "
            f"{window[0] + 1} would compute what the run computed"
        )
    return None


def _window_layers_contradiction(r: dict, values: dict):
    """Which layers have the window: Megatron's window_attn_skip_freq (none: every layer; N: all but every
    N-th, counted from 1; a list: 1 for a windowed layer) against config.json's layer_types, where it has them."""
    layer_types = values.get("layer_types")
    if not isinstance(layer_types, list):
        return None
    skip = r.get("window_attn_skip_freq")
    layers = range(len(layer_types))
    if skip is None:
        trained = [True for _ in layers]
    elif _whole(skip):
        trained = [(i + 1) % skip != 0 for i in layers]
    elif isinstance(skip, (list, tuple)) and len(skip) == len(layer_types):
        trained = [bool(s) for s in skip]
    else:
        return f"window_attn_skip_freq {skip!r}", f"layer_types of {len(layer_types)} layers"
    given = [t == "sliding_attention" for t in layer_types]
    if trained == given:
        return None
    windowed = [i for i, on in enumerate(trained) if on]
    return (
        f"window_size {r['window_size']!r} and window_attn_skip_freq {skip!r} (the window on layers {windowed})",
        f"layer_types with sliding_attention on layers {[i for i, on in enumerate(given) if on]}",
    )


def _gpt_oss_contradictions(r: dict, values: dict):
    """gpt-oss's clamp: Megatron-LM's activation_func_clamp_value is transformers' swiglu_limit (gate halves
    clamped above, linear halves on both sides, in both)."""
    if "activation_func_clamp_value" in r:
        clamp, limit = (
            _number(r["activation_func_clamp_value"]),
            _number(values.get("swiglu_limit", 7.0)),
        )  # GptOssConfig's default
        if clamp != limit:
            yield f"activation_func_clamp_value {r['activation_func_clamp_value']!r}", f"swiglu_limit {limit!r}"


def _vocab_contradiction(r: dict, vocab: int, rows: int):
    """config.json's vocab_size is every embedding row (the padded size, as Qwen2's configs give it), or a
    size Megatron-LM pads to those rows: by fewer than make_vocab_size_divisible_by x TP rows, where the
    args record both. (Above the rows, the shape check has refused it.)"""
    divisor, tp = _whole(r.get("make_vocab_size_divisible_by")), _whole(r.get("tensor_model_parallel_size"))
    if not divisor or not tp or rows - vocab < divisor * tp:
        return None
    return (
        f"make_vocab_size_divisible_by {divisor} and tensor_model_parallel_size {tp} (padding of fewer than "
        f"{divisor * tp} rows, to the embedding's {rows})",
        f"vocab_size {vocab}, {rows - vocab} rows short",
    )


def _whole(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _number(value) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None
