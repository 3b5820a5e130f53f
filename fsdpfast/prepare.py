"""Turn a reader's plan into what gets written: clean names, tied weights once, target dtypes."""
from __future__ import annotations

import os

from .configs import load_config
from .dtypes import TARGET_ALIASES, target_dtype
from .errors import BadInput, option
from .plan import MergePlan, TensorPlan

# Components that wrappers (FSDP1, torch.compile, activation checkpointing) add to names.
_WRAPPER_COMPONENTS = {"_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module"}
# Output and input embedding names that `tie_word_embeddings` ties.
_OUTPUT_EMBEDDINGS = ("lm_head.weight", "predictions.decoder.weight", "embed_out.weight")
_INPUT_EMBEDDINGS = ("embed_tokens.weight", "word_embeddings.weight", "wte.weight", "embed_in.weight", "shared.weight")


def clean_name(name: str) -> str:
    parts = [p for p in name.split(".") if p not in _WRAPPER_COMPONENTS]
    while len(parts) > 1 and parts[0] == "module":  # DistributedDataParallel's prefix
        parts = parts[1:]
    return ".".join(parts)


def parse_dtype(wanted: str | None) -> str | None:
    key = "keep" if wanted is None else str(wanted)
    if key not in TARGET_ALIASES:
        raise BadInput(f"{option('dtype', wanted)} is not one of {', '.join(TARGET_ALIASES)}")
    return TARGET_ALIASES[key]


def prepare(plan: MergePlan, dtype: str | None, config_dir: str | None) -> MergePlan:
    wanted = parse_dtype(dtype)
    tensors = _rename(plan.tensors)
    tensors = _drop_shared(tensors)
    tensors = _drop_config_tied(tensors, _read_config(config_dir), plan.notes)
    for tensor in tensors:
        tensor.target_dtype = target_dtype(tensor.source_dtype, wanted)
    plan.tensors = tensors
    return plan


def _rename(tensors: list[TensorPlan]) -> list[TensorPlan]:
    seen: dict[str, str] = {}
    for tensor in tensors:
        clean = clean_name(tensor.name)
        if clean in seen:
            raise BadInput(f"{seen[clean]} and {tensor.name} both become {clean} once wrapper prefixes are removed")
        seen[clean] = tensor.name
        tensor.name = clean
    return tensors


def _drop_shared(tensors: list[TensorPlan]) -> list[TensorPlan]:
    """Names that read exactly the same bytes (one storage under two names) are written once."""
    kept: dict[tuple, TensorPlan] = {}
    out = []
    for tensor in tensors:
        key = (tensor.shape, tensor.source_dtype, tuple(tensor.extents))
        if tensor.extents and key in kept:
            kept[key].aliases.append(tensor.name)
            continue
        kept[key] = tensor
        out.append(tensor)
    return out


def _drop_config_tied(tensors: list[TensorPlan], config: dict, notes: list[str]) -> list[TensorPlan]:
    """`tie_word_embeddings: true`: transformers rebuilds the output embedding from the input one.

    Needed where the checkpoint stores both names in separate bytes (DCP does); one storage under
    two names was already written once by _drop_shared.
    """
    if not config.get("tie_word_embeddings", False):
        return tensors
    by_name = {t.name: t for t in tensors}
    inputs = [t for t in tensors if t.name.endswith(_INPUT_EMBEDDINGS)]
    outputs = [t for t in tensors if t.name.endswith(_OUTPUT_EMBEDDINGS)]
    pairs = []
    if len(inputs) == 1 and len(outputs) == 1 and inputs[0].shape == outputs[0].shape:
        pairs.append((inputs[0], outputs[0]))
    for tensor in outputs:  # a masked-LM decoder's bias is tied to the prediction head's bias
        bias_name = tensor.name[: -len("decoder.weight")] + "decoder.bias"
        head_bias = by_name.get(tensor.name[: -len("decoder.weight")] + "bias")
        if tensor.name.endswith("decoder.weight") and bias_name in by_name and head_bias is not None:
            if head_bias.shape == by_name[bias_name].shape:
                pairs.append((head_bias, by_name[bias_name]))
    for kept, dropped in pairs:
        kept.aliases.append(dropped.name)
        notes.append(f"{dropped.name} not written: config.json ties it to {kept.name} (tie_word_embeddings)")
    dropped_names = {dropped.name for _, dropped in pairs}
    return [t for t in tensors if t.name not in dropped_names]


def _read_config(config_dir: str | None) -> dict:
    if not config_dir:
        return {}
    path = os.path.join(config_dir, "config.json")
    return load_config(path) if os.path.isfile(path) else {}
