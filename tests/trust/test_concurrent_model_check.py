"""The model check run beside the merge (pipeline.model_check): refusals exactly as before, the output as before.

Each run is `python -m fsdpfast` in a process of its own, which has not imported torch or
transformers, so on a cold cache (a cache folder of the test's own) the model is built in a child
process while the bytes are written, and waited for before publishing. A tiny checkpoint is
written in milliseconds and the child takes seconds, so the refusal comes after every byte is
written (the log says so, and in that order); on a warm cache it comes before any byte moves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import copy_checkpoint
from refusals import leftovers, run_cli_here, the_error_line

import fsdpfast
from fsdpfast.plan.model_check import FROM_CACHE

pytestmark = pytest.mark.slow  # each run starts a Python, and a cold one a child that imports transformers


def fsdpfast_cli(cache: Path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "FSDPFAST_CACHE_DIR": str(cache)}
    command = [sys.executable, "-m", "fsdpfast", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


def edit_config(folder: Path, **changes) -> None:
    path = folder / "huggingface" / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def test_a_wrong_config_is_refused_as_before_when_every_byte_is_written_first(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    edit_config(folder, num_hidden_layers=3)
    out = tmp_path / "merged"
    # the check as it ran before, in the plan: this process has transformers, so it builds the model at once
    refusal = the_error_line(run_cli_here("merge", folder, "--out", out))
    assert "do not match LlamaForCausalLM" in refusal and "weights missing" in refusal

    cold = fsdpfast_cli(tmp_path / "cold-cache", "merge", folder, "--out", out)
    assert the_error_line(cold) == refusal
    assert leftovers(out) == []  # nothing published, no staging folder left

    logged = fsdpfast_cli(tmp_path / "cache", "merge", folder, "--out", out, "-v")
    lines = logged.stderr.splitlines()
    assert logged.returncode == 2, logged.stderr
    wrote = next(i for i, line in enumerate(lines) if "rank 0 wrote" in line)
    built = next(i for i, line in enumerate(lines) if "model check built in a child process" in line)
    assert wrote < built and lines[-1] == refusal, logged.stderr
    assert leftovers(out) == []

    warm = fsdpfast_cli(tmp_path / "cache", "merge", folder, "--out", out, "-v")  # the model from the cache
    assert warm.returncode == 2 and not any("rank 0 wrote" in line for line in warm.stderr.splitlines())
    assert warm.stderr.splitlines()[-1] == refusal
    assert the_error_line(fsdpfast_cli(tmp_path / "cache", "merge", folder, "--out", out)) == the_error_line(cold)
    assert leftovers(out) == []


def test_a_tie_only_the_model_makes_has_the_merge_planned_again_with_it(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w3-bert-dim1", tmp_path)
    edit_config(folder, tie_word_embeddings=None)  # BERT ties its decoder by default: config.json need not say
    before = fsdpfast.merge(folder, tmp_path / "here")  # this process has transformers: built at plan time
    assert before.tied == {
        "bert.embeddings.word_embeddings.weight": ["cls.predictions.decoder.weight"],
        "cls.predictions.bias": ["cls.predictions.decoder.bias"],
    }
    cold = fsdpfast_cli(tmp_path / "cache", "merge", folder, "--out", tmp_path / "cold", "--json", "-v")
    assert cold.returncode == 0, cold.stderr
    assert "planned again with the model" in cold.stderr
    assert json.loads(cold.stdout)["tied"] == before.tied
    warm = fsdpfast_cli(tmp_path / "cache", "merge", folder, "--out", tmp_path / "warm", "--json")
    assert json.loads(warm.stdout)["tied"] == before.tied
    for out in ("cold", "warm"):
        assert (tmp_path / out / "model.safetensors").read_bytes() == (
            tmp_path / "here" / "model.safetensors"
        ).read_bytes()
        assert same_manifest(tmp_path / out, tmp_path / "here")
    assert leftovers(tmp_path / "cold") == ["cold"]


def same_manifest(a: Path, b: Path) -> bool:
    def read(folder):
        manifest = json.loads((folder / "fsdpfast-manifest.json").read_text())
        manifest.pop("written")  # sizes and mtimes of the files written
        return manifest

    return read(a) == read(b)


def test_dry_run_inspect_merge_and_verify_read_the_model_from_the_cache(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    cache, out = tmp_path / "cache", tmp_path / "merged"
    cold = fsdpfast_cli(cache, "merge", folder, "--out", out, "--dry-run", "--json")
    assert cold.returncode == 0, cold.stderr
    cold_plan = json.loads(cold.stdout)
    assert any("checked against LlamaForCausalLM" in n for n in cold_plan["notes"])
    assert not any(n.startswith(FROM_CACHE) for n in cold_plan["notes"])

    warm = fsdpfast_cli(cache, "merge", folder, "--out", out, "--dry-run", "--json")
    warm_plan = json.loads(warm.stdout)
    cached = [n for n in warm_plan["notes"] if n.startswith(FROM_CACHE)]
    assert len(cached) == 1 and str(cache) in cached[0]
    assert {**warm_plan, "notes": cold_plan["notes"]} == cold_plan  # the same plan, the note apart
    inspected = json.loads(fsdpfast_cli(cache, "inspect", folder, "--json").stdout)
    assert any(n.startswith(FROM_CACHE) for n in inspected["notes"])

    # a warm merge and dry run import neither torch nor transformers (the cpu engine needs neither)
    code = (
        "import json, sys\n"
        "import fsdpfast\n"
        "from fsdpfast.api import dry_run\n"
        f"plan = dry_run({str(folder)!r}, {str(out)!r})\n"
        f"report = fsdpfast.merge({str(folder)!r}, {str(out)!r}, engine='cpu')\n"
        "print(json.dumps({'notes': report.notes, 'plan': plan['notes'], "
        "'imported': sorted({'torch', 'transformers'} & set(sys.modules))}))\n"
    )
    env = {**os.environ, "FSDPFAST_CACHE_DIR": str(cache)}
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert ran.returncode == 0, ran.stderr
    found = json.loads(ran.stdout)
    assert found["imported"] == []
    assert any(n.startswith(FROM_CACHE) for n in found["notes"]) and any(
        n.startswith(FROM_CACHE) for n in found["plan"]
    )

    checked = fsdpfast_cli(cache, "verify", out, "--against", folder, "--json")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert json.loads(checked.stdout)["ok"]


def test_the_model_check_child_runs_no_code_from_the_working_folder(checkpoints, tmp_path):
    # `python -m` puts the current folder first on sys.path: a checkpoint folder's json.py would run
    # in the child that builds the model. It is started with -P from a neutral folder.
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    marker = tmp_path / "ran"
    (folder / "json.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise ImportError('not json')\n")
    env = {**os.environ, "FSDPFAST_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-P", "-m", "fsdpfast", "merge", ".", "--out", str(tmp_path / "out")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=folder)
    assert done.returncode == 0, done.stderr
    assert not marker.exists(), "a module of the working folder ran"
