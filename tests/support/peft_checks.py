"""Checks the PEFT LoRA tests share: outputs against what peft itself saved, loaded and merged."""

from __future__ import annotations

import os

import torch
from helpers import bits

from fsdpfast._testing.fsdp2_writer import PROBE_INPUT


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(bits(got[name]), bits(want[name])), f"{name} differs"


def untied(reference: dict, out: dict) -> dict:
    """The reference without lm_head where the output ties it to the input embedding (written once)."""
    return {k: v for k, v in reference.items() if k in out or k != "lm_head.weight"}


def adapter_folder(out, adapter: str) -> str:
    return os.path.join(out, "lora_adapter", *([] if adapter == "default" else [adapter]))


def peft_logits(out, folder: str, dtype: torch.dtype) -> torch.Tensor:
    """The merged base loaded by transformers, the adapter by peft, on the FSDP2 writer's probe input.

    Loaded in float32 and cast, as the training model was built (helpers.transformers_logits);
    the adapter kept in its saved dtype, as it was trained (autocast_adapter_dtype=False)."""
    import peft
    import transformers

    torch.set_num_threads(1)
    model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).to(dtype)
    model = peft.PeftModel.from_pretrained(model, folder, autocast_adapter_dtype=False).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROBE_INPUT)).logits
