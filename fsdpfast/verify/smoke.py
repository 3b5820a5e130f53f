"""`verify --smoke`: load the merged folder with transformers and run one forward pass.

transformers and torch are imported only here, only when asked for.
"""

from __future__ import annotations

import os

from ..errors import BadInput, option

SMOKE_TOKENS = [3, 14, 15, 92, 65, 35, 89, 79]  # a fixed input; ids past the vocabulary wrap around


def smoke_test(out_dir: str) -> list[str]:
    """Problems found (empty if the model loads every weight and gives finite outputs of the right shape)."""
    if not os.path.isfile(os.path.join(out_dir, "config.json")):
        raise BadInput(
            f"{out_dir}: {option('smoke', True)} needs config.json in the folder (merge with {option('config', meta='DIR')})"
        )
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise BadInput(f"{option('smoke', True)} needs transformers ({exc}); pip install transformers") from None
    transformers.utils.logging.disable_progress_bar()  # our report is the output
    from ..hf.config import load_config

    if not isinstance(load_config(os.path.join(out_dir, "config.json")).get("model_type"), str):
        raise BadInput(
            f'{out_dir}/config.json: has no "model_type" field, so transformers cannot tell which model to '
            f'build; add it (e.g. "model_type": "llama") or merge with {option("config", meta="DIR")}'
        )
    config = transformers.AutoConfig.from_pretrained(out_dir)
    model, info = load_model(transformers, torch, config, out_dir)
    problems = [
        f"{key}: not in the folder (the model would start from random values)" for key in info.get("missing_keys", [])
    ]
    problems += [
        f"{key}: shape differs from the model's ({detail})" for key, *detail in info.get("mismatched_keys", [])
    ]
    vocab = getattr(config, "vocab_size", None) or 1
    ids = smoke_input(torch, vocab)
    model.eval()
    with torch.no_grad():
        outputs = model(input_ids=ids)
    for name, value in outputs.items():
        if not isinstance(value, torch.Tensor):
            continue
        if value.shape[:2] != ids.shape:
            problems.append(
                f"output {name}: shape {tuple(value.shape)} does not start with the input's {tuple(ids.shape)}"
            )
        if name == "logits" and value.shape[-1] != vocab:
            problems.append(f"output logits: last dimension {value.shape[-1]} is not vocab_size {vocab}")
        if value.is_floating_point() and not torch.isfinite(value).all():
            bad = int((~torch.isfinite(value)).sum())
            problems.append(
                f"output {name}: {bad} of {value.numel()} values are not finite (NaN or inf in the weights?)"
            )
    return problems


def smoke_input(torch, vocab: int):
    """The fixed input ids, wrapped into the vocabulary: batch 1."""
    return torch.tensor([[t % vocab for t in SMOKE_TOKENS]])


def smoke_base(base_dir: str):
    """The model in `base_dir` as the smoke test loads it, and its smoke input: what a PEFT adapter is loaded onto
    (given to lora.verify, which does not import verify)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(base_dir)
    model, _ = load_model(transformers, torch, config, base_dir)
    return model, smoke_input(torch, getattr(config, "vocab_size", None) or 1)


def load_model(transformers, torch, config, out_dir: str):
    """The class config.json names, else the first auto class that knows the model type."""
    names = [a for a in (getattr(config, "architectures", None) or []) if hasattr(transformers, a)]
    classes = [getattr(transformers, n) for n in names[:1]] or [
        transformers.AutoModelForCausalLM,
        transformers.AutoModelForMaskedLM,
        transformers.AutoModel,
    ]
    for cls in classes:
        try:
            return cls.from_pretrained(out_dir, dtype=torch.float32, output_loading_info=True)
        except ValueError as exc:  # this auto class does not know the model type: try the next
            error = exc
    raise BadInput(f"{out_dir}: transformers cannot build this model ({error})")
