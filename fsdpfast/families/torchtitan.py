"""torchtitan's names onto the Hub's, as a plan transform (plan.transform): what its adapter's `to_hf` writes.

A torchtitan checkpoint (a DCP step-N folder) holds torchtitan's own names, and no config.json: the
model family comes from the base model the run started from (`--config HF_DIR`, or a config.json a
reader found). Without one the tensors are written under torchtitan's names, with a warning that the
folder is no Hugging Face model; a family whose map fsdpfast does not have is refused. Runs before the
Hub layout transform (families.transform), which splits the packed experts this one writes per expert.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import BadInput, option
from ..plan.model import MergePlan
from ..plan.model_check import ExpectedModel
from ..plan.normalise import clean_name
from ..plan.transform import ExpectedModels, NamesOnly
from .plan_config import config_of
from .torchtitan_names import FAMILIES, Heads, hub_tensors, is_torchtitan


def transforms(src: str, options) -> list:
    """The pipeline's hook (pipeline.plan.TRANSFORMS)."""
    return [TorchtitanToHub()]


def folder_checks() -> list:
    return []  # writes no folder of its own


def _config(plan: MergePlan) -> dict | None:
    return config_of(plan) or None  # None: no config.json known


def _heads(config: dict) -> Heads | None:
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int) or heads <= 0:
        return None
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads if config.get("hidden_size") else None)
    return Heads(heads, kv, head_dim)


@dataclass(frozen=True)
class TorchtitanToHub(NamesOnly):
    def apply(self, plan: MergePlan, models: ExpectedModels) -> MergePlan:
        if not is_torchtitan(clean_name(t.name) for t in plan.tensors):
            return plan
        config = _config(plan)
        if config is None:
            return plan.noted(
                warnings=(
                    "the folder is not a Hugging Face model: the checkpoint holds torchtitan's names "
                    "(tok_embeddings, layers.N.attention...), written as they are; "
                    f"{option('config', meta='HF_DIR')} with the base model the run started from writes the Hub's",
                )
            )
        found = config.get("model_type")
        family = FAMILIES.get(found if isinstance(found, str) else "")
        if family is None:
            raise BadInput(
                f"a torchtitan checkpoint with a config.json of model_type {found!r}: torchtitan's names are mapped "
                f"for model_type {', '.join(sorted(FAMILIES))} only; pass {option('config', meta='HF_DIR')} "
                "with the base model the run started from"
            )
        tensors, dropped = hub_tensors(plan.tensors, family, _heads(config), clean_name)
        notes = [
            f"torchtitan's names written as the Hub's, as torchtitan's {family.name} adapter (to_hf) writes them"
            + (
                " (wq and wk rows reordered from complex RoPE's pairs to rotate_half's halves)"
                if family.permuted
                else ""
            )
        ]
        if dropped:
            notes.append(f"left out, as to_hf does: {len(dropped)} tensors with no Hub name ({dropped[0]}, ...)")
        return plan.but(tensors=tuple(tensors)).noted(*notes)

    def expected_in_layout(self, plan: MergePlan, expected: ExpectedModel) -> ExpectedModel:
        """The model's own names (the Hub layout transform then splits experts), and deepseek_v3's (and glm4_moe's,
        which the megatron layout writes) multi-token prediction layers where config.json counts them
        (num_nextn_predict_layers): the Hub's checkpoints hold them after the main layers, transformers builds none
        (it ignores them on load) and vLLM loads them."""
        config = _config(plan) or {}
        layers, extra = config.get("num_hidden_layers"), config.get("num_nextn_predict_layers")
        mtp_families = ("deepseek_v3", "glm4_moe")
        if config.get("model_type") not in mtp_families or not isinstance(layers, int) or not isinstance(extra, int):
            return expected
        mtp = tuple(f"model.layers.{i}." for i in range(layers, layers + extra))
        shapes = {**expected.shapes, **{t.name: t.shape for t in plan.tensors if t.name.startswith(mtp)}}
        return replace(expected, shapes=shapes)
