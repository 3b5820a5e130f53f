"""The model-shape safety net and the tie rules, on real FSDP2 checkpoints whose config.json was altered.

A merge is checked against the class config.json names, built on the meta device, before any byte
is written; a weight is written once under a tied name only when transformers re-ties it on load
and the checkpoint holds the same bytes under both names.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import assert_bit_exact, copy_checkpoint, load_reference, read_merged, transformers_logits

import fsdpfast
from fsdpfast.errors import BadInput, ModelMismatch


def _edit_config(folder, **changes) -> None:
    path = folder / "huggingface" / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _merge_cli(*args):
    return subprocess.run([sys.executable, "-m", "fsdpfast", "merge", *map(str, args)], capture_output=True, text=True)


@pytest.mark.slow
def test_weight_tied_in_training_but_not_in_config_is_written_under_both_names(checkpoints, tmp_path):
    spec, _ = checkpoints.get("w2-tied-bf16")  # lm_head.weight is embed_tokens.weight in the training code
    folder = copy_checkpoint(checkpoints, "w2-tied-bf16", tmp_path)
    _edit_config(folder, tie_word_embeddings=False)
    reference, tied = load_reference(spec.reference_path(checkpoints.root))
    assert tied == {"lm_head.weight"}
    report = fsdpfast.merge(folder, tmp_path / "merged")
    merged = read_merged(tmp_path / "merged")
    assert_bit_exact(merged, reference)  # every name, lm_head.weight included
    assert report.tied == {}
    assert any("share one storage" in note and "lm_head.weight" in note for note in report.notes)
    logits = transformers_logits(str(tmp_path / "merged"), spec.model, spec.dtype)
    assert torch.equal(logits, torch.load(spec.logits_path(checkpoints.root), weights_only=True))


@pytest.mark.slow
def test_config_tying_two_different_tensors_is_refused(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)  # trained untied: lm_head differs from embed_tokens
    _edit_config(folder, tie_word_embeddings=True)
    result = _merge_cli(folder, "--out", tmp_path / "merged")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1
    assert "ties lm_head.weight to model.embed_tokens.weight" in result.stderr and "differ" in result.stderr
    assert not (tmp_path / "merged").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "architectures",
    [["CustomLlamaForCausalLM"], None],  # a class transformers does not ship; none named (the base model is built)
)
def test_a_tie_config_json_says_is_checked_without_the_models_class_too(checkpoints, tmp_path, architectures):
    """Where the model's class cannot say which names are tied, config.json's tie_word_embeddings does,
    and the checkpoint must hold the same bytes under both names all the same."""
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)  # trained untied
    _edit_config(folder, tie_word_embeddings=True, architectures=architectures)
    result = _merge_cli(folder, "--out", tmp_path / "merged")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "ties lm_head.weight to model.embed_tokens.weight" in result.stderr and "differ" in result.stderr
    assert not (tmp_path / "merged").exists()


@pytest.mark.slow
def test_tied_dcp_copies_are_compared_and_written_once(checkpoints, tmp_path):
    # DCP stores the tied pair as two names with separate bytes: equal, so written once.
    spec, folder = checkpoints.get("w4-dcp-hsdp-tied-bf16")
    reference, tied = load_reference(spec.reference_path(checkpoints.root))
    report = fsdpfast.merge(folder, tmp_path / "merged")
    assert_bit_exact(read_merged(tmp_path / "merged"), reference, tied=tied)
    assert report.tied == {"model.embed_tokens.weight": ["lm_head.weight"]}


@pytest.mark.slow
def test_without_config_the_merge_warns_that_the_folder_will_not_load(checkpoints, tmp_path):
    spec, _ = checkpoints.get("w2-tied-bf16")
    folder = copy_checkpoint(checkpoints, "w2-tied-bf16", tmp_path)
    shutil.rmtree(folder / "huggingface")
    result = _merge_cli(folder, "--out", tmp_path / "merged", "--json")
    assert result.returncode == 0, result.stderr
    assert "fsdpfast: warning: the output has no config.json" in result.stderr and "--config" in result.stderr
    report = json.loads(result.stdout)
    assert len(report["warnings"]) == 1 and "no config.json" in report["warnings"][0]
    reference, _ = load_reference(spec.reference_path(checkpoints.root))
    assert_bit_exact(read_merged(tmp_path / "merged"), reference)  # nothing is dropped as a tie without a config
    text = _merge_cli(folder, "--out", tmp_path / "again")
    assert "warning: the output has no config.json" in text.stdout and "fsdpfast: warning:" in text.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes,found,named",
    [
        ({"num_hidden_layers": 3}, "weights missing", "model.layers.2."),
        ({"intermediate_size": 96}, "with the wrong shape", "mlp.down_proj.weight [64, 88] (the model: [64, 96])"),
        ({"num_hidden_layers": 1}, "unexpected", "model.layers.1."),
    ],
)
def test_a_config_that_does_not_describe_the_checkpoint_is_refused(checkpoints, tmp_path, changes, found, named):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    _edit_config(folder, **changes)
    result = _merge_cli(folder, "--out", tmp_path / "merged")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "do not match LlamaForCausalLM" in result.stderr and found in result.stderr and named in result.stderr
    assert not (tmp_path / "merged").exists()
    with pytest.raises(ModelMismatch):
        fsdpfast.plan_merge(folder)


@pytest.mark.slow
def test_a_config_of_another_family_is_refused_in_the_dry_run_too(checkpoints, tmp_path):
    _, bert = checkpoints.get("w3-bert-dim1")
    with pytest.raises(BadInput, match="do not match BertForMaskedLM"):
        fsdpfast.merge(checkpoints.get("w2-llama")[1], tmp_path / "merged", config=f"{bert}/huggingface")
    result = _merge_cli(
        checkpoints.get("w2-llama")[1], "--out", tmp_path / "merged", "--dry-run", "--config", f"{bert}/huggingface"
    )
    assert result.returncode == 2 and "weights missing" in result.stderr


@pytest.mark.slow
def test_tensors_the_model_lacks_need_allow_extra_tensors(checkpoints, tmp_path):
    spec, _ = checkpoints.get("w3-wrapped-buffer")  # a persistent buffer LlamaForCausalLM does not have
    folder = copy_checkpoint(checkpoints, "w3-wrapped-buffer", tmp_path)
    _edit_config(folder, architectures=["LlamaForCausalLM"])  # the fixture's config names no class
    with pytest.raises(ModelMismatch, match="1 unexpected .fsdpfast_probe_buffer.*allow.extra.tensors"):
        fsdpfast.merge(folder, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    reference, tied = load_reference(spec.reference_path(checkpoints.root))
    report = fsdpfast.merge(folder, tmp_path / "merged", allow_extra_tensors=True)
    assert_bit_exact(read_merged(tmp_path / "merged"), reference, tied=tied)
    assert any("kept 1 tensors" in note and "fsdpfast_probe_buffer" in note for note in report.notes)
    check = fsdpfast.verify(tmp_path / "merged", against=folder)  # the recorded flag is used again
    assert check.ok, check.summary()


@pytest.mark.slow
def test_verify_against_runs_the_safety_net_on_the_outputs_config(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    fsdpfast.merge(folder, tmp_path / "merged")
    assert fsdpfast.verify(tmp_path / "merged", against=folder).ok
    config = tmp_path / "merged" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_hidden_layers": 3}))
    result = subprocess.run(
        [sys.executable, "-m", "fsdpfast", "verify", str(tmp_path / "merged"), "--against", folder],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert "(model): the merged tensors do not match LlamaForCausalLM" in result.stdout


def test_config_without_architectures_checks_the_base_model(checkpoints, tmp_path):
    spec, _ = checkpoints.get("w2-llama")
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    _edit_config(folder, architectures=None)  # a config saved from a bare LlamaConfig
    report = fsdpfast.merge(folder, tmp_path / "merged")
    assert any(
        "no 'architectures' field, so only the base model was checked" in n and "lm_head.weight" in n
        for n in report.notes
    )
    reference, _ = load_reference(spec.reference_path(checkpoints.root))
    assert_bit_exact(read_merged(tmp_path / "merged"), reference)
    _edit_config(folder, num_hidden_layers=3)
    with pytest.raises(ModelMismatch, match="do not match LlamaModel.*missing .layers.2"):
        fsdpfast.plan_merge(folder)


@pytest.mark.slow
def test_without_transformers_the_check_is_skipped_with_a_note(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    code = (
        "import sys, json; sys.modules['transformers'] = None\n"  # as if transformers were not installed
        "import fsdpfast\n"
        f"print(json.dumps(fsdpfast.inspect({str(folder)!r})['notes']))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert any("not checked against the model: transformers is not installed" in n for n in json.loads(result.stdout))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w2-guide", "w2-dcp", "w3-dcp-nested-bert-dim1", "w2-dcp-hf", "w4-hsdp-tied"])
def test_every_fsdp2_layout_is_checked(checkpoints, tmp_path, name):
    folder = copy_checkpoint(checkpoints, name, tmp_path)
    config = json.loads((folder / "huggingface" / "config.json").read_text())
    _edit_config(folder, num_hidden_layers=config["num_hidden_layers"] + 1)
    with pytest.raises(ModelMismatch, match="weights missing"):
        fsdpfast.merge(folder, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ds-w3-z2-fp32-tied", "ds-w4-z3-bf16-tied"])
def test_deepspeed_layouts_are_checked(deepspeed_checkpoints, tmp_path, name):
    spec, root = deepspeed_checkpoints.get(name)
    folder = tmp_path / "ckpt"
    shutil.copytree(root, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 8}))
    with pytest.raises(ModelMismatch, match="with the wrong shape"):
        fsdpfast.merge(folder, tmp_path / "merged")
