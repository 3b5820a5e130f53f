"""PEFT LoRA checkpoints, written as verl writes a LoRA actor, merged into a base model and adapter folders.

Every checkpoint comes from a real peft model sharded by FSDP2 (or DeepSpeed ZeRO-2) on gloo ranks, trained for a
step (fsdpfast._testing.peft_examples); the references are taken from that model by peft itself: the
adapters' state dicts as peft saves them, the logits of the training model, merge_and_unload().
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (lets torch.load(weights_only=True) rebuild DTensors)
from helpers import CheckpointsByWorld, read_merged
from peft_checks import adapter_folder, assert_same, peft_logits, untied
from refusals import api_refuses, cli_refuses, edit_state_dict

import fsdpfast
from fsdpfast._testing.peft_examples import (
    PeftSpec,
    lora_config,
    write_peft_checkpoints,
    write_peft_deepspeed_checkpoints,
)
from fsdpfast.errors import BadInput

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

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
        (  # peft's per-module rank and alpha, recorded in adapter_config.json only
            2,
            PeftSpec(
                "rank-pattern",
                extras={"rank_pattern": {"v_proj": 4, "down_proj": 2}, "alpha_pattern": {"v_proj": 32}},
                meta=False,
                seed=50,
            ),
        ),
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


@pytest.mark.torch_ops
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


@pytest.mark.torch_ops
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


@pytest.mark.torch_ops
def test_several_adapters_are_fused_only_by_name(lora, tmp_path):
    _, folder = lora.get("two-adapters")
    with pytest.raises(BadInput, match="--merge-lora default,second"):
        fsdpfast.merge(folder, tmp_path / "out", merge_lora=True)
    with pytest.raises(BadInput, match="DoRA"):
        fsdpfast.merge(folder, tmp_path / "out", merge_lora="second")
    with pytest.raises(BadInput, match="no LoRA adapter 'third'"):
        fsdpfast.merge(folder, tmp_path / "out", merge_lora="third")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.torch_ops
def test_flags_on_a_plain_checkpoint_are_refused(tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    torch.save({"weight": torch.ones(2, 3)}, folder / "model_world_size_1_rank_0.pt")
    with pytest.raises(BadInput, match="no LoRA tensors"):
        fsdpfast.merge(folder, tmp_path / "out", merge_lora=True)


@pytest.mark.torch_ops
def test_damaged_fused_weight_is_found(lora, tmp_path):
    from fsdpfast.io.safetensors_folder import read_folder

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


@pytest.mark.torch_ops
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


@pytest.mark.torch_ops
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


# --- the records of an adapter disagreeing with each other, or with the tensors and the model ----------


def _save_adapter_config(spec: PeftSpec, folder, **fields) -> None:
    """peft's own adapter_config.json of the spec's LoraConfig (save_pretrained), with `fields` changed."""
    lora_config(spec, **fields).save_pretrained(str(folder))


def _edit_meta(folder, **values) -> None:
    path = os.path.join(folder, "lora_train_meta.json")
    with open(path) as f:
        meta = json.load(f)
    with open(path, "w") as f:
        json.dump({**meta, **values}, f)


def _rename_module(folder, old: str, new: str) -> None:
    """Every rank file's LoRA tensors of module `old` renamed to `new` (torch.load and torch.save, DTensors kept)."""
    for path in sorted(Path(folder).glob("model_world_size_*_rank_*.pt")):
        edit_state_dict(
            path,
            lambda state: state.update(
                {k.replace(f".{old}.lora_", f".{new}.lora_"): state.pop(k) for k in [k for k in state if ".lora_" in k]}
            ),
        )


@pytest.mark.torch_ops
@pytest.mark.parametrize("name", [n for n in ("verl", "guide", "dcp-hf", "deepspeed-zero2") if n in SPECS])
def test_lora_alpha_the_two_files_disagree_on_is_refused(lora, tmp_path, name):
    """verl's lora_train_meta.json says one lora_alpha, peft's adapter_config.json 32: neither wins; --lora-alpha
    settles it."""
    spec, _ = lora.get(name)
    folder = lora.copy(name, tmp_path)
    _save_adapter_config(spec, folder, lora_alpha=32)
    alpha = spec.lora_alpha  # what verl's meta records
    mentions = ["adapter_config.json records lora_alpha 32", f"lora_train_meta.json records lora_alpha {alpha}"]
    cli_refuses(folder, tmp_path / "out", mentions=[*mentions, "--lora-alpha A"])
    cli_refuses(folder, tmp_path / "out", "--merge-lora", mentions=mentions)
    api_refuses(folder, tmp_path / "out", mentions=[*mentions, "lora_alpha=A"])
    report = fsdpfast.merge(folder, tmp_path / "settled", merge_lora=True, lora_alpha=alpha)
    assert any(f"--lora-alpha {alpha} replaces lora_alpha 32 of adapter_config.json" in n for n in report.notes)
    fused = read_merged(tmp_path / "settled")
    assert_same(fused, untied(lora.reference(name)["merged"], fused))


@pytest.mark.torch_ops
@pytest.mark.parametrize("name", ["verl", "dcp-hf"])
def test_files_that_agree_merge_as_peft_saved_them(lora, tmp_path, name):
    """The look-alike: adapter_config.json beside lora_train_meta.json, the same alpha and r in both."""
    spec, _ = lora.get(name)
    folder = lora.copy(name, tmp_path)
    _save_adapter_config(spec, folder)
    ref = lora.reference(name)
    fsdpfast.merge(folder, tmp_path / "out")
    assert_same(read_merged(tmp_path / "out" / "lora_adapter"), ref["adapters"]["default"])
    with open(tmp_path / "out" / "lora_adapter" / "adapter_config.json") as f:
        assert (json.load(f)["lora_alpha"], spec.lora_alpha) == (16, 16)
    fsdpfast.merge(folder, tmp_path / "fused", merge_lora=True)
    fused = read_merged(tmp_path / "fused")
    assert_same(fused, untied(ref["merged"], fused))


def test_r_the_files_disagree_on_is_refused(lora, tmp_path):
    spec, _ = lora.get("verl")
    folder = lora.copy("verl", tmp_path)
    _edit_meta(folder, r=4)
    _save_adapter_config(spec, folder)  # r 8, as the tensors
    cli_refuses(
        folder,
        tmp_path / "out",
        mentions=["adapter_config.json records r 8", "lora_train_meta.json records r 4", "--lora-r R"],
    )
    fsdpfast.merge(folder, tmp_path / "settled", lora_r=8)
    assert_same(read_merged(tmp_path / "settled" / "lora_adapter"), lora.reference("verl")["adapters"]["default"])


@pytest.mark.torch_ops
def test_a_recorded_r_the_tensors_contradict_is_refused(lora, tmp_path):
    """r 4 recorded, every lora_A of rank 8: the record is another training's (its alpha too), not half-trusted."""
    spec, _ = lora.get("verl")
    folder = lora.copy("verl", tmp_path)
    lora_a = "but its lora_A is [8, 64] (rank 8) (8 of 8 modules differ)"
    cli_refuses(folder, tmp_path / "flag", "--lora-r", 4, mentions=["--lora-r gives", lora_a, "give --lora-r 8"])
    _edit_meta(folder, r=4)
    cli_refuses(folder, tmp_path / "out", mentions=["lora_train_meta.json gives", "rank 4 (r)", lora_a])
    _save_adapter_config(spec, folder, r=4)  # both files say 4
    line = cli_refuses(folder, tmp_path / "out", "--merge-lora", mentions=["adapter_config.json gives", lora_a])
    assert "give --lora-r 8" in line
    api_refuses(folder, tmp_path / "out", mentions=["lora_r=8"])


@pytest.mark.torch_ops
def test_rank_pattern_is_checked_against_the_tensors(lora, tmp_path):
    """The rank-pattern checkpoint merges as peft saved it (the parametrized tests); a rank_pattern that
    gives v_proj another rank than its lora_A is refused naming it."""
    spec, _ = lora.get("rank-pattern")
    folder = lora.copy("rank-pattern", tmp_path)
    saved = Path(folder) / "lora_adapter"
    _save_adapter_config(spec, saved, rank_pattern={"v_proj": 8, "down_proj": 2})
    cli_refuses(
        folder,
        tmp_path / "out",
        mentions=["lora_adapter/adapter_config.json gives", "v_proj rank 8 (rank_pattern)", "(rank 4)", "correct or"],
    )
    _save_adapter_config(spec, saved, rank_pattern={"down_proj": 2})  # v_proj then has r, 8: not its 4
    cli_refuses(folder, tmp_path / "out", mentions=["v_proj rank 8 (r)", "(rank 4)"])
    _save_adapter_config(spec, saved)  # as trained, and --lora-r saying the same r
    ref = lora.reference("rank-pattern")
    fsdpfast.merge(folder, tmp_path / "fused", merge_lora=True, lora_r=8)
    assert_same(read_merged(tmp_path / "fused"), ref["merged"])


def _edit_adapter_config(folder: Path, **values) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


@pytest.mark.parametrize(
    "values, mentions",
    [
        ({"alpha_pattern": {"v_proj": "32"}}, ["alpha_pattern 'v_proj': '32' is not a positive number"]),
        ({"alpha_pattern": ["v_proj", 32]}, ["alpha_pattern", "is not an object"]),
        ({"target_parameters": ["mlp.experts.gate_up_proj"]}, ["records target_parameters", "is not merged"]),
    ],
    ids=["alpha-as-text", "alpha-pattern-a-list", "target-parameters"],
)
def test_an_adapter_config_fsdpfast_cannot_read_as_recorded_is_refused(lora, tmp_path, values, mentions):
    """A malformed alpha_pattern, and peft's LoRA on bare parameters (whose lora_A is not [r, in]), are one
    line each; the rank-pattern checkpoint as peft saved it merges (the parametrized tests above)."""
    spec, _ = lora.get("rank-pattern")
    folder = lora.copy("rank-pattern", tmp_path)
    _save_adapter_config(spec, Path(folder) / "lora_adapter")
    _edit_adapter_config(Path(folder) / "lora_adapter", **values)
    cli_refuses(folder, tmp_path / "out", mentions=mentions)


@pytest.mark.torch_ops
@pytest.mark.parametrize("flags", [[], ["--merge-lora"]])
def test_an_adapter_for_a_module_the_model_lacks_is_refused(lora, tmp_path, flags):
    """peft would drop such tensors on load without a word: refused, written or fused, naming the module."""
    folder = lora.copy("verl", tmp_path)
    _rename_module(folder, "q_proj", "qq_proj")
    line = cli_refuses(
        folder,
        tmp_path / "out",
        *flags,
        mentions=["model.layers.0.self_attn.qq_proj (lora_A [8, 64])", "LlamaForCausalLM built from", "1 more"],
    )
    assert "model.layers.1.self_attn.qq_proj.weight" in line
    os.remove(os.path.join(folder, "huggingface", "config.json"))  # then the checkpoint's base weights say
    cli_refuses(
        folder,
        tmp_path / "out",
        *flags,
        "--allow-extra-tensors",
        mentions=["qq_proj", "the checkpoint's base model does not have", "do not belong together"],
    )


def test_a_lora_only_adapter_for_a_module_the_model_lacks(lora, tmp_path):
    """No base weights: config.json's model decides; without config.json nothing can, and the note says so."""
    spec, _ = lora.get("verl-lora-only")
    folder = lora.copy("verl-lora-only", tmp_path)
    _rename_module(folder, "v_proj", "w_proj")
    cli_refuses(folder, tmp_path / "out", mentions=["model.layers.0.self_attn.w_proj", "LlamaForCausalLM"])
    cli_refuses(folder, tmp_path / "out", "--base", spec.base_folder(lora.root), mentions=["w_proj"])
    os.remove(os.path.join(folder, "huggingface", "config.json"))
    report = fsdpfast.merge(folder, tmp_path / "unchecked")
    assert any("modules were not checked against a model (no config.json" in n for n in report.notes)
    _, original = lora.get("verl-lora-only")
    report = fsdpfast.merge(original, tmp_path / "checked")  # the look-alike: every module the model's
    assert any("modules and copies checked against LlamaForCausalLM" in n for n in report.notes)
    assert_same(
        read_merged(tmp_path / "checked" / "lora_adapter"), lora.reference("verl-lora-only")["adapters"]["default"]
    )


@pytest.mark.torch_ops
def test_overwrite_replaces_the_adapter_folders_and_nothing_added_to_them(lora, tmp_path):
    """An earlier merge's adapter folders (nested: lora_adapter/second) are its own; a file put in one is not."""
    from refusals import run_cli, the_error_line, tree_digest

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
