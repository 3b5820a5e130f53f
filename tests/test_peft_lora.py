"""PEFT LoRA checkpoints, written as verl writes a LoRA actor, merged into a base model and adapter folders.

Every checkpoint comes from a real peft model sharded by FSDP2 (or DeepSpeed ZeRO-2) on gloo ranks, trained for a
step (fsdpfast.testing.peft_examples); the references are taken from that model by peft itself: the
adapters' state dicts as peft saves them, the logits of the training model, merge_and_unload().
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import CheckpointsByWorld, read_merged
from peft_checks import adapter_folder, assert_same, peft_logits, untied

import fsdpfast
from fsdpfast.errors import BadInput
from fsdpfast.testing.peft_examples import PeftSpec, write_peft_checkpoints, write_peft_deepspeed_checkpoints

peft = pytest.importorskip("peft")

DORA_SECOND = dict(r=4, lora_alpha=8, target_modules=["k_proj", "o_proj"], use_dora=True)
# name -> (world size, spec). World 3 splits r=8 unevenly (3, 3, 2 rows of lora_A).
SPECS = {
    spec.name: (world, spec)
    for world, spec in [
        (2, PeftSpec("verl", seed=41)),
        (2, PeftSpec("verl-lora-only", lora_only=True, seed=42)),
        (2, PeftSpec("two-adapters", second=DORA_SECOND, meta=False, seed=43)),
        (
            2,
            PeftSpec(
                "bf16-bias-copies",
                dtype="bfloat16",
                targets=("q_proj", "v_proj", "o_proj"),
                sizes={"attention_bias": True},
                extras={"lora_bias": True, "modules_to_save": ["lm_head"]},
                seed=44,
            ),
        ),
        (2, PeftSpec("guide", layout="guide-ranks", r=4, lora_alpha=4, seed=45)),
        (2, PeftSpec("dcp-hf", layout="dcp-hf", seed=46)),
        (
            3,
            PeftSpec(
                "dcp-tied-rslora-embedding",
                layout="dcp",
                model="llama-tied",
                targets=("q_proj", "embed_tokens", "up_proj"),
                extras={"use_rslora": True},
                meta=False,
                seed=47,
            ),
        ),
        (3, PeftSpec("dcp-lora-only", layout="dcp", lora_only=True, seed=48)),
    ]
}
if importlib.util.find_spec("deepspeed") is not None:  # the test extra installs it; merging never needs it
    SPECS["deepspeed-zero2"] = (2, PeftSpec("deepspeed-zero2", layout="deepspeed-zero2", seed=49))
FULL = [n for n, (_, s) in SPECS.items() if not s.lora_only]


class PeftCheckpoints(CheckpointsByWorld):
    def __init__(self, root: str):
        super().__init__(root, SPECS, self._write, lambda spec, root: spec.folder(root))

    @staticmethod
    def _write(root: str, specs: list[PeftSpec], world: int) -> None:
        write_peft_checkpoints(root, [s for s in specs if not s.layout.startswith("deepspeed")], world)
        if any(s.layout.startswith("deepspeed") for s in specs):  # DeepSpeed joins its process group its own way
            write_peft_deepspeed_checkpoints(root, [s for s in specs if s.layout.startswith("deepspeed")], world)

    def reference(self, name: str) -> dict:
        return torch.load(SPECS[name][1].reference_path(self.root), weights_only=True)

    def copy(self, name: str, tmp_path) -> str:
        return shutil.copytree(self.get(name)[1], tmp_path / "ckpt")


@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> PeftCheckpoints:
    return PeftCheckpoints(str(tmp_path_factory.mktemp("peft")))


@pytest.mark.parametrize("name", FULL)
def test_base_model_and_adapter_folders(lora, tmp_path, name):
    spec, folder = lora.get(name)
    ref = lora.reference(name)
    out = tmp_path / "out"
    report = fsdpfast.merge(folder, out)
    base = read_merged(out)
    assert_same(base, untied(ref["base"], base))  # the model's own names, every weight as built (LoRA froze it)
    dtype = getattr(torch, spec.dtype)
    for adapter, logits in ref["logits"].items():
        where = adapter_folder(out, adapter)
        assert os.path.relpath(where, out) in report.adapters
        assert_same(read_merged(where), ref["adapters"][adapter])  # peft's saved names and bytes
        with open(os.path.join(where, "adapter_config.json")) as f:
            config = json.load(f)
        trained = ref["configs"][adapter]
        for key in ("r", "lora_alpha", "task_type", "use_dora", "use_rslora", "lora_bias"):
            assert config[key] == trained[key], key
        assert sorted(config["target_modules"]) == sorted(trained["target_modules"])
        assert config["base_model_name_or_path"] == os.path.abspath(out)
        assert torch.equal(peft_logits(out, where, dtype), logits)  # the training model's logits, exactly
    assert fsdpfast.verify(out, against=folder).ok


@pytest.mark.parametrize("name", FULL)
def test_merge_lora_equals_merge_and_unload(lora, tmp_path, name):
    spec, folder = lora.get(name)
    ref = lora.reference(name)
    report = fsdpfast.merge(folder, tmp_path / "fused", merge_lora=",".join(spec.merged) if spec.second else True)
    fused = read_merged(tmp_path / "fused")
    assert_same(fused, untied(ref["merged"], fused))
    assert not report.adapters and not os.path.exists(tmp_path / "fused" / "lora_adapter")
    check = fsdpfast.verify(tmp_path / "fused", against=folder)  # fused weights recomputed from the shards
    assert check.ok, check.summary()


def test_lora_only_checkpoint_writes_the_adapter_alone(lora, tmp_path):
    for name in ("verl-lora-only", "dcp-lora-only"):
        _, folder = lora.get(name)
        ref = lora.reference(name)
        out = tmp_path / name
        report = fsdpfast.merge(folder, out)
        assert sorted(os.listdir(out)) == ["fsdpfast-manifest.json", "lora_adapter"]
        assert any("LoRA-only" in note for note in report.notes)
        assert_same(read_merged(out / "lora_adapter"), ref["adapters"]["default"])
        assert fsdpfast.verify(out, against=folder).ok


def test_lora_only_with_base_writes_the_fused_model_and_the_adapter(lora, tmp_path):
    spec, folder = lora.get("verl-lora-only")
    ref = lora.reference("verl-lora-only")
    base = spec.base_folder(lora.root)
    out = tmp_path / "out"
    fsdpfast.merge(folder, out, base=base)
    assert_same(read_merged(out), ref["merged"])
    assert_same(read_merged(out / "lora_adapter"), ref["adapters"]["default"])
    with open(out / "lora_adapter" / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == os.path.abspath(base)  # the unmerged base, not OUT
    assert torch.equal(peft_logits(base, str(out / "lora_adapter"), torch.float32), ref["logits"]["default"])
    check = fsdpfast.verify(out, against=folder)
    assert check.ok, check.summary()
    with pytest.raises(BadInput, match="--base HF_DIR"):
        fsdpfast.merge(folder, tmp_path / "no-base", merge_lora=True)


def test_alpha_is_never_silently_zero(lora, tmp_path):
    folder = lora.copy("verl", tmp_path)
    os.remove(os.path.join(folder, "lora_train_meta.json"))
    with pytest.raises(BadInput, match="--lora-alpha"):
        fsdpfast.merge(folder, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")
    assert fsdpfast.inspect(folder)["adapters"][0]["lora_alpha"] is None  # inspect shows it missing, does not fail
    with open(os.path.join(folder, "lora_train_meta.json"), "w") as f:  # what verl records when alpha was not set
        json.dump({"r": 8, "lora_alpha": 0, "task_type": "CAUSAL_LM"}, f)
    with pytest.raises(BadInput, match="lora_alpha 0"):
        fsdpfast.merge(folder, tmp_path / "out", merge_lora=True)
    report = fsdpfast.merge(folder, tmp_path / "out", merge_lora=True, lora_alpha=16)
    assert any("--lora-alpha" in note for note in report.notes)
    assert_same(read_merged(tmp_path / "out"), lora.reference("verl")["merged"])


def test_inferred_values_are_said(lora, tmp_path):
    folder = lora.copy("verl", tmp_path)
    os.remove(os.path.join(folder, "lora_train_meta.json"))
    report = fsdpfast.merge(folder, tmp_path / "out", lora_alpha=16)
    note = next(n for n in report.notes if n.startswith("LoRA adapter default"))
    assert "r 8" in note and "from the lora_A shapes" in note
    assert "task_type CAUSAL_LM" in note and "LlamaForCausalLM" in note  # from config.json's architectures
    with open(tmp_path / "out" / "lora_adapter" / "adapter_config.json") as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (8, 16, "CAUSAL_LM")


def test_several_adapters_are_fused_only_by_name(lora, tmp_path):
    _, folder = lora.get("two-adapters")
    with pytest.raises(BadInput, match="--merge-lora default,second"):
        fsdpfast.merge(folder, tmp_path / "out", merge_lora=True)
    with pytest.raises(BadInput, match="DoRA"):
        fsdpfast.merge(folder, tmp_path / "out", merge_lora="second")
    with pytest.raises(BadInput, match="no LoRA adapter 'third'"):
        fsdpfast.merge(folder, tmp_path / "out", merge_lora="third")
    assert not os.path.exists(tmp_path / "out")


def test_flags_on_a_plain_checkpoint_are_refused(tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    torch.save({"weight": torch.ones(2, 3)}, folder / "model_world_size_1_rank_0.pt")
    with pytest.raises(BadInput, match="no LoRA tensors"):
        fsdpfast.merge(folder, tmp_path / "out", merge_lora=True)


def test_damaged_fused_weight_is_found(lora, tmp_path):
    from fsdpfast.io.stored import read_folder

    _, folder = lora.get("verl")
    out = tmp_path / "out"
    fsdpfast.merge(folder, out, merge_lora=True)
    name = "model.layers.0.self_attn.q_proj.weight"  # a fused one
    path = out / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[read_folder(str(out))[name].byte_offset + 5] ^= 1
    path.write_bytes(bytes(data))
    for check in (fsdpfast.verify(out), fsdpfast.verify(out, against=folder)):
        assert [m.tensor for m in check.mismatches] == [name]


def test_command_line(lora, tmp_path):
    spec, folder = lora.get("two-adapters")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "fsdpfast", *map(str, args)], capture_output=True, text=True, env=env
        )

    shown = run("inspect", folder)
    assert shown.returncode == 0, shown.stderr
    assert "adapter default -> lora_adapter: r 8, lora_alpha 16" in shown.stdout
    assert "adapter second -> lora_adapter/second: r 4, lora_alpha 8" in shown.stdout and "DoRA" in shown.stdout
    merged = run("merge", folder, "--out", tmp_path / "out", "--json")
    assert merged.returncode == 0, merged.stderr
    assert json.loads(merged.stdout)["adapters"] == ["lora_adapter", "lora_adapter/second"]
    checked = run("verify", tmp_path / "out", "--smoke", "--reference", tmp_path / "out")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "lora_adapter/second: reference" in checked.stdout
    fused = run("merge", folder, "--out", tmp_path / "fused", "--merge-lora", "default")
    assert fused.returncode == 0, fused.stderr
    assert_same(read_merged(tmp_path / "fused"), lora.reference("two-adapters")["merged"])
    refused = run("merge", folder, "--out", tmp_path / "refused", "--merge-lora")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    dry = run("merge", folder, "--out", tmp_path / "dry", "--dry-run", "--json")
    names = [f["name"] for f in json.loads(dry.stdout)["files"]]
    assert names == [
        "model.safetensors",
        "lora_adapter/adapter_model.safetensors",
        "lora_adapter/second/adapter_model.safetensors",
    ]


@pytest.mark.parametrize("flags", [[], ["--merge-lora", "default"]])
def test_processes_write_the_single_process_merge(lora, tmp_path, flags):
    """Under torchrun the base model, the adapter folders and the fused weights are shared out as any
    other files: the same bytes and manifest as one process writes."""
    from merge_processes import Ranks, left_beside, same_output

    _, folder = lora.get("two-adapters")
    single, out = tmp_path / "single", tmp_path / "shared" / "out"
    fsdpfast.merge(folder, single, max_shard_size="64KB", merge_lora="default" if flags else None)
    results = Ranks(lambda rank: [folder, "--out", out, "--max-shard-size", "64KB", "--timeout", 120, *flags], 2)
    results = results.wait()
    assert [status for status, *_ in results] == [0, 0], results
    assert "in 2 processes" in results[0][1]
    same_output(single, out)
    assert left_beside(out) == []
    if flags:
        assert_same(read_merged(out), lora.reference("two-adapters")["merged"])
    else:
        assert len(list(out.glob("model-*.safetensors"))) > 1  # files for both processes to write


def test_overwrite_replaces_the_adapter_folders_and_nothing_added_to_them(lora, tmp_path):
    """An earlier merge's adapter folders (nested: lora_adapter/second) are its own; a file put in one is not."""
    from test_bad_input import run_cli, the_error_line, tree_digest

    _, folder = lora.get("two-adapters")
    ref = lora.reference("two-adapters")
    out = tmp_path / "out"
    fsdpfast.merge(folder, out)
    (out / "lora_adapter" / "second" / "README.md").write_text("my notes on the second adapter")
    before = tree_digest(out)
    line = the_error_line(run_cli("merge", folder, "--out", out, "--overwrite", "--merge-lora", "default"))
    assert "1 entry fsdpfast did not write (lora_adapter/second/README.md)" in line, line
    assert tree_digest(out) == before
    (out / "lora_adapter" / "second" / "README.md").unlink()
    fsdpfast.merge(folder, out, merge_lora="default", overwrite=True)  # now one fused model, no adapter folder
    assert not (out / "lora_adapter").exists()
    fused = read_merged(out)
    assert_same(fused, untied(ref["merged"], fused))
    fsdpfast.merge(folder, out, overwrite=True)  # and back: the base model and both adapter folders
    assert_same(read_merged(adapter_folder(out, "second")), ref["adapters"]["second"])
    assert fsdpfast.verify(out, against=folder).ok
