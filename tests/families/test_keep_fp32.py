"""The float32-kept lists read from transformers' source (families.keep_fp32) are the classes' own."""

from __future__ import annotations

import pytest
import torch

from fsdpfast._testing.family_writer import DEEPSEEK_V3, FamilySpec, family_config
from fsdpfast.families.keep_fp32 import LOOSE, STRICT, kept_lists, kept_patterns, matcher

FAMILIES = ["deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_moe", "mixtral", "llama", "qwen2"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_lists_read_are_the_built_class_lists(model_type):
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(family_config(FamilySpec(model_type, model_type)))
    lists = kept_lists(model_type)
    assert lists is not None
    assert lists[STRICT] == set(model._keep_in_fp32_modules_strict or ())
    assert lists[LOOSE] == set(model._keep_in_fp32_modules or ())


def test_patterns_are_searched_as_transformers_searches_them():
    lists = {STRICT: frozenset({"gate.weight", "e_score_correction_bias"}), LOOSE: frozenset({"norm"})}
    strict = matcher(kept_patterns(lists, "bfloat16"))
    assert strict("model.layers.1.mlp.gate.weight") and strict("model.layers.1.mlp.gate.e_score_correction_bias")
    assert not strict("model.layers.1.mlp.experts.0.gate_proj.weight") and not strict("model.norm.weight")
    assert matcher(kept_patterns(lists, "float16"))("model.norm.weight")
    assert matcher(kept_patterns(lists, "float32")) is None


def test_a_model_type_without_source_has_no_lists():
    assert kept_lists("no_such_model") is None
    assert kept_lists("../etc") is None


def test_a_live_cast_keeps_them_too(tmp_path):
    import transformers
    from helpers import read_merged

    import fsdpfast
    from fsdpfast._testing.family_writer import build_family_model

    spec = FamilySpec("deepseek_v3", "deepseek_v3", DEEPSEEK_V3, seed=7)
    model = build_family_model(spec)
    model.save_pretrained(tmp_path / "fp32")
    cast = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16)
    cast.save_pretrained(tmp_path / "anchor")
    fsdpfast.save_pretrained(model, tmp_path / "live", dtype="bf16")
    merged, anchor = read_merged(tmp_path / "live"), read_merged(tmp_path / "anchor")
    kept = [name for name, value in anchor.items() if value.dtype == torch.float32]
    assert kept and sorted(merged) == sorted(anchor)
    for name, value in anchor.items():
        assert merged[name].dtype == value.dtype and torch.equal(merged[name], value), name
