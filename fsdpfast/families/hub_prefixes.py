"""Vision-language models under the prefixes their Hub checkpoints use, as `save_pretrained` writes them.

transformers 5 nests a VLM's parts under `model.` (`model.language_model`, `model.visual`); loading
renames the Hub's prefixes into that, and `save_pretrained` renames them back (5.24,
conversion_mapping.py: the `Qwen2VLForConditionalGeneration` rules, Qwen2.5-VL's alias of it; the
`llava` and `LlavaModel` rules of the model types that use them, Gemma 3's among them). The reverse
renames, longest prefix first. VLMs whose Hub names are the in-memory ones (Qwen3-VL) are not listed.
"""

from __future__ import annotations

from dataclasses import replace

from ..plan.model import TensorPlan

_QWEN2_VL = (("model.visual.", "visual."), ("model.language_model.", "model."))
_LLAVA = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)

# config.json's architecture (or model_type) -> (in-memory prefix, Hub prefix) renames
BY_ARCHITECTURE = {
    "Qwen2VLForConditionalGeneration": _QWEN2_VL,
    "Qwen2_5_VLForConditionalGeneration": _QWEN2_VL,
}
BY_MODEL_TYPE = {"gemma3": _LLAVA, "llava": _LLAVA, "mistral3": _LLAVA}


def rules_for(config: dict) -> tuple[tuple[str, str], ...]:
    architectures = config.get("architectures") or []
    architecture = architectures[0] if isinstance(architectures, list) and architectures else None
    if architecture in BY_ARCHITECTURE:
        return BY_ARCHITECTURE[architecture]
    if architecture is not None and not str(architecture).endswith("ForConditionalGeneration"):
        return ()  # a text-only class of the family (Gemma3ForCausalLM) keeps its names
    return BY_MODEL_TYPE.get(config.get("model_type"), ())


def hub_name(name: str, rules: tuple[tuple[str, str], ...]) -> str:
    for memory, hub in rules:
        if name.startswith(memory):
            return hub + name[len(memory) :]
    return name


def renamed(tensors, rules, clean) -> list[TensorPlan]:
    """The plan's tensors under the Hub prefixes; `clean`: the written name of a checkpoint name."""
    out = []
    for tensor in tensors:
        name = hub_name(clean(tensor.name), rules)
        if name == clean(tensor.name):
            out.append(tensor)
        else:
            out.append(replace(tensor, name=name, aliases=tuple(hub_name(clean(a), rules) for a in tensor.aliases)))
    return out
