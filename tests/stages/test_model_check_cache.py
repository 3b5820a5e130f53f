"""The model check's cache (plan.model_cache): a model built once per config.json bytes and transformers version.

Each test has a cache folder of its own (FSDPFAST_CACHE_DIR); the models are built by the real
transformers, here (this process has imported it, so no child process is started), and what is
read back from the cache must be what a build gives.
"""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")  # both imported here: every model is built in this process
transformers = pytest.importorskip("transformers")

from fsdpfast.plan import model_cache  # noqa: E402
from fsdpfast.plan.model_check import FROM_CACHE, check_against_model, load_expected_model  # noqa: E402

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 88,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 101,
    "tie_word_embeddings": True,
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv(model_cache.CACHE_ENV, str(folder))
    return folder / model_cache.FOLDER


def write_config(folder, config=None, text=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(text if text is not None else json.dumps(config or LLAMA))
    return str(folder)


def entries(cache) -> list[str]:
    return sorted(name for name in os.listdir(cache) if name.endswith(".json")) if cache.is_dir() else []


def test_a_model_built_once_is_read_back_from_the_cache_the_same(cache, tmp_path):
    config = write_config(tmp_path / "model")
    built, why = load_expected_model(config, transformers_version="t-1")
    assert built is not None, why
    assert built.cached == "" and len(entries(cache)) == 1
    again, _ = load_expected_model(config, transformers_version="t-1")
    assert again.cached == str(cache / entries(cache)[0])
    assert (again.shapes, again.tied, again.prefix, again.architecture) == (
        built.shapes,
        built.tied,
        built.prefix,
        built.architecture,
    )
    assert again.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    notes = check_against_model(dict(again.shapes), again, allow_extra=False)
    assert any(note.startswith(FROM_CACHE) and again.cached in note for note in notes)
    assert not any(FROM_CACHE in note for note in check_against_model(dict(built.shapes), built, allow_extra=False))


def test_the_same_bytes_elsewhere_are_the_same_entry_named_by_their_own_path(cache, tmp_path):
    load_expected_model(write_config(tmp_path / "a"), transformers_version="t-1")
    other, _ = load_expected_model(write_config(tmp_path / "b"), transformers_version="t-1")
    assert other.cached and other.config_path == str(tmp_path / "b" / "config.json")
    assert len(entries(cache)) == 1


def test_a_config_changed_by_one_byte_is_built_again(cache, tmp_path):
    folder = tmp_path / "model"
    load_expected_model(write_config(folder), transformers_version="t-1")
    write_config(folder, text=json.dumps(LLAMA) + " ")  # the same model, other bytes: not trusted
    model, _ = load_expected_model(str(folder), transformers_version="t-1")
    assert model.cached == "" and len(entries(cache)) == 2
    write_config(folder, {**LLAMA, "num_hidden_layers": 3})
    deeper, _ = load_expected_model(str(folder), transformers_version="t-1")
    assert deeper.cached == "" and "model.layers.2.mlp.up_proj.weight" in deeper.shapes
    assert len(entries(cache)) == 3


def test_another_transformers_version_is_built_again(cache, tmp_path):
    config = write_config(tmp_path / "model")
    load_expected_model(config, transformers_version="t-1")
    assert load_expected_model(config, transformers_version="t-2")[0].cached == ""
    assert load_expected_model(config, transformers_version="t-1")[0].cached
    assert len(entries(cache)) == 2


@pytest.mark.parametrize(
    "damage",
    [
        b"{not json",
        b"",
        b"[]",
        b'{"format": 1, "key": "another", "lasting": true, "model": null, "why_not": "x"}',
        "shapes",  # the right key and format, a shape that is not a list of integers
    ],
)
def test_a_damaged_entry_is_ignored_and_built_again(cache, tmp_path, damage):
    config = write_config(tmp_path / "model")
    built, _ = load_expected_model(config, transformers_version="t-1")
    (name,) = entries(cache)
    if damage == "shapes":
        entry = json.loads((cache / name).read_text())
        entry["model"]["shapes"]["lm_head.weight"] = "big"
        damage = json.dumps(entry).encode()
    (cache / name).write_bytes(damage)
    rebuilt, why = load_expected_model(config, transformers_version="t-1")
    assert rebuilt is not None and rebuilt.cached == "", why
    assert rebuilt.shapes == built.shapes
    assert load_expected_model(config, transformers_version="t-1")[0].cached  # written whole again


def test_a_cache_folder_that_cannot_be_written_only_costs_a_build(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(model_cache.CACHE_ENV, str(blocker))  # a folder cannot be made under a file
    model, why = load_expected_model(write_config(tmp_path / "model"), transformers_version="t-unwritable")
    assert model is not None and model.cached == "", why


def test_a_class_transformers_does_not_ship_is_known_from_the_cache_too(cache, tmp_path):
    config = write_config(tmp_path / "model", {**LLAMA, "architectures": ["MyOwnForCausalLM"]})
    model, why = load_expected_model(config, transformers_version="t-1")
    assert model is None and "MyOwnForCausalLM" in why and "does not ship" in why and config in why
    assert len(entries(cache)) == 1
    elsewhere = write_config(tmp_path / "copy", {**LLAMA, "architectures": ["MyOwnForCausalLM"]})
    model, why_there = load_expected_model(elsewhere, transformers_version="t-1")
    assert model is None and why_there == why.replace(config, elsewhere)
