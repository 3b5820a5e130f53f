"""PEFT LoRA models in FSDP1 LOCAL_STATE_DICT flat parameters, merged into a base model and an adapter folder.

Every checkpoint comes from a real peft model wrapped by real FSDP1 on gloo ranks and trained for a step
(fsdpfast._testing.peft_fsdp1_examples): decoder-layer units with use_orig_params=True, or peft's own
fsdp_auto_wrap_policy with use_orig_params=False. FSDP1 saves no parameter names or order, so fsdpfast
rebuilds the peft model (lora.fsdp1_model); the references come from the live model: FSDP1's
FULL_STATE_DICT, peft's own adapter state dict and merge_and_unload() of it, the training model's logits.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import CheckpointsByWorld, bits, read_merged
from peft_checks import adapter_folder, assert_same, peft_logits
from refusals import cli_refuses

import fsdpfast
from fsdpfast._testing.peft_examples import PeftSpec, lora_config
from fsdpfast._testing.peft_fsdp1_examples import write_peft_fsdp1_checkpoints
from fsdpfast.lora.split import lora_role

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

pytest.importorskip("peft")

# name -> (world size, spec). World 3 pads every flat parameter unevenly (and the 16-byte alignment of use_orig_params).
SPECS = {
    spec.name: (world, spec)
    for world, spec in [
        (2, PeftSpec("orig-w2", layout="fsdp1-orig", r=4, lora_alpha=8, seed=61)),
        (2, PeftSpec("peft-policy-w2", layout="fsdp1-peft-policy", r=4, lora_alpha=8, meta=False, seed=62)),
        (
            3,
            PeftSpec(
                "orig-w3-bias",
                layout="fsdp1-orig",
                r=4,
                lora_alpha=16,
                targets=("q_proj", "k_proj", "o_proj", "up_proj"),
                sizes={"attention_bias": True, "mlp_bias": True},
                extras={"lora_bias": True},
                seed=63,
            ),
        ),
    ]
}


class PeftFsdp1Checkpoints(CheckpointsByWorld):
    def __init__(self, root: str):
        super().__init__(root, SPECS, write_peft_fsdp1_checkpoints, lambda spec, root: spec.folder(root))

    def reference(self, name: str) -> dict:
        return torch.load(SPECS[name][1].reference_path(self.root), weights_only=True)

    def copy(self, name: str, tmp_path) -> str:
        return shutil.copytree(self.get(name)[1], tmp_path / "ckpt")


@pytest.fixture(scope="module")
def fsdp1_lora(tmp_path_factory) -> PeftFsdp1Checkpoints:
    return PeftFsdp1Checkpoints(str(tmp_path_factory.mktemp("peft-fsdp1")))


def base_of_live_model(full: dict) -> dict:
    """The base weights of FSDP1's FULL_STATE_DICT of the trained peft model, under the model's own names."""
    out = {}
    for name, tensor in full.items():
        role, _, module, _ = lora_role(name)
        if role == "base":
            out[module] = tensor
    return out


@pytest.mark.parametrize("name", SPECS)
def test_base_model_and_adapter_folder(fsdp1_lora, tmp_path, name):
    spec, folder = fsdp1_lora.get(name)
    ref = fsdp1_lora.reference(name)
    out = tmp_path / "out"
    report = fsdpfast.merge(folder, out)
    assert report.layout == "fsdp1-flat" and report.adapters == ["lora_adapter"]
    base = read_merged(out)
    assert_same(base, base_of_live_model(ref["full"]))  # the live model's base weights, bit for bit
    assert_same(base, ref["base"])  # ... which are the model as built: LoRA training froze it
    where = adapter_folder(out, "default")
    assert_same(read_merged(where), ref["adapters"]["default"])  # peft's saved names and bytes
    with open(os.path.join(where, "adapter_config.json")) as f:
        config = json.load(f)
    trained = ref["configs"]["default"]
    for key in ("r", "lora_alpha", "task_type", "use_dora", "lora_bias"):
        assert config[key] == trained[key], key
    assert sorted(config["target_modules"]) == sorted(trained["target_modules"])
    assert torch.equal(peft_logits(out, where, torch.float32), ref["logits"]["default"])  # the training model's logits
    check = fsdpfast.verify(out, against=folder)
    assert check.ok, check.summary()


@pytest.mark.torch_ops
@pytest.mark.parametrize("name", SPECS)
def test_merge_lora_equals_merge_and_unload(fsdp1_lora, tmp_path, name):
    _, folder = fsdp1_lora.get(name)
    fsdpfast.merge(folder, tmp_path / "fused", merge_lora=True)
    fused = read_merged(tmp_path / "fused")
    assert_same(fused, fsdp1_lora.reference(name)["merged"])
    assert not os.path.exists(tmp_path / "fused" / "lora_adapter")
    check = fsdpfast.verify(tmp_path / "fused", against=folder)
    assert check.ok, check.summary()


def test_adapters_lora_b_trained_and_non_zero(fsdp1_lora):
    """The fixture is worth its name: every lora_B is non-zero, so a misplaced adapter would change the logits."""
    adapters = fsdp1_lora.reference("orig-w3-bias")["adapters"]["default"]
    lora_b = [t for n, t in adapters.items() if ".lora_B." in n]
    assert lora_b and all(bits(t).any() for t in lora_b)


def _refused(folder, out, *extra) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-m", "fsdpfast", "merge", str(folder), "--out", str(out), *map(str, extra)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("fsdpfast: error: "), result.stderr
    assert not os.path.exists(out)
    return result.stderr


def test_without_views_the_rank_must_be_recorded(fsdp1_lora, tmp_path):
    """peft's wrap policy with use_orig_params=False saves no parameter views: the rank comes from adapter_config.json,
    and without it from --lora-r (lora_alpha from --lora-alpha)."""
    folder = fsdp1_lora.copy("peft-policy-w2", tmp_path)
    shutil.rmtree(
        os.path.join(folder, "lora_adapter")
    )  # the adapter_config.json the writer saved beside the rank files
    error = _refused(folder, tmp_path / "out")
    assert "do not hold adapter default's LoRA rank" in error and "no adapter_config.json (looked in" in error
    assert "pass --lora-r R" in error
    with open(os.path.join(folder, "lora_train_meta.json"), "w") as f:  # verl's meta without r
        json.dump({"lora_alpha": 8, "task_type": "CAUSAL_LM"}, f)
    assert "lora_train_meta.json records only lora_alpha 8, task_type CAUSAL_LM" in _refused(folder, tmp_path / "out")
    error = _refused(folder, tmp_path / "out", "--lora-r", 8)  # a wrong rank: the flat sizes do not add up
    assert "its LoRA config" in error and "r from --lora-r" in error
    ref = fsdp1_lora.reference("peft-policy-w2")
    fsdpfast.merge(folder, tmp_path / "out", lora_r=4)
    assert_same(read_merged(tmp_path / "out" / "lora_adapter"), ref["adapters"]["default"])
    check = fsdpfast.verify(
        tmp_path / "out", against=folder
    )  # verify rebuilds the peft model with the recorded --lora-r
    assert check.ok, check.summary()


def test_inspect_shows_the_rebuilt_peft_model(fsdp1_lora):
    _, folder = fsdp1_lora.get("orig-w2")
    found = fsdpfast.inspect(folder)
    (adapter,) = found["assumed"]["peft"]
    assert adapter["r"] == 4 and len(adapter["target_modules"]) == 8  # 4 modules in each of 2 layers
    assert "ranks read off the parameter views' sizes" in adapter["source"]
    units = {u["module"]: [p["name"] for p in u["params"]] for u in found["assumed"]["units"]}
    assert (
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
        in units["base_model.model.model.layers.0"]
    )


# --- the records of an adapter disagreeing with each other, or with the tensors and the model ----------


def _save_adapter_config(spec: PeftSpec, folder, **fields) -> None:
    """peft's own adapter_config.json of the spec's LoraConfig (save_pretrained), with `fields` changed."""
    lora_config(spec, **fields).save_pretrained(str(folder))


@pytest.mark.torch_ops
def test_lora_alpha_the_two_files_disagree_on_is_refused(fsdp1_lora, tmp_path):
    spec, _ = fsdp1_lora.get("orig-w2")
    folder = fsdp1_lora.copy("orig-w2", tmp_path)
    _save_adapter_config(spec, folder, lora_alpha=32)
    mentions = [
        "adapter_config.json records lora_alpha 32",
        "lora_train_meta.json records lora_alpha 8",
        "--lora-alpha A",
    ]
    cli_refuses(folder, tmp_path / "out", mentions=mentions)
    cli_refuses(folder, tmp_path / "out", "--merge-lora", mentions=mentions)
    fsdpfast.merge(folder, tmp_path / "settled", merge_lora=True, lora_alpha=8)
    assert_same(read_merged(tmp_path / "settled"), fsdp1_lora.reference("orig-w2")["merged"])
    _save_adapter_config(spec, folder)  # the look-alike: both files record the training's alpha
    fsdpfast.merge(folder, tmp_path / "agreed")
    assert_same(
        read_merged(tmp_path / "agreed" / "lora_adapter"), fsdp1_lora.reference("orig-w2")["adapters"]["default"]
    )


def test_a_recorded_r_the_views_contradict_is_refused(fsdp1_lora, tmp_path):
    """use_orig_params=True: the views show rank 4; an adapter_config.json saying 8 is not this training's."""
    spec, _ = fsdp1_lora.get("orig-w2")
    folder = fsdp1_lora.copy("orig-w2", tmp_path)
    os.remove(os.path.join(folder, "lora_train_meta.json"))
    _save_adapter_config(spec, folder, r=8)
    cli_refuses(
        folder,
        tmp_path / "out",
        "--lora-alpha",
        8,
        mentions=["adapter_config.json gives", "rank 8 (r), but its lora_A is [4, 64] (rank 4)", "--lora-r 4"],
    )


def test_without_views_r_the_two_files_disagree_on_is_refused(fsdp1_lora, tmp_path):
    """peft's wrap policy saves no views: r shapes the rebuilt model, so the two files must agree on it."""
    folder = fsdp1_lora.copy("peft-policy-w2", tmp_path)  # lora_adapter/adapter_config.json records r 4
    with open(os.path.join(folder, "lora_train_meta.json"), "w") as f:
        json.dump({"r": 8, "lora_alpha": 8, "task_type": "CAUSAL_LM"}, f)
    mentions = ["adapter_config.json records r 4", "lora_train_meta.json records r 8", "--lora-r R"]
    cli_refuses(folder, tmp_path / "out", mentions=mentions)
    fsdpfast.merge(folder, tmp_path / "settled", lora_r=4)
    ref = fsdp1_lora.reference("peft-policy-w2")
    assert_same(read_merged(tmp_path / "settled" / "lora_adapter"), ref["adapters"]["default"])


@pytest.mark.torch_ops
@pytest.mark.parametrize("flags", [[], ["--merge-lora"]])
def test_an_adapter_for_a_module_the_model_lacks_is_refused(fsdp1_lora, tmp_path, flags):
    """config.json of one layer fewer: the files' layer-1 adapters are for modules that model lacks."""
    folder = fsdp1_lora.copy("orig-w2", tmp_path)
    path = os.path.join(folder, "huggingface", "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "num_hidden_layers": 1}, f)
    cli_refuses(
        folder,
        tmp_path / "out",
        *flags,
        mentions=["LoRA tensors for model.layers.1.self_attn.q_proj (and 3 more)", "LlamaForCausalLM", "--config DIR"],
    )
