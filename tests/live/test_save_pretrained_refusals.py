"""What `fsdpfast.save_pretrained` refuses, in one line, publishing nothing; and the plain model it writes.

A plain (unsharded) model is written as it is: on one process, and on every rank of a group
(DDP replicas), where rank 0 writes its copy. Refused: two state-dict keys that become one name
once wrapper prefixes are removed; names config.json ties that hold different values (plain,
FSDP2) or two separate parameters (FSDP1); ranks that hold the model differently (FSDP2 on one,
plain on another); FSDP1 buffers held in MixedPrecision's buffer_dtype. The distributed cases
run on real gloo ranks (fsdpfast._testing.live_refusal_examples).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_tokenizer
from safetensors.torch import load_file

import fsdpfast
from fsdpfast._testing.fsdp2_writer import CheckpointSpec, build_model
from fsdpfast._testing.live_fsdp1_examples import LiveFsdp1Spec
from fsdpfast._testing.live_refusal_examples import LiveCase, save_cases
from fsdpfast.errors import BadInput

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 2
CASES = [
    LiveCase("fsdp2-untied", "fsdp2-untied", seed=51),
    LiveCase("mixed", "mixed", seed=52),
    LiveCase("plain", "plain", seed=53),
    LiveCase("clash-on-rank-1", "clash-on-rank-1", seed=59),
    LiveCase("shard-size-on-rank-1", "shard-size-on-rank-1", seed=60),
    LiveCase("spelled-otherwise-on-rank-1", "spelled-otherwise-on-rank-1", seed=61),
    LiveCase("overwrite", "overwrite", seed=62),
    LiveFsdp1Spec("fsdp1-untied", model="llama-tied", untie=True, seed=54),
    LiveFsdp1Spec("fsdp1-cast-buffers", cast_buffers=True, seed=55),
]


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        found.update(load_file(path))
    return found


def nothing_published(parent: Path, name: str) -> bool:
    """No output folder, and no staging folder or lock of it left beside it."""
    return not [p for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}")]


def one_line_refusal(exc: BaseException) -> str:
    message = str(exc)
    assert "\n" not in message, message
    return message


# --- one process, no process group ---


def test_a_plain_model_on_one_process_is_written(tmp_path):
    import transformers

    model = build_model(CheckpointSpec("plain", seed=56))
    report = fsdpfast.save_pretrained(model, tmp_path / "out")
    assert report.processes == 1
    written = tensors_of(tmp_path / "out")
    state = model.state_dict()
    assert set(written) == set(state)
    for key, value in state.items():
        assert torch.equal(written[key].view(torch.uint8), value.view(torch.uint8)), key
    assert fsdpfast.verify(tmp_path / "out").ok
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_two_keys_that_become_one_name_are_refused(tmp_path):
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(4, 4)
    model._orig_mod = torch.nn.Module()  # torch.compile's wrapper name, removed from names as the offline merge does
    model._orig_mod.proj = torch.nn.Linear(4, 4)
    with pytest.raises(BadInput) as refused:
        fsdpfast.save_pretrained(model, tmp_path / "out")
    assert one_line_refusal(refused.value) == (
        "proj.weight and _orig_mod.proj.weight both become proj.weight once wrapper prefixes are removed"
    )
    assert nothing_published(tmp_path, "out")


@pytest.mark.parametrize("dtype", ["fp8", "fp8-block"])
def test_fp8_with_no_linear_weight_is_refused(tmp_path, dtype):
    with pytest.raises(BadInput) as refused:  # its one 2-D tensor is `weight`, not a layer's `x.weight`
        fsdpfast.save_pretrained(torch.nn.Linear(4, 4), tmp_path / "out", dtype=dtype)
    assert "no linear weight to quantize" in one_line_refusal(refused.value)
    assert nothing_published(tmp_path, "out")


def test_fp8_skip_without_fp8_is_refused(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(BadInput, match="fp8_skip applies to dtype='fp8' only"):
        fsdpfast.save_pretrained(model, tmp_path / "out", dtype="bf16", fp8_skip="*")
    assert nothing_published(tmp_path, "out")


def test_tied_names_whose_values_differ_are_refused(tmp_path):
    model = build_model(CheckpointSpec("untied", model="llama-tied", seed=57))
    assert model.config.tie_word_embeddings
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() + 1)
    with pytest.raises(BadInput) as refused:
        fsdpfast.save_pretrained(model, tmp_path / "out")
    message = one_line_refusal(refused.value)
    assert message.startswith("config.json ties lm_head.weight to model.embed_tokens.weight, but the model holds")
    assert "set tie_word_embeddings to false" in message
    assert nothing_published(tmp_path, "out")


def test_tied_names_on_one_parameter_are_written_once(tmp_path):
    model = build_model(CheckpointSpec("tied", model="llama-tied", seed=58))
    report = fsdpfast.save_pretrained(model, tmp_path / "out")
    assert report.tied == {"model.embed_tokens.weight": ["lm_head.weight"]}
    assert "lm_head.weight" not in tensors_of(tmp_path / "out")


def test_overwrite_replaces_a_live_save_but_not_what_was_added_to_it(tmp_path):
    """Its config, generation config and tokenizer files are listed in its manifest; an eval file is not."""
    model = build_model(CheckpointSpec("plain", seed=60))
    out = tmp_path / "out"
    fsdpfast.save_pretrained(model, out, dtype="bf16", tokenizer=tiny_tokenizer())
    written = sorted(p.name for p in out.iterdir())
    assert "tokenizer.json" in written and "tokenizer_config.json" in written, written
    (out / "eval_results.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(BadInput) as refused:
        fsdpfast.save_pretrained(model, out, overwrite=True)
    assert "holds 1 entry fsdpfast did not write (eval_results.json)" in one_line_refusal(refused.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no staging folder or lock left
    (out / "eval_results.json").unlink()
    fsdpfast.save_pretrained(model, out, overwrite=True)  # float32 now, no tokenizer
    assert not (out / "tokenizer.json").exists()
    written = tensors_of(out)
    for key, value in model.state_dict().items():
        assert torch.equal(written[key].view(torch.uint8), value.view(torch.uint8)), key
    assert fsdpfast.verify(out).ok


# --- spawned gloo ranks ---


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("live-refusals")
    save_cases(str(root), CASES, WORLD)
    return root


def outcomes(folder: Path) -> list[dict]:
    return [json.loads((folder / f"outcome-{rank}.json").read_text()) for rank in range(WORLD)]


def test_a_plain_model_on_every_rank_is_rank_0s_copy(saved):
    folder = saved / "plain"
    assert all(o["ok"] for o in outcomes(folder)), outcomes(folder)
    written, reference = tensors_of(folder / "live"), load_file(folder / "reference.safetensors")
    assert set(written) == set(reference)
    for key, value in reference.items():
        assert torch.equal(written[key].view(torch.uint8), value.view(torch.uint8)), key
    assert json.loads((folder / "live" / "fsdpfast-manifest.json").read_text())["world_size"] == 1


@pytest.mark.parametrize("name", ["fsdp2-untied", "fsdp1-untied"])
def test_tied_names_holding_two_parameters_are_refused_on_every_rank(saved, name):
    folder = saved / name
    for outcome in outcomes(folder):
        assert not outcome["ok"]
        assert outcome["error"].startswith(
            "BadInput: config.json ties lm_head.weight to model.embed_tokens.weight, but the model holds different values"
        ), outcome
        assert "\n" not in outcome["error"]
    assert nothing_published(folder, "live")


def test_ranks_that_hold_the_model_differently_are_refused_before_anything_is_made(saved):
    folder = saved / "mixed"
    first, second = outcomes(folder)
    assert first["error"] == (
        "BadInput: save_pretrained: rank 1 holds a different model from rank 0 (21 plain there, 21 DTensor on "
        "rank 0, or other names, shapes or dtypes); call it on every rank with the same model, sharded the same way"
    ), first
    assert second["error"].startswith("OtherRankFailed: rank 0 failed: save_pretrained: rank 1 holds a different"), (
        second
    )
    assert second["error"].endswith("nothing was published"), second
    assert nothing_published(folder, "live")


def test_fsdp1_buffers_cast_by_mixed_precision_are_refused(saved):
    folder = saved / "fsdp1-cast-buffers"
    for rank, outcome in enumerate(outcomes(folder)):
        assert not outcome["ok"]
        assert outcome["error"] == (
            "BadInput: save_pretrained: FSDP1 holds the buffer fsdpfast_probe_buffer in MixedPrecision's "
            "buffer_dtype, not its own; save a checkpoint and merge it instead"
        ), (rank, outcome)
    assert nothing_published(folder, "live")


def test_a_rank_that_cannot_plan_stops_every_rank(saved):
    folder = saved / "clash-on-rank-1"
    first, second = outcomes(folder)
    refusal = "lm_head.weight and _orig_mod.lm_head.weight both become lm_head.weight once wrapper prefixes are removed"
    assert second["error"] == f"BadInput: {refusal}", second
    assert first["error"] == f"OtherRankFailed: rank 1 failed: {refusal}; nothing was published", first
    assert nothing_published(folder, "live")


def test_a_rank_given_another_shard_size_is_refused_before_anything_is_made(saved):
    """Each rank lays out the files from its own max_shard_size: rank 1's would write at other offsets."""
    folder = saved / "shard-size-on-rank-1"
    first, second = outcomes(folder)
    refusal = (
        "rank 1 called save_pretrained with max_shard_size='100KB', rank 0 with max_shard_size='5GB'; "
        "call it with the same arguments on every rank"
    )
    assert first["error"] == f"RankDisagrees: {refusal}", first
    assert second["error"] == f"OtherRankFailed: rank 0 failed: {refusal}; nothing was published", second
    assert nothing_published(folder, "live")


def test_the_same_arguments_spelled_otherwise_are_written(saved):
    """The look-alike: bf16 and bfloat16, 5GB and 5000MB agree; the folder holds torch's bf16 casts."""
    folder = saved / "spelled-otherwise-on-rank-1"
    assert all(o["ok"] for o in outcomes(folder)), outcomes(folder)
    written, reference = tensors_of(folder / "live"), load_file(folder / "reference.safetensors")
    assert set(written) == set(reference)
    for key, value in reference.items():
        assert torch.equal(written[key].view(torch.uint8), value.view(torch.uint8)), key


def test_overwrite_on_every_rank_replaces_only_an_earlier_save(saved):
    """Rank 0 checks the earlier folder before any rank writes: a file of the user's stops every rank."""
    folder = saved / "overwrite"
    refused = [json.loads((folder / f"refused-{rank}.json").read_text()) for rank in range(WORLD)]
    what = "holds 1 entry fsdpfast did not write (eval_results.json)"
    assert refused[0]["error"].startswith("BadInput: ") and what in refused[0]["error"], refused[0]
    assert refused[1]["error"].startswith("OtherRankFailed: rank 0 failed: ") and what in refused[1]["error"]
    assert all(r["kept"] and "\n" not in r["error"] for r in refused), refused
    assert all(o["ok"] for o in outcomes(folder)), outcomes(folder)  # the same save once the file was gone
    written, reference = tensors_of(folder / "live"), load_file(folder / "reference.safetensors")
    assert set(written) == set(reference)
    for key, value in reference.items():  # float32: the bf16 folder was replaced
        assert torch.equal(written[key].view(torch.uint8), value.view(torch.uint8)), key
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".live")]  # no staging folder, no lock
    assert fsdpfast.verify(folder / "live").ok
