"""DeepSpeed ZeRO stage 1/2/3 checkpoints written by DeepSpeed itself, merged bit for bit.

Two independent references for every checkpoint (see fsdpfast/_testing/deepspeed_examples.py): the fp32
master weights gathered from the live engine, and DeepSpeed's own zero_to_fp32 on the saved folder.
Where zero_to_fp32 has gaps (stage 1 drops frozen parameters; its safetensors export fails on tied
weights) the tests show what fsdpfast does instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from deepspeed_checkpoints import DS_SPECS
from helpers import assert_bit_exact, bits, read_merged

import fsdpfast
from fsdpfast._testing.deepspeed_examples import FROZEN

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BUFFER = "fsdpfast_probe_buffer"


def load(path: str) -> dict:
    return torch.load(path, weights_only=True)


def merged_and_refs(deepspeed_checkpoints, name: str, tmp_path, **options):
    spec, root = deepspeed_checkpoints.get(name)
    report = fsdpfast.merge(root, tmp_path / "out", **options)
    return (
        spec,
        root,
        report,
        read_merged(str(tmp_path / "out")),
        load(spec.reference_path(deepspeed_checkpoints.root)),
        load(spec.oracle_path(deepspeed_checkpoints.root)),
    )


@pytest.mark.parametrize("name", DS_SPECS)
def test_merge_is_bit_exact_against_the_engine_and_zero_to_fp32(deepspeed_checkpoints, name, tmp_path):
    spec, _, report, merged, reference, oracle = merged_and_refs(deepspeed_checkpoints, name, tmp_path)
    assert report.layout == "deepspeed-zero" and report.world_size == DS_SPECS[name][0]
    # 1. the engine's own view: fp32 master weights, frozen params and buffers as the module holds them
    assert_bit_exact(merged, reference["state_dict"], tied=reference["tied"])
    assert report.tied == ({"model.embed_tokens.weight": ["lm_head.weight"]} if spec.tied else {})
    # 2. DeepSpeed's converter, wherever it has the tensor
    assert oracle["error"] is None, oracle["error"]
    converted = oracle["state_dict"]
    for tensor_name, want in converted.items():
        if tensor_name in reference["tied"]:
            assert torch.equal(want, converted["model.embed_tokens.weight"])  # zero_to_fp32 aliases it
            continue
        got = merged[tensor_name]
        if tensor_name == BUFFER and got.dtype != want.dtype:
            got = got.to(want.dtype)  # zero_to_fp32 widens buffers to fp32; fsdpfast keeps them as saved
        assert got.dtype == want.dtype and torch.equal(bits(got), bits(want)), tensor_name
    # 3. what zero_to_fp32 leaves out: stage 1's frozen parameters (fsdpfast reads them from the module)
    missing = set(merged) - set(converted)
    assert missing == (set(FROZEN) if spec.frozen and spec.stage == 1 else set())
    if missing:
        assert any("zero_to_fp32 leaves them out" in note for note in report.notes), report.notes


def test_tied_weights_written_once_where_zero_to_fp32_safetensors_fails(deepspeed_checkpoints, tmp_path):
    spec, _, report, merged, reference, oracle = merged_and_refs(
        deepspeed_checkpoints, "ds-w2-z3-fp32-tied-frozen", tmp_path
    )
    assert "share memory" in oracle["safetensors_error"]  # DeepSpeed's own export refuses the tie
    assert "lm_head.weight" not in merged and report.tied == {"model.embed_tokens.weight": ["lm_head.weight"]}
    # the tie came from the checkpoint's shared_params, not from config.json's tie_word_embeddings
    assert not any("tie_word_embeddings" in note for note in report.notes), report.notes
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(bits(model.lm_head.weight.detach()), bits(reference["state_dict"]["model.embed_tokens.weight"]))


def test_untied_checkpoints_export_with_zero_to_fp32_too(deepspeed_checkpoints):
    spec, _ = deepspeed_checkpoints.get("ds-w3-z1-bf16")
    assert load(spec.oracle_path(deepspeed_checkpoints.root))["safetensors_error"] is None


def test_cast_to_bf16(deepspeed_checkpoints, tmp_path):
    _, _, _, merged, reference, _ = merged_and_refs(
        deepspeed_checkpoints, "ds-w3-z3-bf16-frozen", tmp_path, dtype="bf16"
    )
    assert_bit_exact(merged, reference["state_dict"], dtype=torch.bfloat16)


def test_tag_picks_the_older_checkpoint(deepspeed_checkpoints, tmp_path):
    spec, root = deepspeed_checkpoints.get("ds-w2-z2-bf16-frozen-tags")
    older = load(spec.reference_path(deepspeed_checkpoints.root, "first"))
    latest = load(spec.reference_path(deepspeed_checkpoints.root))
    fsdpfast.merge(root, tmp_path / "by-tag", tag="first")
    assert_bit_exact(read_merged(str(tmp_path / "by-tag")), older["state_dict"])
    fsdpfast.merge(f"{root}/first", tmp_path / "tag-folder")  # the tag folder itself
    assert_bit_exact(read_merged(str(tmp_path / "tag-folder")), older["state_dict"])
    fsdpfast.merge(f"{root}/global_step2", tmp_path / "latest-folder")
    assert_bit_exact(read_merged(str(tmp_path / "latest-folder")), latest["state_dict"])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(older["state_dict"][q], latest["state_dict"][q])  # the two tags really differ
    # the merge's manifest records the tag: verify --against the root recomputes that tag, not `latest`'s
    assert fsdpfast.verify(tmp_path / "by-tag", against=root).ok
    assert not fsdpfast.verify(tmp_path / "by-tag", against=root, tag="global_step2").ok
    planned = fsdpfast.api.dry_run(root, tmp_path / "dry", tag="first")
    assert "ZeRO stage 2, tag first (the tag argument)" in planned["notes"][0] and not (tmp_path / "dry").exists()


def test_inspect_shows_stage_world_size_and_tag(deepspeed_checkpoints):
    _, root = deepspeed_checkpoints.get("ds-w3-z3-bf16-frozen")
    result = subprocess.run(
        [sys.executable, "-m", "fsdpfast", "inspect", root], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "layout deepspeed-zero, 3 ranks" in result.stdout
    assert "ZeRO stage 3, tag global_step1 (named by `latest`)" in result.stdout and "bf16 training" in result.stdout
    assert "2 frozen parameters" in result.stdout and "never read" in result.stdout
    _, root = deepspeed_checkpoints.get("ds-w2-z2-bf16-frozen-tags")
    found = fsdpfast.inspect(root, tag="first")
    assert found["world_size"] == 2 and "ZeRO stage 2, tag first (the tag argument)" in found["notes"][0]
    # the fp32 partitions are read in place from the optimizer files, the rest from the model states
    assert {p.rsplit("/", 1)[-1] for p in found["source_files"]} == {
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "mp_rank_00_model_states.pt",
    }


def test_plan_never_reads_the_adam_moments(deepspeed_checkpoints):
    """Every source byte range is a master-weight partition, a frozen fragment or a buffer: small next to the files."""
    spec, root = deepspeed_checkpoints.get("ds-w4-z2-fp32-frozen")
    plan = fsdpfast.plan_merge(root)
    optim = [s for s in plan.sources if s.path.endswith("_optim_states.pt")]
    assert len(optim) == 4
    trained = sum(t.numel for t in plan.tensors if t.name not in FROZEN and t.name != BUFFER) * 4
    assert sum(s.nbytes for s in optim) == trained  # the partitions, exactly (no padding at world size 4 here)
    assert sum(os.path.getsize(p) for p in {s.path for s in optim}) > 3 * trained  # the moments stay on disk


NO_DEEPSPEED = """
import sys
sys.modules["deepspeed"] = None  # any `import deepspeed` now raises ImportError
from fsdpfast.cli import main
code = main(sys.argv[1:])
assert not [m for m in sys.modules if m.startswith("deepspeed") and sys.modules[m] is not None], "deepspeed was imported"
sys.exit(code)
"""


def test_merges_without_deepspeed_importable(deepspeed_checkpoints, tmp_path):
    spec, root = deepspeed_checkpoints.get("ds-w4-z3-bf16-tied")
    result = subprocess.run(
        [sys.executable, "-c", NO_DEEPSPEED, "merge", root, "--out", str(tmp_path / "out"), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["layout"] == "deepspeed-zero"
    reference = load(spec.reference_path(deepspeed_checkpoints.root))
    assert_bit_exact(read_merged(str(tmp_path / "out")), reference["state_dict"], tied=reference["tied"])


FROZEN_SPECS = [name for name, (_, spec) in DS_SPECS.items() if spec.frozen]


@pytest.mark.parametrize("name", FROZEN_SPECS)
def test_exclude_frozen_matches_zero_to_fp32_exclude_frozen_parameters(deepspeed_checkpoints, name, tmp_path):
    spec, root, report, merged, reference, oracle = merged_and_refs(
        deepspeed_checkpoints, name, tmp_path, exclude_frozen=True
    )
    converted = oracle["excluding_frozen"]  # zero_to_fp32 with exclude_frozen_parameters=True
    assert converted is not None and not set(FROZEN) & set(converted)
    assert set(merged) == set(converted) - set(reference["tied"])  # the same tensors, tied ones written once
    for tensor_name, got in merged.items():
        want = converted[tensor_name]
        if tensor_name == BUFFER and got.dtype != want.dtype:
            got = got.to(want.dtype)  # zero_to_fp32 widens buffers to fp32; fsdpfast keeps them as saved
        assert got.dtype == want.dtype and torch.equal(bits(got), bits(want)), tensor_name
    kept = {k: v for k, v in reference["state_dict"].items() if k not in FROZEN}
    assert_bit_exact(merged, kept, tied=reference["tied"])  # and the engine's own values
    assert any(f"{len(FROZEN)} frozen parameters left out (exclude_frozen=True)" in note for note in report.notes), (
        report.notes
    )
    # the manifest records the option: verify --against recomputes without them, and finds the output whole
    assert fsdpfast.verify(tmp_path / "out", against=root).ok


def test_exclude_frozen_on_the_command_line(deepspeed_checkpoints, tmp_path):
    _, root = deepspeed_checkpoints.get("ds-w3-z3-bf16-frozen")
    run = lambda *args: subprocess.run(
        [sys.executable, "-m", "fsdpfast", *map(str, args)], capture_output=True, text=True, timeout=300
    )
    merged = run("merge", root, "--out", tmp_path / "out", "--exclude-frozen", "--json")
    assert merged.returncode == 0, merged.stderr
    assert not set(FROZEN) & set(read_merged(str(tmp_path / "out")))
    assert any("frozen parameters left out (--exclude-frozen)" in note for note in json.loads(merged.stdout)["notes"])
    found = run("inspect", root, "--exclude-frozen")
    listed = [line.split()[0] for line in found.stdout.splitlines() if line.startswith("  ")]
    assert found.returncode == 0 and listed and not set(FROZEN) & set(listed), found.stdout
    checked = run("verify", tmp_path / "out", "--against", root)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    with_frozen = fsdpfast.verify(tmp_path / "out", against=root, exclude_frozen=False)  # overrides what was recorded
    assert {m.tensor for m in with_frozen.mismatches} == set(FROZEN)


def test_exclude_frozen_applies_to_deepspeed_only(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    with pytest.raises(fsdpfast.BadInput, match="the exclude_frozen argument applies to deepspeed-zero checkpoints"):
        fsdpfast.merge(folder, tmp_path / "out", exclude_frozen=True)
    result = subprocess.run(
        [sys.executable, "-m", "fsdpfast", "merge", folder, "--out", str(tmp_path / "out"), "--exclude-frozen"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "--exclude-frozen applies to deepspeed-zero checkpoints" in result.stderr
    assert not (tmp_path / "out").exists()
