"""Turn a reader's plan into what gets written: clean names, tied weights once, target dtypes.

Metadata only: whether two tied names hold the same bytes is asked of the caller's
`check_tied_bytes` (checks.ties), which reads them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

from ..dtypes import TARGET_ALIASES, target_dtype
from ..errors import BadInput, ModelMismatch, option
from ..hf.config import load_config
from .model import MergePlan, TensorPlan
from .model_check import ExpectedModel, match_names

# Components that wrappers (FSDP1, torch.compile, activation checkpointing) add to names.
_WRAPPER_COMPONENTS = {"_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module"}
# Output and input embedding names that `tie_word_embeddings` ties.
_OUTPUT_EMBEDDINGS = ("lm_head.weight", "predictions.decoder.weight", "embed_out.weight")
_INPUT_EMBEDDINGS = ("embed_tokens.weight", "word_embeddings.weight", "wte.weight", "embed_in.weight", "shared.weight")

# (plan, kept, other): refuses the tie if the checkpoint holds different bytes under the two names.
TiedBytesCheck = Callable[[MergePlan, TensorPlan, TensorPlan], None]


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


def prepare(
    plan: MergePlan,
    dtype: str | None,
    config_dir: str | None,
    expected: ExpectedModel | None = None,
    *,
    check_tied_bytes: TiedBytesCheck,
    kept_in_fp32=None,
) -> MergePlan:
    """Clean names, tie what transformers re-ties on load (written once), set target dtypes.

    `dtype`: parsed (parse_dtype, fsdpfast.options), None keeping each tensor's own. `expected`: the
    model config.json describes (model_check), which says which names are tied; without it,
    config.json's `tie_word_embeddings` does for the embeddings. `check_tied_bytes` (checks.ties)
    compares each tied pair's bytes before the second name is dropped. `kept_in_fp32` (name -> bool,
    families.keep_fp32): the floating tensors a cast leaves in float32, as transformers' cast does.
    """
    wanted = dtype
    tensors = _rename(plan.tensors)
    pairs = tied_pairs(tensors, expected, _config_of(plan, config_dir))
    tensors, notes = _drop_tied(tensors, pairs, plan, check_tied_bytes)
    kept = [t.name for t in tensors if kept_in_fp32 is not None and wanted is not None and kept_in_fp32(t.name)]
    tensors = [
        replace(t, target_dtype=target_dtype(t.source_dtype, "float32" if t.name in kept else wanted)) for t in tensors
    ]
    if kept:
        notes.append(
            f"kept in float32, as transformers keeps them when it casts this model: {len(kept)} tensors "
            f"({', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''})"
        )
    return plan.but(tensors=tensors).noted(*notes)


def planned_ties(plan: MergePlan, config_dir: str | None, expected: ExpectedModel | None) -> list[tuple[str, str]]:
    """The (kept, dropped) pairs `prepare` would tie, given the same arguments: a plan prepared without
    the model (still being built) is the one prepared with it when these agree."""
    return tied_pairs(_rename(plan.tensors), expected, _config_of(plan, config_dir))


def _config_of(plan: MergePlan, config_dir: str | None) -> dict:
    return _read_config(config_dir) if config_dir else dict(plan.built_config or {})


def _rename(tensors) -> list[TensorPlan]:
    seen: dict[str, str] = {}
    renamed = []
    for tensor in tensors:
        clean = clean_name(tensor.name)
        if clean in seen:
            raise BadInput(f"{seen[clean]} and {tensor.name} both become {clean} once wrapper prefixes are removed")
        seen[clean] = tensor.name
        renamed.append(replace(tensor, name=clean))
    return renamed


def tied_pairs(tensors: list[TensorPlan], expected: ExpectedModel | None, config: dict) -> list[tuple[str, str]]:
    """(kept, dropped) names that transformers ties when it loads the folder."""
    names = [t.name for t in tensors]
    if expected is not None and not expected.base_only:
        ours = {model_name: name for name, model_name in match_names(names, expected).items()}
        return [
            (ours[kept], ours[dropped]) for dropped, kept in expected.tied.items() if kept in ours and dropped in ours
        ]
    if config.get("tie_word_embeddings") is not True:
        return []
    by_name = {t.name: t for t in tensors}
    inputs = [t for t in tensors if t.name.endswith(_INPUT_EMBEDDINGS)]
    outputs = [t for t in tensors if t.name.endswith(_OUTPUT_EMBEDDINGS)]
    pairs = []
    if len(inputs) == 1 and len(outputs) == 1:
        pairs.append((inputs[0].name, outputs[0].name))
    for tensor in outputs:  # a masked-LM decoder's bias is tied to the prediction head's bias
        head = tensor.name[: -len("decoder.weight")]
        if tensor.name.endswith("decoder.weight") and head + "decoder.bias" in by_name and head + "bias" in by_name:
            pairs.append((head + "bias", head + "decoder.bias"))
    return pairs


def _drop_tied(
    tensors: list[TensorPlan], pairs: list[tuple[str, str]], plan: MergePlan, check_tied_bytes: TiedBytesCheck
) -> tuple[list[TensorPlan], list[str]]:
    """Write each tied name once, after `check_tied_bytes` has found the same bytes under both;
    one storage under two names that transformers will not re-tie is written under both (said in
    the notes returned)."""
    by_name = {t.name: t for t in tensors}
    dropped, aliases, notes = set(), {}, []
    for kept, other in pairs:
        a, b = by_name[kept], by_name[other]
        if (a.shape, a.source_dtype) != (b.shape, b.source_dtype):
            raise ModelMismatch(
                f"config.json ties {other} to {kept}, but the checkpoint holds {b.source_dtype} {list(b.shape)} "
                f"and {a.source_dtype} {list(a.shape)}; the config does not describe this model ({option('config', meta='DIR')})"
            )
        check_tied_bytes(plan, a, b)
        aliases.setdefault(kept, []).append(other)
        dropped.add(other)
    tied_names = {name for pair in pairs for name in pair}
    # (shape, dtype, first extent) -> [(extents, first name)]: whole extents are compared only where
    # the first ones agree (a tensor of 1,024 ranks has a thousand)
    shared: dict[tuple, list] = {}
    for tensor in tensors:
        if not tensor.extents:
            continue
        same = shared.setdefault((tensor.shape, tensor.source_dtype, tensor.extents[0]), [])
        first = next((name for extents, name in same if extents == tensor.extents), None)
        if first is None:
            same.append((tensor.extents, tensor.name))
        elif tensor.name not in tied_names:
            notes.append(
                f"{first} and {tensor.name} share one storage in the checkpoint, but the model's "
                "config does not tie them: both are written"
            )
    kept = [
        replace(t, aliases=t.aliases + tuple(aliases[t.name])) if t.name in aliases else t
        for t in tensors
        if t.name not in dropped
    ]
    return kept, notes


def _read_config(config_dir: str | None) -> dict:
    if not config_dir:
        return {}
    path = os.path.join(config_dir, "config.json")
    return load_config(path) if os.path.isfile(path) else {}
