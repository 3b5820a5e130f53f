"""The folders training frameworks write, given whole, as their users would: each merged bit for bit.

Checkpoints come from the frameworks' own saving code on gloo ranks (fsdpfast._testing.framework_examples):
accelerate 1.15 (`Accelerator.save_state`, `save_fsdp_model`), torchtitan's `CheckpointManager`,
and a Hugging Face Trainer's `checkpoint-N/` written by the calls the Trainer makes under FSDP (the
Trainer selects FSDP only on an accelerator). verl's step folder is built from verl's rank files
(tests/support/corpus.py names them; written with the torch.save call verl's FSDPCheckpointManager makes); verl
itself is too heavy for CI. Every merge is compared with the full state dict gathered in the
writing process, and with the framework's own converter where one exists.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from framework_checkpoints import needs_accelerate, needs_torchtitan
from helpers import assert_bit_exact, bits, load_reference, read_merged

import fsdpfast
from fsdpfast.errors import BadInput
from fsdpfast.manifest import read_manifest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdpfast", *map(str, args)], capture_output=True, text=True)


def _refused(*args) -> str:
    result = _cli(*args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("fsdpfast: error: "), result.stderr
    return result.stderr


def _assert_equal_tensors(merged: dict, oracle: dict, dtype=None) -> None:
    assert set(merged) == set(oracle)
    for name, got in merged.items():
        want = oracle[name].to(dtype) if dtype is not None and oracle[name].is_floating_point() else oracle[name]
        assert got.dtype == want.dtype and torch.equal(bits(got), bits(want)), name


# ---- accelerate save_state and the Trainer's checkpoint-N/ ---------------------------------------


@needs_accelerate
@pytest.mark.parametrize("name", ["acc-state", "acc-state-fsdp1", "trainer"])
def test_accelerate_and_trainer_folders_merge_given_whole(frameworks, tmp_path, name):
    from accelerate.utils import merge_fsdp_weights
    from safetensors.torch import load_file

    spec, folder = frameworks.get(name)
    out = tmp_path / "merged"
    report = fsdpfast.merge(folder, out, dtype="bf16")
    reference, tied = frameworks.reference(name)
    merged = read_merged(out)
    assert_bit_exact(merged, reference, torch.bfloat16, tied)
    # accelerate's own converter (`accelerate merge-weights`) on the model's folder agrees
    merge_fsdp_weights(os.path.join(folder, "pytorch_model_fsdp_0"), str(tmp_path / "accelerate"))
    _assert_equal_tensors(merged, load_file(tmp_path / "accelerate" / "model.safetensors"), torch.bfloat16)
    # what was chosen is said, and the config comes from where the user put it
    assert report.notes[0].startswith(
        "accelerate / Trainer checkpoint: the model is pytorch_model_fsdp_0/; not merged: optimizer_0/"
    )
    assert any(
        note.startswith(f"config.json from {os.path.abspath(spec.root(frameworks.root))}") for note in report.notes
    )
    copied = sorted(os.listdir(out))
    assert "config.json" in copied and not any(
        f.endswith((".pkl", ".pth", ".pt")) or f == "trainer_state.json" for f in copied
    )
    with open(out / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    # sources are recorded relative to the folder given; verify --against reads the same model again
    sources = [s["path"] for s in read_manifest(out)["sources"]]
    assert sources and all(p.startswith("pytorch_model_fsdp_0/") for p in sources)
    assert fsdpfast.verify(out, against=folder).ok
    found = fsdpfast.inspect(folder)
    assert found["model_folder"] == "pytorch_model_fsdp_0" and found["layout"] == "dcp"
    assert "(the model in pytorch_model_fsdp_0/)" in _cli("inspect", folder).stdout.splitlines()[0]


@needs_accelerate
def test_output_inside_the_checkpoint_is_refused_but_beside_it_is_fine(frameworks, tmp_path):
    spec, folder = frameworks.get("trainer")
    checkpoint = shutil.copytree(spec.root(frameworks.root), tmp_path / "run")
    inside = checkpoint / "checkpoint-1" / "merged"
    assert "inside the checkpoint folder" in _refused("merge", checkpoint / "checkpoint-1", "--out", inside)
    assert not inside.exists()
    beside = checkpoint / "merged"  # in the run's output_dir, where config.json was taken from
    fsdpfast.merge(checkpoint / "checkpoint-1", beside)
    reference, tied = frameworks.reference("trainer")
    assert_bit_exact(read_merged(beside), reference, tied=tied)


@needs_accelerate
def test_two_accelerate_models_are_named_and_each_merges(frameworks, tmp_path):
    _, folder = frameworks.get("acc-two-models")
    error = _refused("merge", folder, "--out", tmp_path / "out")
    assert "an accelerate checkpoint of 2 models (pytorch_model_fsdp_0/, pytorch_model_fsdp_1/)" in error
    assert f"fsdpfast merge {os.path.join(folder, 'pytorch_model_fsdp_0')} --out OUT" in error
    for index in (0, 1):
        out = tmp_path / f"model{index}"
        report = fsdpfast.merge(os.path.join(folder, f"pytorch_model_fsdp_{index}"), out)
        reference, tied = frameworks.reference("acc-two-models", index)
        assert_bit_exact(read_merged(out), reference, tied=tied)
        assert any(note.startswith(f"config.json from {folder}") for note in report.notes)  # the folder above


@needs_accelerate
def test_trainer_folder_of_fsdp1_flat_parameters(frameworks, tmp_path):
    spec, folder = frameworks.get("trainer-local-fsdp1")
    out = tmp_path / "merged"
    report = fsdpfast.merge(folder, out)
    assert report.layout == "fsdp1-flat"
    reference, tied = frameworks.reference("trainer-local-fsdp1")
    assert_bit_exact(read_merged(out), reference, tied=tied)
    # the model class comes from config.json in the run's output_dir, above the checkpoint
    assert any(os.path.join(spec.root(frameworks.root), "config.json") in note for note in report.notes)


@needs_accelerate
def test_config_without_architectures_names_the_field(frameworks, tmp_path):
    spec, _ = frameworks.get("trainer-local-fsdp1")
    run = shutil.copytree(spec.root(frameworks.root), tmp_path / "run")
    with open(run / "config.json") as f:
        config = json.load(f)
    del config["architectures"]  # as a config saved on its own, or by a model made with from_config, has it
    with open(run / "config.json", "w") as f:
        json.dump(config, f)
    error = _refused("merge", run / "checkpoint-1", "--out", tmp_path / "out")
    assert f'{run / "config.json"}: has no "architectures" field' in error and '["LlamaForCausalLM"]' in error
    config["architectures"] = None  # what a config written from a bare PretrainedConfig holds
    with open(run / "config.json", "w") as f:
        json.dump(config, f)
    assert 'has no "architectures" field' in _refused("merge", run / "checkpoint-1", "--out", tmp_path / "out")
    config["architectures"] = ["LlamaForCausalLM"]
    del config["model_type"]
    with open(run / "config.json", "w") as f:
        json.dump(config, f)
    assert f'{run / "config.json"}: has no "model_type" field' in _refused(
        "merge", run / "checkpoint-1", "--out", tmp_path / "out"
    )


@needs_accelerate
def test_smoke_without_model_type_names_the_field(frameworks, tmp_path):
    _, folder = frameworks.get("acc-ranks")
    out = tmp_path / "merged"
    fsdpfast.merge(folder, out)
    with open(out / "config.json") as f:
        config = json.load(f)
    del config["model_type"]
    with open(out / "config.json", "w") as f:
        json.dump(config, f)
    assert 'has no "model_type" field' in _refused("verify", out, "--smoke")


# ---- torchtitan -----------------------------------------------------------------------------------


@needs_torchtitan
def test_torchtitan_resumable_step_folder(frameworks, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, folder = frameworks.get("torchtitan")
    out = tmp_path / "merged"
    report = fsdpfast.merge(folder, out)
    reference, tied = frameworks.reference("torchtitan")
    merged = read_merged(out)
    assert_bit_exact(merged, reference, tied=tied)
    assert any(
        note.startswith(f"the model: the {len(reference)} tensors at the top level")
        and "optimizer" in note
        and "train_state" in note
        and "lr_scheduler" in note
        for note in report.notes
    )
    # torch's own converter: the same tensors at the top level, beside the other parts
    dcp_to_torch_save(folder, tmp_path / "oracle.pt")
    oracle = torch.load(tmp_path / "oracle.pt", weights_only=False)
    _assert_equal_tensors(merged, {k: v for k, v in oracle.items() if isinstance(v, torch.Tensor)})
    assert {"optimizer", "lr_scheduler", "train_state"} <= set(oracle)
    with pytest.raises(BadInput, match="no tensors under prefix='model'"):  # --prefix is for nested parts
        fsdpfast.merge(folder, tmp_path / "other", prefix="model")


@needs_torchtitan
def test_torchtitan_last_step_and_the_checkpoint_root(frameworks, tmp_path):
    spec, _ = frameworks.get("torchtitan")
    checkpoints = os.path.join(spec.root(frameworks.root), "checkpoint")
    out = tmp_path / "merged"
    fsdpfast.merge(os.path.join(checkpoints, "step-2"), out)  # model only, in torchtitan's export dtype
    reference, tied = frameworks.reference("torchtitan")
    assert_bit_exact(read_merged(out), reference, torch.bfloat16, tied)
    error = _refused("merge", checkpoints, "--out", tmp_path / "out")
    assert "its sub-folders step-1/, step-2/ hold checkpoints" in error


# ---- verl ---------------------------------------------------------------------------------------


def _verl_step(checkpoints, tmp_path, roles) -> tuple:
    spec, ranks = checkpoints.get("w2-llama")
    step = tmp_path / "global_step_1"
    for role in roles:
        shutil.copytree(ranks, step / role)
    (step / "data.pt").write_bytes(b"")  # verl's dataloader state, beside the roles
    return spec, step


def test_verl_step_folder_with_the_actor_alone(checkpoints, tmp_path):
    spec, step = _verl_step(checkpoints, tmp_path, ["actor"])
    out = tmp_path / "merged"
    report = fsdpfast.merge(step, out)
    reference, tied = load_reference(spec.reference_path(checkpoints.root))
    assert_bit_exact(read_merged(out), reference, tied=tied)
    assert report.notes[0] == "verl step folder: the rank files are in actor/; merged those"
    assert "config.json" in os.listdir(out)  # actor/huggingface/
    assert all(s["path"].startswith("actor/") for s in read_manifest(out)["sources"])


def test_verl_step_folder_with_actor_and_critic(checkpoints, tmp_path):
    _, step = _verl_step(checkpoints, tmp_path, ["actor", "critic"])
    error = _refused("merge", step, "--out", tmp_path / "out")
    assert "a verl step folder: the rank files are in actor/ and critic/" in error
    assert f"fsdpfast merge {step / 'actor'} --out OUT" in error
