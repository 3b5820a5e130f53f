"""Megatron-Core torch_dist checkpoints merge bit for bit into Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE /
Mixtral / DeepSeek-V3 / GLM-4.5 / gpt-oss folders.

The fixtures in tests/data/megatron/ were written by real megatron-core (versions.json) with
tests/fixtures/make_megatron_checkpoints.py, run by hand: CI never installs Megatron. Each holds
the run folder (`run/iter_0000007/` beside latest_checkpointed_iteration.txt), the HF config, the
live weights gathered over TP and PP in the writing processes (reference.safetensors) and, for
PP=1, the logits of Megatron's own forward pass.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_bit_exact, read_merged
from refusals import api_refuses, cli_refuses, run_cli
from safetensors.torch import load_file

import fsdpfast

# Minutes of Python-only checks: CI runs them with the CPU torch, not again with the CUDA one (docs/development.md)
pytestmark = pytest.mark.slow

DATA = Path(__file__).parents[1] / "data" / "megatron"
# every fixture with a reference; per_layer: decoder.layers.{i}.* names (hetereogenous_dist_checkpoint);
# the last: virtual pipeline stages (layers 0, 2 on stage 0), embeddings
# tied across stages, QKV bias, bf16 parameters; Qwen3 (q/k layernorms) and Qwen3-MoE (4 experts, SequentialMLP)
# with the experts split over 2 EP ranks or each expert's rows over 2 expert-TP ranks
# (and a 3-layer one whose layer 0 is dense, saved per layer: decoder.layers.{i}.*)
# (and DeepSeek-V3-like: multi-latent attention, layer 0 dense, layer 1 with a shared expert and expert_bias, EP2)
# (and Mixtral-like: no q/k layernorms, 4 routed experts in every layer over EP2; Hub names block_sparse_moe.*)
MOE = ["tp2_ep2_qwen3_moe", "tp2_etp2_qwen3_moe", "tp2_ep2_qwen3_moe_dense0", "tp2_ep2_deepseek_v3", "tp2_ep2_mixtral"]
# Qwen3-MoE over 2 pipeline stages (EP2 in each), and in bfloat16 (norms and nothing else float32)
MOE += ["tp2_pp2_ep2_qwen3_moe", "tp2_ep2_qwen3_moe_bf16"]
# gpt-oss-like (megatron-bridge's gpt-oss settings): biases, attention sinks, experts packed transposed and interleaved
MOE += ["tp1_pp1_gpt_oss"]
# the dense0 Qwen3-MoE and DeepSeek-V3 saved with megatron-core's TransformerEngine spec (test_megatron_te_spec.py)
MOE += ["tp2_ep2_qwen3_moe_dense0_te_spec", "tp2_ep2_deepseek_v3_te_spec"]
# GLM-4.5-like (megatron-bridge's GLM settings): QKV bias, q/k layernorms, RoPE on half of each head, layer 0 dense,
# layer 1 with 4 routed experts over EP2 (sigmoid routing, expert_bias, scaling 2.5) and a shared one, one MTP layer
GLM = "tp2_ep2_glm4_moe"
MOE += [GLM]
# and over TP2 (heads and sinks split) with its experts over EP2, Megatron-LM's gpt-oss args in common.pt
MOE += ["tp2_ep2_gpt_oss"]
MERGED = [
    "tp2_pp1",
    "tp2_pp2",
    "tp1_pp1_qwen2_tied",
    "tp2_pp1_per_layer_bf16",
    "tp2_pp2_vpp2_qwen2_tied_bf16",
    "tp2_pp1_qwen3",
    *MOE,
]
ITERATION = "iter_0000007"
REFUSED = [
    "tp1_pp1_moe",
    "tp1_pp1_moe_shared_expert",
]  # MoE checkpoints without a reference, only refused
MTP = ["tp1_pp1_deepseek_v3_mtp"]  # DeepSeek-V3-like, one MoE layer and one MTP layer (model.layers.1 on the Hub)


def _copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(DATA / name, tmp_path / name))


def test_the_fixtures_are_the_ones_recorded():
    versions = json.loads((DATA / "versions.json").read_text())
    assert versions["megatron-core"] == "0.16.1"
    assert sorted(f["name"] for f in versions["fixtures"]) == sorted([*MERGED, *REFUSED, *MTP])
    for fixture in versions["fixtures"]:
        assert (DATA / fixture["name"] / "run" / ITERATION / "metadata.json").is_file()


@pytest.mark.parametrize("name", MERGED)
def test_merges_bit_exact_to_the_live_weights(tmp_path, name):
    report = fsdpfast.merge(DATA / name / "run", tmp_path / "out", config=DATA / name / "hf")
    assert report.layout == "megatron"
    assert any(ITERATION in note and "latest" in note for note in report.notes), report.notes
    reference = load_file(str(DATA / name / "reference.safetensors"))
    assert_bit_exact(read_merged(str(tmp_path / "out")), reference)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(
        (DATA / name / "hf" / "config.json").read_text()
    )
    assert fsdpfast.verify(str(tmp_path / "out"), against=str(DATA / name / "run")).ok


def test_tp2_pp2_equals_megatron_bridges_export(tmp_path):
    # megatron-bridge 0.3.1 loaded the checkpoint at TP1/PP1 (resharding on load) and exported it;
    # the generating script checked its export equal to reference.safetensors for every fixture
    fsdpfast.merge(DATA / "tp2_pp2" / "run", tmp_path / "out", config=DATA / "tp2_pp2" / "hf")
    assert_bit_exact(read_merged(str(tmp_path / "out")), load_file(str(DATA / "tp2_pp2" / "bridge_export.safetensors")))


@pytest.mark.parametrize("name", MERGED)
def test_transformers_loads_every_weight_and_matches_megatrons_logits(tmp_path, name):

    fsdpfast.merge(DATA / name / "run" / ITERATION, tmp_path / "out", config=DATA / name / "hf")
    model = _loaded_every_weight(tmp_path / "out")
    reference = _packed(load_file(str(DATA / name / "reference.safetensors")))
    for key, value in model.state_dict().items():  # tied lm_head included: it is the embedding
        wanted = reference.get(key, reference["model.embed_tokens.weight"] if key == "lm_head.weight" else None)
        assert torch.equal(value, wanted.to(value.dtype)), key  # as loaded: in config.json's dtype
    megatron = DATA / name / "megatron_logits.safetensors"
    if megatron.exists():  # Megatron's own forward pass: the split into q/k/v and gate/up means what Megatron meant
        probe = load_file(str(megatron))
        with torch.no_grad():
            logits = model(probe["input_ids"]).logits
        torch.testing.assert_close(logits, probe["logits"], rtol=1e-5, atol=1e-5)


def _loaded_every_weight(folder: Path):
    """The merged model as transformers loads it: no weight missing, mismatched or unexpected, but the MTP layers
    (model.layers.{L + k}: transformers builds none, and ignores them by name at the Hub's sizes only)."""
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto", output_loading_info=True)
    config = json.loads((folder / "config.json").read_text())
    mtp = tuple(
        f"model.layers.{config['num_hidden_layers'] + k}." for k in range(config.get("num_nextn_predict_layers") or 0)
    )
    unexpected = [key for key in info["unexpected_keys"] if not key.startswith(mtp)] if mtp else info["unexpected_keys"]
    assert not info["missing_keys"] and not unexpected and not info["mismatched_keys"], info
    return model


def test_megatrons_logits_are_stored_for_every_fixture_megatron_ran_forward():
    # the logits checks above and below skip a fixture without the file: every float32 fixture in one pipeline
    # stage has it (Megatron's forward on CPU ran for each; MLA and gpt-oss included), but the TE-spec twins (their
    # TransformerEngine stand-in holds parameters and computes nothing)
    fixtures = json.loads((DATA / "versions.json").read_text())["fixtures"]
    ran = [
        f["name"]
        for f in fixtures
        if f["name"] in MERGED and f["pp"] == 1 and f["dtype"] == "float32" and not f["te_spec"]
    ]
    assert {"tp2_ep2_deepseek_v3", "tp1_pp1_gpt_oss"} <= set(ran)
    assert [name for name in ran if not (DATA / name / "megatron_logits.safetensors").is_file()] == []


def test_a_gpt_oss_window_one_token_short_computes_other_logits_than_megatron(tmp_path):
    # Megatron's window_size (4, 0) is the token and the 4 before it; transformers' sliding_window counts the token
    # itself: 5 is the same window (the fixture's config, which meets Megatron's logits above), 4 one key fewer
    import transformers

    name = "tp1_pp1_gpt_oss"
    assert json.loads((DATA / name / "hf" / "config.json").read_text())["sliding_window"] == 5
    fsdpfast.merge(DATA / name / "run", tmp_path / "out", config=_config(tmp_path, name, sliding_window=4))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype="auto")
    probe = load_file(str(DATA / name / "megatron_logits.safetensors"))
    with torch.no_grad():
        logits = model(probe["input_ids"]).logits
    gap = (logits - probe["logits"]).abs()
    assert gap[:, :4].max() < 1e-5  # tokens 0-3: both windows reach back to token 0
    assert gap[:, 4:].max() > 1e-3  # token 4 on: transformers leaves out the key 4 before


def _packed(reference: dict) -> dict:
    """Per-expert tensors (the Hub's names) as transformers 5 holds them in memory: gate_up_proj [E, 2F, H]
    ([gate; up] per expert) and down_proj [E, H, F]."""
    out, experts = {}, {}
    for key, tensor in _mixtral_as_held(reference).items():
        prefix, sep, rest = key.partition(".mlp.experts.")
        if not sep or not rest.split(".")[0].isdigit():  # gpt-oss's Hub tensors are packed already
            out[key] = tensor
            continue
        expert, projection = rest.split(".")[:2]
        experts.setdefault(prefix, {}).setdefault(int(expert), {})[projection] = tensor
    for prefix, found in experts.items():
        ordered = [found[e] for e in sorted(found)]
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([p["gate_proj"], p["up_proj"]]) for p in ordered]
        )
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([p["down_proj"] for p in ordered])
    return out


def _mixtral_as_held(reference: dict) -> dict:
    """Mixtral's Hub names (block_sparse_moe.gate, experts.{e}.w1 / w3 / w2) as Qwen3-MoE's, which transformers 5
    holds both families under (mlp.gate, mlp.experts.{e}.gate_proj / up_proj / down_proj before packing)."""
    out = {}
    for key, tensor in reference.items():
        if ".block_sparse_moe." in key:
            key = key.replace(".block_sparse_moe.", ".mlp.")
            for hub, held in ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")):
                key = key.replace(hub, held)
        out[key] = tensor
    return out


def test_the_latest_iteration_is_merged_and_the_others_named(tmp_path):
    run = _copy("tp2_pp1", tmp_path) / "run"
    old = run / "iter_0000003"
    shutil.copytree(run / ITERATION, old)
    (old / ".metadata").write_bytes(b"not read")  # an older iteration is never opened
    plan = fsdpfast.plan_merge(run, config=DATA / "tp2_pp1" / "hf")
    assert plan.model_folder == ITERATION
    assert any("iter_0000003" in note for note in plan.notes), plan.notes


def test_config_found_beside_the_checkpoint(tmp_path):
    # verl's megatron layout: actor/dist_ckpt/ (the torch_dist folder) beside actor/huggingface/
    actor = tmp_path / "actor"
    shutil.copytree(DATA / "tp2_pp2" / "run" / ITERATION, actor / "dist_ckpt")
    shutil.copytree(DATA / "tp2_pp2" / "hf", actor / "huggingface")
    report = fsdpfast.merge(actor / "dist_ckpt", tmp_path / "out")
    assert_bit_exact(read_merged(str(tmp_path / "out")), load_file(str(DATA / "tp2_pp2" / "reference.safetensors")))
    assert (tmp_path / "out" / "config.json").is_file()
    assert any("beside the checkpoint" in note for note in report.notes), report.notes


def test_padded_vocabulary_rows_are_left_out(tmp_path):
    config = json.loads((DATA / "tp2_pp1" / "hf" / "config.json").read_text())
    config["vocab_size"] -= 2  # Megatron pads the vocabulary to a multiple of its TP size and more
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    report = fsdpfast.merge(DATA / "tp2_pp1" / "run", tmp_path / "out", config=tmp_path / "hf")
    merged = read_merged(str(tmp_path / "out"))
    reference = load_file(str(DATA / "tp2_pp1" / "reference.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(merged[name], reference[name][: config["vocab_size"]])
    assert any("padding" in note for note in report.notes), report.notes


def test_dcp_layout_is_not_offered_for_megatron_folders():
    from fsdpfast import readers

    assert readers.detect(str(DATA / "tp2_pp1" / "run" / ITERATION)) == "megatron"


# --- refusals: one line, exit 2, no output folder ------------------------------------------------


def _config(tmp_path: Path, name: str = "tp2_pp1", **changes) -> Path:
    config = json.loads((DATA / name / "hf" / "config.json").read_text())
    config.update(changes)
    folder = tmp_path / "config"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_no_config_is_refused_naming_the_option(tmp_path):
    cli_refuses(DATA / "tp2_pp1" / "run", tmp_path / "out", mentions=("--config",))


@pytest.mark.parametrize(
    "changes, mentions",
    [
        (dict(num_key_value_heads=4), ("linear_qkv.weight", "4 key/value heads")),  # MHA config for a GQA checkpoint
        (dict(num_attention_heads=8, head_dim=8), ("linear_qkv.weight", "8 heads")),
        (dict(intermediate_size=64), ("linear_fc1.weight", "intermediate_size 64")),
        (dict(num_hidden_layers=3), ("num_hidden_layers 3",)),
        (dict(num_attention_heads=3), ("3 attention heads",)),
        (dict(tie_word_embeddings=True), ("output_layer.weight", "tie_word_embeddings")),
        (dict(vocab_size=200), ("vocab_size 200",)),
    ],
)
def test_a_config_that_does_not_fit_is_refused(tmp_path, changes, mentions):
    cli_refuses(DATA / "tp2_pp1" / "run", tmp_path / "out", "--config", _config(tmp_path, **changes), mentions=mentions)


def test_an_unknown_model_type_is_refused(tmp_path):
    config = _config(tmp_path, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    cli_refuses(DATA / "tp2_pp1" / "run", tmp_path / "out", "--config", config, mentions=("gpt2", "llama"))


def test_an_moe_checkpoint_without_qk_norms_is_refused_naming_what_was_found(tmp_path):
    # written by megatron-core with 2 experts and no q/k layernorms (a Mixtral-like model): no MoE family but
    # Qwen3-MoE is written
    config = _config(tmp_path, num_hidden_layers=1)
    cli_refuses(DATA / "tp1_pp1_moe" / "run", tmp_path / "out", mentions=("--config",))
    cli_refuses(
        DATA / "tp1_pp1_moe" / "run",
        tmp_path / "out",
        "--config",
        config,
        mentions=("MoE layers (2 experts", "decoder.layers.mlp.router.weight", "qwen3_moe"),
    )


def test_a_missing_iteration_is_refused(tmp_path):
    run = _copy("tp2_pp1", tmp_path) / "run"
    (run / "latest_checkpointed_iteration.txt").write_text("9")
    line = cli_refuses(run, tmp_path / "out", "--config", DATA / "tp2_pp1" / "hf", mentions=("iter_0000009",))
    assert "latest_checkpointed_iteration.txt" in line


def test_inspect_names_the_layout():
    result = run_cli("inspect", DATA / "tp2_pp2" / "run", "--config", DATA / "tp2_pp2" / "hf")
    assert result.returncode == 0, result.stderr
    assert "megatron" in result.stdout


def test_the_reader_plans_megatrons_own_tensors_and_its_conversion_the_models():
    from fsdpfast import readers

    run, config = DATA / "tp2_pp2_vpp2_qwen2_tied_bf16" / "run", DATA / "tp2_pp2_vpp2_qwen2_tied_bf16" / "hf"
    read = readers.read_plan(str(run), config=str(config))
    shapes = {t.name: t.shape for t in read.tensors}
    layers = json.loads((config / "config.json").read_text())["num_hidden_layers"]
    assert shapes["decoder.layers.self_attention.linear_qkv.weight"][0] == layers  # stacked, as saved
    assert all(not name.startswith("model.") for name in shapes)
    (conversion,) = read.conversions
    converted = conversion.apply(read.but(conversions=()))
    planned = fsdpfast.plan_merge(run, config=config)
    assert [t.name for t in converted.tensors] == [t.name for t in planned.tensors]
    assert converted.sources == read.sources and not planned.conversions  # the pipeline applied it, once
    # every element once: no padding rows in this fixture, so the model holds what the checkpoint does
    assert sum(t.numel for t in converted.tensors) == sum(t.numel for t in read.tensors)


def test_forcing_the_dcp_layout_names_the_one_found(tmp_path):
    line = cli_refuses(
        DATA / "tp2_pp1" / "run" / ITERATION, tmp_path / "out", "--layout", "dcp", mentions=("megatron",)
    )
    assert "no files of layout dcp" in line


# --- common.pt: the training args a run saves beside the model ----------------------------------


def test_config_checked_against_the_training_args(tmp_path):
    plan = fsdpfast.plan_merge(DATA / "tp2_pp2" / "run", config=DATA / "tp2_pp2" / "hf")
    assert any("training args in common.pt" in note for note in plan.notes), plan.notes


def test_a_config_whose_shapes_fit_but_whose_heads_differ_is_refused(tmp_path):
    # 8 heads of 8 in 4 groups give every tensor the shape 4 heads of 16 in 2 groups give; only the
    # run's args tell the q/k/v split apart
    config = _config(tmp_path, "tp2_pp2", num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    cli_refuses(
        DATA / "tp2_pp2" / "run", tmp_path / "out", "--config", config, mentions=("common.pt", "num_attention_heads 8")
    )


def test_a_common_pt_that_pickles_other_classes_is_not_read(tmp_path):
    import fractions

    run = _copy("tp2_pp2", tmp_path) / "run"
    torch.save({"args": fractions.Fraction(1, 3)}, run / ITERATION / "common.pt")
    report = fsdpfast.merge(run, tmp_path / "out", config=DATA / "tp2_pp2" / "hf")
    assert any("common.pt not read" in note for note in report.notes), report.notes
    assert_bit_exact(read_merged(str(tmp_path / "out")), load_file(str(DATA / "tp2_pp2" / "reference.safetensors")))


# --- no config.json: the training args in common.pt give it ---------------------------------------

# fixtures whose common.pt holds Megatron-LM's args (a Llama and a Qwen2 with tied embeddings, bf16)
WITH_ARGS = ["tp2_pp2", "tp2_pp2_vpp2_qwen2_tied_bf16", "tp2_pp1_qwen3"]
# what a Llama / Qwen2 computes with: the built config.json must give what the fixture's HF config gives
_MODEL_KEYS = (
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "hidden_act", "rms_norm_eps", "rope_parameters",
    "tie_word_embeddings", "dtype", "max_position_embeddings",
)  # fmt: skip


@pytest.mark.parametrize("name", WITH_ARGS)
def test_without_config_the_training_args_give_config_json(tmp_path, name):
    import transformers

    report = fsdpfast.merge(DATA / name / "run", tmp_path / "out")  # no hf/ in or beside the run folder
    assert any("built from the training args in common.pt" in note and "tokenizer" in note for note in report.notes)
    assert report.copied == ["config.json"]
    assert_bit_exact(read_merged(str(tmp_path / "out")), load_file(str(DATA / name / "reference.safetensors")))
    built = json.loads((tmp_path / "out" / "config.json").read_text())
    given = json.loads((DATA / name / "hf" / "config.json").read_text())
    assert {k: built.get(k) for k in _MODEL_KEYS} == {k: given.get(k) for k in _MODEL_KEYS}
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "out"), dtype="auto", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    fsdpfast.merge(DATA / name / "run", tmp_path / "with_config", config=DATA / name / "hf")
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "with_config"), dtype="auto")
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 7], [79, 32, 38, 46, 26, 43, 38, 1]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert fsdpfast.verify(str(tmp_path / "out"), against=str(DATA / name / "run")).ok


def test_tp2_pp2_without_config_equals_megatron_bridges_export(tmp_path):
    fsdpfast.merge(DATA / "tp2_pp2" / "run", tmp_path / "out")
    assert_bit_exact(read_merged(str(tmp_path / "out")), load_file(str(DATA / "tp2_pp2" / "bridge_export.safetensors")))


def _with_args(tmp_path: Path, drop=(), name="tp2_pp2", **changes) -> Path:
    """The run with its common.pt's args changed, saved as Megatron saves common.pt (torch.save)."""
    import argparse

    from fsdpfast.readers.megatron_args import read_training_args

    run = _copy(name, tmp_path) / "run"
    args, _ = read_training_args(str(run / ITERATION))
    recorded = {k: v for k, v in args.recorded.items() if k not in drop}
    common = {"args": argparse.Namespace(**{**recorded, **changes}), "checkpoint_version": 3.0, "iteration": 7}
    torch.save(common, run / ITERATION / "common.pt")
    return run


@pytest.mark.parametrize(
    "drop, changes, mentions",
    [
        (("norm_epsilon",), {}, ("norm_epsilon", "--config")),
        (("rotary_base", "swiglu"), {}, ("rotary_base", "swiglu", "--config")),
        ((), dict(window_size=(4095, 0)), ("window_size", "--config")),
        ((), dict(use_rope_scaling=True), ("use_rope_scaling", "--config")),
    ],
)
def test_args_that_cannot_build_the_config_are_refused(tmp_path, drop, changes, mentions):
    cli_refuses(_with_args(tmp_path, drop, **changes), tmp_path / "out", mentions=mentions)


@pytest.mark.parametrize(
    "changes, mentions",
    [
        (dict(rotary_interleaved=True), ("rotary_interleaved", "interleaved")),  # no Hugging Face Llama computes it
        (dict(rotary_base=500000), ("rotary_base 500000", "rope_theta 10000")),
        (dict(norm_epsilon=1e-6), ("norm_epsilon", "rms_norm_eps")),
    ],
)
def test_args_that_contradict_the_config_are_refused(tmp_path, changes, mentions):
    run = _with_args(tmp_path, **changes)
    cli_refuses(run, tmp_path / "out", "--config", DATA / "tp2_pp2" / "hf", mentions=mentions)


@pytest.mark.parametrize(
    "changes, mentions",
    [
        (dict(quick_geglu=False), ("quick_geglu False", "quick GeGLU", "gpt_oss")),
        (dict(glu_linear_offset=0.0), ("glu_linear_offset 0.0", "gpt_oss")),
        (dict(rotary_interleaved=True), ("rotary_interleaved True", "gpt_oss")),
    ],
)
def test_gpt_oss_args_that_gpt_oss_does_not_compute_are_refused(tmp_path, changes, mentions):
    # its MLP is quick GeGLU (swiglu False), clamped, with 1 added to the linear half: what transformers' gpt_oss computes
    run = _with_args(tmp_path, name="tp2_ep2_gpt_oss", **changes)
    cli_refuses(run, tmp_path / "out", "--config", DATA / "tp2_ep2_gpt_oss" / "hf", mentions=mentions)


def test_gpt_oss_args_that_agree_with_the_config_merge_bit_exact(tmp_path):
    name = "tp2_ep2_gpt_oss"
    report = fsdpfast.merge(DATA / name / "run", tmp_path / "out", config=DATA / name / "hf")
    assert any("agree with the training args" in note for note in report.notes), report.notes


# --- the args against the tensors: refused whether a config.json is given or built from them -------

# (fixture, the args changed, what the line names): each contradicts what the fixture's tensors show
AGAINST_THE_TENSORS = [
    ("tp2_pp2", dict(num_layers=3), ("num_layers 3", "4 layers")),
    ("tp2_pp2", dict(hidden_size=96), ("hidden_size 96", "word_embeddings.weight has 64 columns")),
    ("tp2_pp2", dict(num_query_groups=4), ("num_query_groups 4", "linear_qkv.weight has 128 rows")),  # MHA args
    ("tp2_pp2", dict(kv_channels=8), ("kv_channels 8", "linear_qkv.weight has 128 rows")),
    ("tp2_pp2", dict(ffn_hidden_size=64), ("ffn_hidden_size 64", "linear_fc1.weight has 256 rows")),
    ("tp2_pp2", dict(padded_vocab_size=128), ("padded_vocab_size 128", "word_embeddings.weight has 102 rows")),
    ("tp2_pp2", dict(untie_embeddings_and_output_weights=False), ("untie_embeddings_and_output_weights False",)),
    ("tp2_pp2", dict(add_qkv_bias=True), ("add_qkv_bias True", "no linear_qkv.bias")),
    ("tp2_pp2", dict(add_bias_linear=True), ("add_bias_linear True", "linear_proj")),
    ("tp2_pp2", dict(num_experts=8), ("num_experts 8", "no expert tensors")),
    ("tp2_pp2", dict(qk_layernorm=True), ("qk_layernorm True", "no self_attention.q_layernorm")),
    ("tp2_pp1_qwen3", dict(qk_layernorm=False), ("qk_layernorm False", "a self_attention.q_layernorm")),
    ("tp2_ep2_qwen3_moe", dict(num_experts=8), ("num_experts 8", "router.weight has 4 rows")),
    ("tp2_ep2_qwen3_moe", dict(num_experts=None), ("num_experts None", "MoE layers of 4 experts")),
    (
        "tp2_pp2_vpp2_qwen2_tied_bf16",
        dict(untie_embeddings_and_output_weights=True),
        ("untie_embeddings_and_output_weights True", "no output_layer.weight"),
    ),
    ("tp2_pp2_vpp2_qwen2_tied_bf16", dict(add_qkv_bias=False), ("add_qkv_bias False", "a linear_qkv.bias")),
    ("tp2_ep2_gpt_oss", dict(add_bias_linear=False), ("add_bias_linear False", "gpt-oss's biases on linear_proj")),
]


@pytest.mark.parametrize("with_config", [False, True], ids=["built", "given"])
@pytest.mark.parametrize("name, changes, mentions", AGAINST_THE_TENSORS)
def test_args_that_contradict_the_tensors_are_refused(tmp_path, name, changes, mentions, with_config):
    run = _with_args(tmp_path, name=name, **changes)
    config = ("--config", DATA / name / "hf") if with_config else ()
    line = cli_refuses(run, tmp_path / "out", *config, mentions=(*mentions, "common.pt is not these tensors' run"))
    assert "--config" not in line  # a config cannot settle it: the checkpoint's own files disagree


def test_the_python_face_refuses_args_that_contradict_the_tensors(tmp_path):
    run = _with_args(tmp_path, num_layers=3)
    api_refuses(run, tmp_path / "out", mentions=("num_layers 3", "4 layers"))
    api_refuses(run, tmp_path / "out", mentions=("num_layers 3", "4 layers"), config=DATA / "tp2_pp2" / "hf")


@pytest.mark.parametrize("with_config", [False, True], ids=["built", "given"])
def test_args_that_change_no_weight_still_merge_bit_exact(tmp_path, with_config):
    run = _with_args(tmp_path, lr=3e-4, train_iters=1000, seed=7, save_interval=None)
    fsdpfast.merge(run, tmp_path / "out", config=DATA / "tp2_pp2" / "hf" if with_config else None)
    assert_bit_exact(read_merged(str(tmp_path / "out")), load_file(str(DATA / "tp2_pp2" / "reference.safetensors")))


# --- the args against config.json: what the shapes cannot tell -----------------------------------

_LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
_LLAMA3_CONFIG = dict(
    rope_scaling=None, rope_parameters={**_LLAMA3, "original_max_position_embeddings": 8192, "rope_theta": 10000.0}
)


def _config_beside(tmp_path: Path, run: Path, name: str = "tp2_pp2", **changes) -> Path:
    """A copy of the fixture's config.json, changed, as huggingface/ in the iteration folder (found without --config)."""
    hf = _config(tmp_path, name, **changes)
    shutil.copytree(hf, run / ITERATION / "huggingface")
    return hf


def _mistral_window(sliding_window: int) -> dict:
    return dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=sliding_window)


# (fixture, the args changed, config.json changed, what the line names)
AGAINST_THE_CONFIG = [
    ("tp2_pp2", {}, dict(rms_norm_eps=1e-6), ("norm_epsilon 1e-05", "rms_norm_eps 1e-06")),
    (
        "tp2_pp2",
        {},
        dict(rope_theta=500000.0, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        ("rotary_base 10000", "rope_theta 500000.0"),
    ),
    ("tp2_pp2", {}, dict(hidden_act="gelu"), ("swiglu True", "hidden_act 'gelu'")),
    ("tp2_pp2", {}, _LLAMA3_CONFIG, ("use_rope_scaling False", "rope_type 'llama3'")),
    ("tp2_pp2", dict(use_rope_scaling=True), {}, ("use_rope_scaling True", "rope_type 'default'")),
    (
        "tp2_pp2",
        dict(use_rope_scaling=True, rope_scaling_factor=16.0),
        _LLAMA3_CONFIG,
        ("rope_scaling_factor 16.0", "factor 8.0"),
    ),
    (
        "tp2_pp2",
        dict(rotary_seq_len_interpolation_factor=2.0),
        {},
        ("rotary_seq_len_interpolation_factor 2.0", "'linear'"),
    ),
    ("tp2_pp2", dict(window_size=(31, 0)), {}, ("window_size (31, 0)", "no sliding window")),
    # Megatron's (31, 0) is the token and the 31 before it: transformers' sliding_window 32 (the token counted);
    # 31 is megatron-bridge's mapping (merged with a note); another width is another model
    (
        "tp2_pp2",
        dict(window_size=(31, 0)),
        _mistral_window(30),
        ("window_size (31, 0)", "the 31 before it", "sliding_window 30", "sliding_window 32"),
    ),
    ("tp2_pp2", dict(window_size=(31, 2)), _mistral_window(32), ("window_size (31, 2)", "2 after it", "causal")),
    (
        "tp2_pp2",
        dict(window_size=(31, 0), window_attn_skip_freq=2),
        dict(_mistral_window(32), layer_types=["sliding_attention"] * 4),
        ("window_attn_skip_freq 2", "on layers [0, 2]", "sliding_attention on layers [0, 1, 2, 3]"),
    ),
    # gpt-oss's args (common.pt as Megatron-LM writes it): its window, the layers it is on, the clamp
    ("tp2_ep2_gpt_oss", {}, dict(sliding_window=6), ("window_size (4, 0)", "sliding_window 6", "sliding_window 5")),
    (
        "tp2_ep2_gpt_oss",
        {},
        dict(layer_types=["full_attention", "sliding_attention"]),
        ("window_attn_skip_freq 2", "on layers [0]", "sliding_attention on layers [1]"),
    ),
    ("tp2_ep2_gpt_oss", {}, dict(swiglu_limit=10.0), ("activation_func_clamp_value 7.0", "swiglu_limit 10.0")),
    (
        "tp2_ep2_gpt_oss",
        dict(activation_func_clamp_value=None),
        {},
        ("activation_func_clamp_value None", "swiglu_limit 7.0"),
    ),
    # Megatron-LM pads to a multiple of 3 x TP 2 = 6: 102 rows hold a vocabulary of 97..102, not 96
    ("tp2_pp2", dict(make_vocab_size_divisible_by=3), dict(vocab_size=96), ("vocab_size 96", "fewer than 6 rows")),
    ("tp2_pp2", dict(num_attention_heads=8, num_query_groups=4, kv_channels=8), {}, ("num_attention_heads 8",)),
]


@pytest.mark.parametrize("found", [False, True], ids=["--config", "beside"])
@pytest.mark.parametrize("name, args, changes, mentions", AGAINST_THE_CONFIG)
def test_args_that_contradict_the_config_json_are_refused(tmp_path, name, args, changes, mentions, found):
    run = _with_args(tmp_path, name=name, **args)
    if found:
        _config_beside(tmp_path, run, name, **changes)
        line = cli_refuses(run, tmp_path / "out", mentions=mentions)
    else:
        line = cli_refuses(run, tmp_path / "out", "--config", _config(tmp_path, name, **changes), mentions=mentions)
    assert "common.pt" in line and "--config" in line  # both sides named, and the option that settles it


@pytest.mark.parametrize(
    "args, changes",
    [
        (dict(make_vocab_size_divisible_by=3), dict(vocab_size=97)),  # the fewest rows 102 can be padding of
        (dict(make_vocab_size_divisible_by=3), dict(vocab_size=100)),
        (dict(use_rope_scaling=True, rope_scaling_factor=8.0), _LLAMA3_CONFIG),
        (dict(rotary_seq_len_interpolation_factor=2.0), dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
        (dict(window_size=(31, 0)), _mistral_window(32)),
        (  # the window on layers 0 and 2 (every 2nd layer, counted from 1, without it)
            dict(window_size=(31, 0), window_attn_skip_freq=2),
            dict(_mistral_window(32), layer_types=["sliding_attention", "full_attention"] * 2),
        ),
        ({}, dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
        ({}, dict(hidden_act="swish")),
    ],
)
def test_args_and_a_config_that_agree_merge_bit_exact(tmp_path, args, changes):
    config = _config(tmp_path, "tp2_pp2", **changes)
    report = fsdpfast.merge(_with_args(tmp_path, **args), tmp_path / "out", config=config)
    merged, reference = read_merged(str(tmp_path / "out")), load_file(str(DATA / "tp2_pp2" / "reference.safetensors"))
    vocab = changes.get("vocab_size", 102)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # padding rows left out
        reference[name] = reference[name][:vocab]
    assert_bit_exact(merged, reference)
    assert any("agree with the training args" in note for note in report.notes), report.notes


@pytest.mark.parametrize("name, args, window", [("tp2_pp2", dict(window_size=(31, 0)), 31), ("tp2_ep2_gpt_oss", {}, 4)])
def test_the_window_megatron_bridge_maps_merges_with_a_note(tmp_path, name, args, window):
    # megatron-bridge maps the Hub's sliding_window W to window_size (W, 0) and exports it back as W: a run
    # converted that way merges with the Hub's config, the one key Megatron's attention saw more said
    changes = _mistral_window(window) if name == "tp2_pp2" else dict(sliding_window=window)
    run = _with_args(tmp_path, name=name, **args)
    report = fsdpfast.merge(run, tmp_path / "out", config=_config(tmp_path, name, **changes))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] == window
    note = f"sliding_window {window} kept: the run's window_size ({window}, 0) attended to {window + 1} keys"
    assert any(note in line for line in report.notes), report.notes


def test_a_longer_max_position_embeddings_merges_with_a_note(tmp_path):
    config = _config(tmp_path, "tp2_pp2", max_position_embeddings=4096)  # a context the serving config allows
    report = fsdpfast.merge(DATA / "tp2_pp2" / "run", tmp_path / "out", config=config)
    assert_bit_exact(read_merged(str(tmp_path / "out")), load_file(str(DATA / "tp2_pp2" / "reference.safetensors")))
    assert any("max_position_embeddings 4096" in note and "64" in note for note in report.notes), report.notes


# --- config.json against the tensors: what a config can get wrong that the shapes do not show -------


@pytest.mark.parametrize(
    "name, changes, mentions",
    [
        ("tp2_pp2", dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]), ("no linear_qkv.bias", "qwen2")),
        ("tp2_pp2", dict(attention_bias=True), ("attention_bias True",)),
        ("tp2_pp2_vpp2_qwen2_tied_bf16", dict(model_type="llama"), ("holds linear_qkv.bias", "'llama'")),
        ("tp2_pp2_vpp2_qwen2_tied_bf16", dict(model_type="mistral"), ("holds linear_qkv.bias", "'mistral'")),
    ],
)
def test_a_config_of_another_family_is_refused(tmp_path, name, changes, mentions):
    config = _config(tmp_path, name, **changes)
    cli_refuses(DATA / name / "run", tmp_path / "out", "--config", config, mentions=(*mentions, "--config"))


@pytest.mark.parametrize("name", ["tp2_pp2", "tp2_pp2_vpp2_qwen2_tied_bf16"])
def test_a_config_without_tie_word_embeddings_is_read_as_untied(tmp_path, name):
    # transformers' default for Llama, Mistral and Qwen2: a tied checkpoint would load with lm_head missing
    config = _config(tmp_path, name)
    values = json.loads((config / "config.json").read_text())
    del values["tie_word_embeddings"]
    (config / "config.json").write_text(json.dumps(values))
    if name == "tp2_pp2":  # untied: the look-alike merges
        fsdpfast.merge(DATA / name / "run", tmp_path / "out", config=config)
        assert_bit_exact(read_merged(str(tmp_path / "out")), load_file(str(DATA / name / "reference.safetensors")))
    else:
        cli_refuses(DATA / name / "run", tmp_path / "out", "--config", config, mentions=("no tie_word_embeddings",))


# --- Qwen3 and Qwen3-MoE -----------------------------------------------------------------------------


def test_qwen3_norms_are_q_norm_and_k_norm_and_the_experts_one_tensor_each(tmp_path):
    merged = {}
    for name in ("tp2_pp1_qwen3", "tp2_ep2_qwen3_moe"):
        fsdpfast.merge(DATA / name / "run", tmp_path / name, config=DATA / name / "hf")
        merged[name] = read_merged(str(tmp_path / name))
    assert merged["tp2_pp1_qwen3"]["model.layers.1.self_attn.q_norm.weight"].shape == (16,)  # per head
    moe = merged["tp2_ep2_qwen3_moe"]
    assert moe["model.layers.0.mlp.gate.weight"].shape == (4, 64)
    assert sorted(k for k in moe if k.startswith("model.layers.1.mlp.experts.3.")) == [
        f"model.layers.1.mlp.experts.3.{p}.weight" for p in ("down_proj", "gate_proj", "up_proj")
    ]


@pytest.mark.parametrize("name", MOE)
def test_qwen3_moe_packed_experts_are_the_reference_stacked(tmp_path, name):

    fsdpfast.merge(DATA / name / "run", tmp_path / "out", config=DATA / name / "hf", expert_layout="packed")
    merged = read_merged(str(tmp_path / "out"))
    assert_bit_exact(merged, _packed(load_file(str(DATA / name / "reference.safetensors"))))
    model = _loaded_every_weight(tmp_path / "out")
    megatron = DATA / name / "megatron_logits.safetensors"
    if megatron.exists():  # every float32 fixture in one stage (test_megatrons_logits_are_stored_for_...)
        probe = load_file(str(megatron))
        with torch.no_grad():
            torch.testing.assert_close(model(probe["input_ids"]).logits, probe["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name, changes, mentions",
    [
        ("tp2_pp1_qwen3", dict(model_type="llama", architectures=["LlamaForCausalLM"]), ("q_layernorm", "qwen3")),
        ("tp2_pp1", dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"]), ("no self_attention.q_layernorm",)),
        ("tp1_pp1_qwen2_tied", dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"]), ("linear_qkv.bias",)),
        ("tp2_pp1_qwen3", dict(attention_bias=True), ("attention_bias True",)),
        ("tp2_ep2_qwen3_moe", dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"]), ("MoE layers (4 experts",)),
        ("tp2_pp1_qwen3", dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=32), ("no MoE layers",)),
    ],
)
def test_a_config_of_another_qwen_family_is_refused(tmp_path, name, changes, mentions):
    config = _config(tmp_path, name, **changes)
    cli_refuses(DATA / name / "run", tmp_path / "out", "--config", config, mentions=(*mentions, "--config"))


@pytest.mark.parametrize(
    "changes, mentions",
    [
        (dict(num_experts=8), ("router.weight", "num_experts 8")),
        (dict(moe_intermediate_size=16), ("experts.linear_fc1.weight", "moe_intermediate_size 16")),
        (dict(mlp_only_layers=[0]), ("router.weight holds layers [0, 1]", "gives layers [1]", "mlp_only_layers")),
        (dict(decoder_sparse_step=2), ("router.weight holds layers [0, 1]", "gives layers [1]", "decoder_sparse_step")),
    ],
)
def test_qwen3_moe_expert_counts_and_sizes_that_disagree_with_the_config_are_refused(tmp_path, changes, mentions):
    config = _config(tmp_path, "tp2_etp2_qwen3_moe", **changes)
    run = DATA / "tp2_etp2_qwen3_moe" / "run"
    cli_refuses(run, tmp_path / "out", "--config", config, mentions=(*mentions, "not this checkpoint's model"))


@pytest.mark.parametrize(
    "changes, mentions",
    [
        (dict(mlp_only_layers=[]), ("decoder.layers.mlp.linear_fc1.weight holds layers [0]", "no layers")),
        (dict(mlp_only_layers=[0, 1]), ("linear_fc1.weight holds layers [0]", "gives layers [0, 1]")),
        (dict(intermediate_size=64), ("decoder.layers.0.mlp.linear_fc1.weight", "intermediate_size 64")),
    ],
)
def test_qwen3_moe_dense_layers_that_disagree_with_the_config_are_refused(tmp_path, changes, mentions):
    config = _config(tmp_path, "tp2_ep2_qwen3_moe_dense0", **changes)
    run = DATA / "tp2_ep2_qwen3_moe_dense0" / "run"
    cli_refuses(run, tmp_path / "out", "--config", config, mentions=(*mentions, "not this checkpoint's model"))


def test_a_qwen3_config_without_head_dim_means_transformers_default(tmp_path):
    # Qwen3Config's head_dim defaults to 128, not hidden / heads: the fixture's 16 is then refused
    config = _config(tmp_path, "tp2_pp1_qwen3", head_dim=None)
    cli_refuses(DATA / "tp2_pp1_qwen3" / "run", tmp_path / "out", "--config", config, mentions=("head dim 128",))


def test_without_config_an_moe_checkpoint_is_refused_naming_the_option(tmp_path):
    cli_refuses(DATA / "tp2_ep2_qwen3_moe" / "run", tmp_path / "out", mentions=("MoE layers (4 experts)", "--config"))
    # the args could not tell Mixtral from a Qwen3-MoE without q/k norms either
    cli_refuses(DATA / "tp2_ep2_mixtral" / "run", tmp_path / "out2", mentions=("MoE layers (4 experts)", "--config"))


# --- gpt-oss: biases, attention sinks, experts packed transposed with gate/up interleaved ----------------------


def test_gpt_oss_experts_are_packed_transposed_and_interleaved(tmp_path):
    # written by megatron-core 0.16.1 with megatron-bridge's gpt-oss settings (expert, router and attention biases,
    # learnable softmax_offset, clamped GLU, sliding windows); the reference is the live weights mapped by
    # megatron-bridge's gpt-oss rule in the fixture script (torch ops): checked here against the checkpoint itself
    name = "tp1_pp1_gpt_oss"
    fsdpfast.merge(DATA / name / "run", tmp_path / "out", config=DATA / name / "hf")
    merged = read_merged(str(tmp_path / "out"))
    own = _as_saved(DATA / name / "run" / ITERATION, tmp_path / "saved.pt")  # Megatron's own tensors
    fc1 = own["decoder.layers.mlp.experts.experts.linear_fc1.weight"][1]  # layer 1: (E, 2F, H), [gate; up]
    gate_up = merged["model.layers.1.mlp.experts.gate_up_proj"]  # (E, H, 2F): gate column 2j, up 2j+1
    assert gate_up.shape == (4, 64, 64) and fc1.shape == (4, 64, 64)
    assert torch.equal(gate_up[:, :, 0::2], fc1[:, :32].transpose(1, 2))
    assert torch.equal(gate_up[:, :, 1::2], fc1[:, 32:].transpose(1, 2))
    bias = own["decoder.layers.mlp.experts.experts.linear_fc1.bias"][1]
    assert torch.equal(merged["model.layers.1.mlp.experts.gate_up_proj_bias"][:, 1::2], bias[:, 32:])
    fc2 = own["decoder.layers.mlp.experts.experts.linear_fc2.weight"][0]  # (E, H, F)
    assert torch.equal(merged["model.layers.0.mlp.experts.down_proj"], fc2.transpose(1, 2))
    sinks = own["decoder.layers.self_attention.core_attention.softmax_offset"][0]
    assert torch.equal(merged["model.layers.0.self_attn.sinks"], sinks)


def _as_saved(folder: Path, file: Path) -> dict:
    """A torch_dist folder's tensors as torch's own DCP reader loads them (not ours)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder), str(file))
    return torch.load(str(file), weights_only=True)


@pytest.mark.parametrize(
    "changes, mentions",
    [
        (dict(num_local_experts=8), ("router.weight", "num_local_experts 8")),
        (dict(intermediate_size=16), ("experts.linear_fc1.weight", "intermediate_size 16")),
        (dict(attention_bias=False), ("attention_bias False",)),
        (dict(model_type="mixtral", architectures=["MixtralForCausalLM"]), ("attention sinks", "gpt_oss")),
    ],
)
def test_a_gpt_oss_config_that_disagrees_with_the_tensors_is_refused(tmp_path, changes, mentions):
    config = _config(tmp_path, "tp1_pp1_gpt_oss", **changes)
    run = DATA / "tp1_pp1_gpt_oss" / "run"
    cli_refuses(run, tmp_path / "out", "--config", config, mentions=(*mentions, "not this checkpoint's model"))


def test_gpt_oss_config_on_a_mixtral_checkpoint_and_no_config_are_refused(tmp_path):
    config = _config(tmp_path, "tp1_pp1_gpt_oss", num_hidden_layers=2)
    run = DATA / "tp2_ep2_mixtral" / "run"
    cli_refuses(run, tmp_path / "out", "--config", config, mentions=("no attention sinks", "not gpt_oss"))
    cli_refuses(
        DATA / "tp1_pp1_gpt_oss" / "run", tmp_path / "out2", mentions=("--config",)
    )  # no args either: refused first


# --- Mixtral ------------------------------------------------------------------------------------------


def test_mixtral_experts_have_the_hub_names(tmp_path):
    # written by megatron-core 0.16.1 (no q/k layernorms, SequentialMLP experts over EP2); bridge 0.3.1 has no
    # Mixtral bridge: the reference is the live weights, fc1's [gate; up] rows as w1 / w3, fc2 as w2
    fsdpfast.merge(DATA / "tp2_ep2_mixtral" / "run", tmp_path / "out", config=DATA / "tp2_ep2_mixtral" / "hf")
    merged = read_merged(str(tmp_path / "out"))
    assert merged["model.layers.1.block_sparse_moe.gate.weight"].shape == (4, 64)
    assert sorted(k for k in merged if k.startswith("model.layers.0.block_sparse_moe.experts.2.")) == [
        f"model.layers.0.block_sparse_moe.experts.2.{w}.weight" for w in ("w1", "w2", "w3")
    ]
    assert not any(".mlp." in k for k in merged)


@pytest.mark.parametrize(
    "changes, mentions",
    [
        (dict(num_local_experts=8), ("router.weight", "num_local_experts 8")),
        (dict(intermediate_size=16), ("experts.linear_fc1.weight", "intermediate_size 16")),
        (dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=32), ("no self_attention.q_layernorm",)),
        (dict(model_type="llama", architectures=["LlamaForCausalLM"]), ("MoE layers (4 experts", "mixtral")),
    ],
)
def test_a_mixtral_config_that_disagrees_with_the_tensors_is_refused(tmp_path, changes, mentions):
    config = _config(tmp_path, "tp2_ep2_mixtral", **changes)
    run = DATA / "tp2_ep2_mixtral" / "run"
    cli_refuses(run, tmp_path / "out", "--config", config, mentions=(*mentions, "not this checkpoint's model"))


def test_shared_experts_and_an_expert_bias_without_mla_are_refused_naming_them(tmp_path):
    # written by megatron-core (Qwen3-MoE-like with a shared expert, sigmoid routing with expert_bias): Qwen3-MoE
    # has neither; they are DeepSeek-V3's
    config = _config(tmp_path, "tp2_ep2_qwen3_moe", num_hidden_layers=1, num_experts=2)
    run = DATA / "tp1_pp1_moe_shared_expert" / "run"
    cli_refuses(run, tmp_path / "out", "--config", config, mentions=("shared experts", "deepseek_v3", "--config"))


# --- DeepSeek-V3: multi-latent attention, shared experts, the router's correction bias -------------------


def test_deepseek_v3_names_are_megatron_bridges_one_to_one(tmp_path):
    name = "tp2_ep2_deepseek_v3"
    fsdpfast.merge(DATA / name / "run", tmp_path / "out", config=DATA / name / "hf")
    merged = read_merged(str(tmp_path / "out"))
    layer = "model.layers.1."
    shapes = {
        "self_attn.q_a_proj.weight": (32, 64),  # q_lora_rank, hidden: TP-split rows in the checkpoint
        "self_attn.q_a_layernorm.weight": (32,),
        "self_attn.q_b_proj.weight": (4 * (16 + 8), 32),
        "self_attn.kv_a_proj_with_mqa.weight": (32 + 8, 64),
        "self_attn.kv_a_layernorm.weight": (32,),
        "self_attn.kv_b_proj.weight": (4 * (16 + 16), 32),
        "mlp.gate.e_score_correction_bias": (4,),
        "mlp.shared_experts.gate_proj.weight": (32, 64),
        "mlp.shared_experts.down_proj.weight": (64, 32),
    }
    assert {key: tuple(merged[layer + key].shape) for key in shapes} == shapes
    assert "model.layers.0.mlp.gate_proj.weight" in merged and "model.layers.0.mlp.gate.weight" not in merged


@pytest.mark.parametrize(
    "name, changes, mentions",
    [
        (
            "tp2_ep2_deepseek_v3",
            dict(model_type="qwen3_moe", num_experts=4),
            ("holds multi-latent attention", "--config"),
        ),
        (
            "tp2_ep2_qwen3_moe",
            dict(
                model_type="deepseek_v3",
                n_routed_experts=4,
                v_head_dim=16,
                kv_lora_rank=32,
                q_lora_rank=32,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
            ),
            ("no multi-latent attention", "--config"),
        ),
        ("tp2_ep2_deepseek_v3", dict(n_shared_experts=0), ("holds shared experts", "has none")),
        ("tp2_ep2_deepseek_v3", dict(first_k_dense_replace=0), ("linear_fc1.weight holds layers [0]", "no layers")),
        ("tp2_ep2_deepseek_v3", dict(kv_lora_rank=16), ("linear_kv_down_proj.weight", "kv_lora_rank 16")),
        ("tp2_ep2_deepseek_v3", dict(qk_rope_head_dim=4), ("linear_q_up_proj.weight", "qk_rope_head_dim 4")),
        ("tp2_ep2_deepseek_v3", dict(n_routed_experts=8), ("router.weight", "n_routed_experts 8")),
    ],
)
def test_a_deepseek_v3_config_that_disagrees_with_the_tensors_is_refused(tmp_path, name, changes, mentions):
    config = _config(tmp_path, name, **changes)
    cli_refuses(
        DATA / name / "run", tmp_path / "out", "--config", config, mentions=(*mentions, "this checkpoint's model")
    )


def test_an_mla_norm_epsilon_other_than_transformers_latent_norms_one_is_noted(tmp_path):
    # transformers' DeepseekV3 hard-codes eps 1e-6 in q_a_layernorm / kv_a_layernorm (the fixture's 1e-6 meets Megatron's
    # logits to 1e-5; with 1e-5 in Megatron and the config they were 3.2e-5 apart, 7.5e-7 with those two norms at 1e-5)
    name = "tp2_ep2_deepseek_v3"
    report = fsdpfast.merge(DATA / name / "run", tmp_path / "out", config=DATA / name / "hf")
    assert not any("q_a_layernorm" in note for note in report.notes), report.notes
    config = _config(tmp_path, name, rms_norm_eps=1e-5)
    report = fsdpfast.merge(DATA / name / "run", tmp_path / "out2", config=config)
    assert any("rms_norm_eps 1e-05" in note and "kv_a_layernorm" in note for note in report.notes), report.notes


def test_without_config_an_mla_checkpoint_is_refused_naming_the_option(tmp_path):
    cli_refuses(DATA / "tp2_ep2_deepseek_v3" / "run", tmp_path / "out", mentions=("--config",))


@pytest.mark.parametrize("name", MTP)
def test_multi_token_prediction_layers_merge_bit_exact_as_the_hubs_next_layers(tmp_path, name):
    # MTP block k is written as model.layers.{L+k}: enorm, hnorm, eh_proj, shared_head.norm (its final_layernorm)
    # and its transformer layer's tensors, as the Hub's DeepSeek-V3 and megatron-bridge's map name them
    report = fsdpfast.merge(DATA / name / "run", tmp_path / "out", config=DATA / name / "hf")
    assert any("1 MTP layer" in note for note in report.notes), report.notes
    merged, reference = read_merged(str(tmp_path / "out")), load_file(str(DATA / name / "reference.safetensors"))
    assert {"model.layers.1.eh_proj.weight", "model.layers.1.shared_head.norm.weight"} <= set(merged)
    assert "model.layers.1.mlp.experts.1.down_proj.weight" in merged
    assert_bit_exact(merged, reference)


@pytest.mark.parametrize("layers", [0, 2])
def test_mtp_layers_the_config_does_not_count_are_refused(tmp_path, layers):
    config = _config(tmp_path, "tp1_pp1_deepseek_v3_mtp", num_nextn_predict_layers=layers)
    run = DATA / "tp1_pp1_deepseek_v3_mtp" / "run"
    cli_refuses(
        run, tmp_path / "out", "--config", config, mentions=("MTP layers [0]", f"num_nextn_predict_layers {layers}")
    )


def test_mtp_layers_without_a_config_are_refused(tmp_path):
    cli_refuses(DATA / "tp1_pp1_deepseek_v3_mtp" / "run", tmp_path / "out", mentions=("--config",))


# --- GLM-4.5: grouped attention with a QKV bias and q/k norms, DeepSeek-V3's MoE and MTP layers -----------


def test_glm4_moe_equals_megatron_bridges_export_mtp_layer_and_routed_experts_included(tmp_path):
    # megatron-bridge 0.3.1 loaded the checkpoint at TP1/EP1 with TEGroupedMLP experts (the ones its GLM map names)
    # and exported every tensor: the routed experts and the MTP layer (model.layers.2) included
    report = fsdpfast.merge(DATA / GLM / "run", tmp_path / "out", config=DATA / GLM / "hf")
    assert any("1 MTP layer" in note for note in report.notes), report.notes
    merged, bridge = read_merged(str(tmp_path / "out")), load_file(str(DATA / GLM / "bridge_export.safetensors"))
    routed = {
        f"model.layers.{layer}.mlp.experts.{e}.{p}.weight"
        for layer in (1, 2)
        for e in range(4)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    assert routed | {"model.layers.2.eh_proj.weight", "model.layers.2.self_attn.q_proj.bias"} <= set(bridge)
    assert_bit_exact(merged, bridge)


def test_glm4_moe_names_and_shapes(tmp_path):
    fsdpfast.merge(DATA / GLM / "run", tmp_path / "out", config=DATA / GLM / "hf")
    merged = read_merged(str(tmp_path / "out"))
    shapes = {
        "self_attn.q_proj.bias": (4 * 16,),  # a bias on q, k and v (attention_bias), none on o
        "self_attn.k_proj.bias": (2 * 16,),
        "self_attn.q_norm.weight": (16,),  # use_qk_norm: over each head
        "mlp.gate.weight": (4, 64),
        "mlp.gate.e_score_correction_bias": (4,),
        "mlp.shared_experts.up_proj.weight": (32, 64),
        "mlp.experts.3.down_proj.weight": (64, 32),
    }
    for layer in ("model.layers.1.", "model.layers.2."):  # the MoE layer, and the MTP layer's
        assert {key: tuple(merged[layer + key].shape) for key in shapes} == shapes
    assert "model.layers.0.mlp.gate_proj.weight" in merged and "model.layers.0.self_attn.o_proj.bias" not in merged
    assert merged["model.layers.2.eh_proj.weight"].shape == (64, 128)


@pytest.mark.parametrize(
    "changes, mentions",
    [
        (dict(attention_bias=False), ("holds linear_qkv.bias", "attention_bias False")),
        (dict(use_qk_norm=False), ("q_layernorm", "use_qk_norm False")),
        (dict(n_shared_experts=0), ("holds shared experts", "has none")),
        (dict(first_k_dense_replace=0), ("linear_fc1.weight holds layers [0]", "first_k_dense_replace")),
        (dict(n_routed_experts=8), ("router.weight", "n_routed_experts 8")),
        (dict(num_nextn_predict_layers=0), ("MTP layers [0]", "num_nextn_predict_layers 0")),
        (dict(model_type="qwen3_moe", num_experts=4, mlp_only_layers=[0]), ("holds linear_qkv.bias", "glm4_moe")),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}),
            ("rotary_percent 0.5", "partial_rotary_factor 1.0"),
        ),
    ],
)
def test_a_glm4_moe_config_that_disagrees_with_the_checkpoint_is_refused(tmp_path, changes, mentions):
    config = _config(tmp_path, GLM, **changes)
    cli_refuses(DATA / GLM / "run", tmp_path / "out", "--config", config, mentions=(*mentions, "this checkpoint's"))


@pytest.mark.parametrize("top", [{"partial_rotary_factor": 0.5}, {}], ids=["top-level", "absent"])
def test_a_glm4_moe_partial_rotary_factor_at_the_top_or_absent_merges(tmp_path, top):
    # the Hub's GLM-4.5 config.json gives it at the top (transformers moves it into rope_parameters); absent: 0.5
    values = json.loads((DATA / GLM / "hf" / "config.json").read_text())
    del values["rope_parameters"]["partial_rotary_factor"]
    values.pop("partial_rotary_factor", None)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text(json.dumps({**values, **top}))
    fsdpfast.merge(DATA / GLM / "run", tmp_path / "out", config=tmp_path / "config")
    assert_bit_exact(read_merged(str(tmp_path / "out")), load_file(str(DATA / GLM / "reference.safetensors")))


def test_without_config_a_glm4_moe_checkpoint_is_refused_naming_the_option(tmp_path):
    cli_refuses(DATA / GLM / "run", tmp_path / "out", mentions=("MoE layers", "--config"))


def test_rope_on_part_of_each_head_is_refused_for_the_other_families(tmp_path):
    run = _with_args(tmp_path, rotary_percent=0.5)
    cli_refuses(run, tmp_path / "out", "--config", DATA / "tp2_pp2" / "hf", mentions=("rotary_percent 0.5", "llama"))
    cli_refuses(run, tmp_path / "built", mentions=("rotary_percent 0.5", "--config"))
