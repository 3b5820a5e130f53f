"""Megatron-Core torch_dist checkpoints merge bit for bit into Hugging Face Llama / Qwen2 folders.

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
from safetensors.torch import load_file
from test_bad_input import cli_refuses, run_cli

import fsdpfast

DATA = Path(__file__).parent / "data" / "megatron"
# every fixture with a reference; per_layer: decoder.layers.{i}.* names (hetereogenous_dist_checkpoint);
# the last: virtual pipeline stages (layers 0, 2 on stage 0), embeddings
# tied across stages, QKV bias, bf16 parameters
MERGED = ["tp2_pp1", "tp2_pp2", "tp1_pp1_qwen2_tied", "tp2_pp1_per_layer_bf16", "tp2_pp2_vpp2_qwen2_tied_bf16"]
ITERATION = "iter_0000007"


def _copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(DATA / name, tmp_path / name))


def test_the_fixtures_are_the_ones_recorded():
    versions = json.loads((DATA / "versions.json").read_text())
    assert versions["megatron-core"] == "0.16.1"
    assert sorted(f["name"] for f in versions["fixtures"]) == sorted([*MERGED, "tp1_pp1_moe"])
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
    import transformers

    fsdpfast.merge(DATA / name / "run" / ITERATION, tmp_path / "out", config=DATA / name / "hf")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "out"), dtype="auto", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    reference = load_file(str(DATA / name / "reference.safetensors"))
    for key, value in model.state_dict().items():  # tied lm_head included: it is the embedding
        wanted = reference.get(key, reference["model.embed_tokens.weight"] if key == "lm_head.weight" else None)
        assert torch.equal(value, wanted.to(value.dtype)), key  # as loaded: in config.json's dtype
    megatron = DATA / name / "megatron_logits.safetensors"
    if megatron.exists():  # Megatron's own forward pass: the split into q/k/v and gate/up means what Megatron meant
        probe = load_file(str(megatron))
        with torch.no_grad():
            logits = model(probe["input_ids"]).logits
        torch.testing.assert_close(logits, probe["logits"], rtol=1e-5, atol=1e-5)


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


def test_an_moe_checkpoint_is_refused_naming_what_was_found(tmp_path):
    # written by megatron-core with 2 experts: refused before any config is asked for
    cli_refuses(DATA / "tp1_pp1_moe" / "run", tmp_path / "out", mentions=("MoE", "decoder.layers.mlp.router.weight"))


def test_a_missing_iteration_is_refused(tmp_path):
    run = _copy("tp2_pp1", tmp_path) / "run"
    (run / "latest_checkpointed_iteration.txt").write_text("9")
    line = cli_refuses(run, tmp_path / "out", "--config", DATA / "tp2_pp1" / "hf", mentions=("iter_0000009",))
    assert "latest_checkpointed_iteration.txt" in line


def test_inspect_names_the_layout():
    result = run_cli("inspect", DATA / "tp2_pp2" / "run", "--config", DATA / "tp2_pp2" / "hf")
    assert result.returncode == 0, result.stderr
    assert "megatron" in result.stdout


# --- the placement itself: windows of chunked tensors against torch indexing ---------------------


def _run_extents(extents, source: torch.Tensor, out: torch.Tensor) -> None:
    flat = out.view(-1)
    for e in extents:
        for r in range(e.runs):
            src, dst = e.src_offset + r * e.src_stride, e.dst_offset + r * e.dst_stride
            flat[dst : dst + e.count] = source[src : src + e.count]


def test_window_extents_place_what_torch_slicing_takes():
    for seed in range(400):
        _check_random_window(seed)


def _check_random_window(seed: int) -> None:
    from fsdpfast._parsing.boxes import window_extents

    rng = torch.Generator().manual_seed(seed)

    def randint(low, high):  # low..high inclusive
        return int(torch.randint(low, high + 1, (1,), generator=rng))

    ndim = randint(1, 4)
    shape = tuple(randint(1, 6) for _ in range(ndim))
    whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    cuts = [sorted({0, size, *(randint(1, size) for _ in range(randint(0, 2)))}) for size in shape]
    chunks, pieces, at = [], [], 0  # every chunk's row-major bytes, one after another in one source
    for box in __import__("itertools").product(*(list(zip(c, c[1:])) for c in cuts)):
        offsets, sizes = tuple(lo for lo, _ in box), tuple(hi - lo for lo, hi in box)
        piece = whole[tuple(slice(lo, hi) for lo, hi in box)].reshape(-1)
        chunks.append((offsets, sizes, at))
        pieces.append(piece)
        at += piece.numel()
    source = torch.cat(pieces)
    dropped = randint(0, ndim - 1)
    starts = [randint(0, size - 1) for size in shape]
    sizes = [1 if d < dropped else randint(1, shape[d] - starts[d]) for d in range(ndim)]
    margin = [randint(0, 2) * randint(0, 1) for _ in range(ndim - dropped)]  # often none: the output is the window
    out_shape = tuple(s + m for s, m in zip(sizes[dropped:], margin))
    out_at = tuple(randint(0, m) for m in margin)
    out = torch.full(out_shape, -1.0, dtype=torch.float64)
    for offsets, piece_sizes, element_offset in chunks:
        extents = window_extents(0, element_offset, offsets, piece_sizes, starts, sizes, out_shape, out_at)
        _run_extents(extents, source, out)
    expected = torch.full(out_shape, -1.0, dtype=torch.float64)
    window = whole[tuple(slice(s, s + n) for s, n in zip(starts, sizes))].reshape(sizes[dropped:])
    expected[tuple(slice(a, a + n) for a, n in zip(out_at, sizes[dropped:]))] = window
    assert torch.equal(out, expected), (seed, shape, cuts, starts, sizes, out_shape, out_at)


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
WITH_ARGS = ["tp2_pp2", "tp2_pp2_vpp2_qwen2_tied_bf16"]
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


def _with_args(tmp_path: Path, drop=(), **changes) -> Path:
    """The tp2_pp2 run with its common.pt's args changed, saved as Megatron saves common.pt (torch.save)."""
    import argparse

    from fsdpfast.readers.megatron_args import read_training_args

    run = _copy("tp2_pp2", tmp_path) / "run"
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
        ((), dict(padded_vocab_size=128), ("padded_vocab_size 128", "embedding rows 102")),
        ((), dict(untie_embeddings_and_output_weights=False), ("untie_embeddings_and_output_weights",)),
        ((), dict(ffn_hidden_size=64), ("linear_fc1.weight", "intermediate_size 64")),  # shapes still checked
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
