"""torch.ops.fsdpfast.lora_merge against peft's own LoRA layers' merge(), bit for bit.

The op (csrc/lora_merge.cpp) must compute what peft's merge_and_unload computes: the same
ATen calls in the same order and dtypes. Checked here on peft's layers themselves (Linear,
Conv1D with fan_in_fan_out, Embedding, lora_bias; float32, bfloat16, float16, and a bfloat16
weight with float32 adapters as peft's autocast_adapter_dtype makes them). torch's opcheck of
these ops, with a pure-torch reference that needs no peft, is in test_torch_ops.py.
"""

from __future__ import annotations

import pytest
import torch

from fsdpfast import _ops

peft = pytest.importorskip("peft")
pytestmark = [
    pytest.mark.skipif(not _ops.torch_ops(), reason=f"fsdpfast torch ops not built: {_ops.torch_ops_error()}"),
    pytest.mark.torch_ops,
]

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and _ops.native_cuda_built() else [])


def _layer(kind: str, weight_dtype, adapter_dtype, seed: int, lora_bias: bool = False, rslora: bool = False):
    from peft.tuners.lora import Embedding, Linear
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(seed)
    if kind == "embedding":
        base, layer_cls, extra = torch.nn.Embedding(37, 24), Embedding, {}
    elif kind == "conv1d":  # GPT-2's layer: weight stored (in, out), peft's fan_in_fan_out
        base, layer_cls, extra = Conv1D(24, 40), Linear, {"fan_in_fan_out": True}
    else:
        base, layer_cls, extra = torch.nn.Linear(40, 24, bias=lora_bias), Linear, {"lora_bias": lora_bias}
    torch.nn.init.normal_(base.weight)
    config = peft.LoraConfig(r=6, lora_alpha=10, init_lora_weights=False, use_rslora=rslora, **extra)
    layer = layer_cls(base, "default", config=config, r=6, lora_alpha=10)
    for name, param in layer.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(param, std=0.3)
            param.data = param.data.to(adapter_dtype)
    base.weight.data = base.weight.data.to(weight_dtype)
    if getattr(base, "bias", None) is not None:
        base.bias.data = base.bias.data.to(weight_dtype)
    return layer


CASES = [
    ("linear", torch.float32, torch.float32),
    ("linear", torch.bfloat16, torch.bfloat16),
    ("linear", torch.float16, torch.float16),
    ("linear", torch.bfloat16, torch.float32),
    ("conv1d", torch.float32, torch.float32),
    ("conv1d", torch.bfloat16, torch.bfloat16),
    ("embedding", torch.float32, torch.float32),
    ("embedding", torch.bfloat16, torch.bfloat16),
    ("embedding", torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,weight_dtype,adapter_dtype", CASES)
def test_equals_peft_merge(device, kind, weight_dtype, adapter_dtype):
    for seed, rslora in ((1, False), (2, True)):
        layer = _layer(kind, weight_dtype, adapter_dtype, seed, rslora=rslora).to(device)
        weight = layer.base_layer.weight.detach().clone()
        if kind == "embedding":
            a, b = layer.lora_embedding_A["default"], layer.lora_embedding_B["default"]
        else:
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        ours = torch.ops.fsdpfast.lora_merge(
            weight, a.detach(), b.detach(), layer.scaling["default"], kind == "conv1d", kind == "embedding"
        )
        layer.merge()
        theirs = layer.base_layer.weight.detach()
        assert ours.dtype == theirs.dtype and torch.equal(
            ours.view(-1).view(torch.uint8), theirs.reshape(-1).view(torch.uint8)
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_equals_peft_merge(device, dtype):
    layer = _layer("linear", dtype, dtype, 3, lora_bias=True).to(device)
    bias = layer.base_layer.bias.detach().clone()
    ours = torch.ops.fsdpfast.lora_merge_bias(bias, layer.lora_B["default"].bias.detach(), layer.scaling["default"])
    layer.merge()
    assert torch.equal(ours.view(torch.uint8), layer.base_layer.bias.detach().view(torch.uint8))


def test_shapes_are_checked():
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.fsdpfast.lora_merge(torch.zeros(5, 5), torch.zeros(2, 4), torch.zeros(5, 2), 1.0, False, False)
    with pytest.raises(RuntimeError, match="share a rank"):
        torch.ops.fsdpfast.lora_merge(torch.zeros(5, 4), torch.zeros(2, 4), torch.zeros(5, 3), 1.0, False, False)
