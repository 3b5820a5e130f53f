"""The byte checks read through the merge's Source: the tie check, the copies check and
`verify --against` refuse or pass the same under --read-mode mmap and pread, and under pread they
read with preads (not through a mapping); the concurrent model check refuses a wrong config under
pread as it does mapped, after every byte is written: exit 2, nothing published, no staging left."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import copy_checkpoint
from refusals import cli_refuses, edit_state_dict, leftovers, run_cli_here, the_error_line

import fsdpfast
from fsdpfast.io import sources as source_module
from fsdpfast.io.pread_sources import PreadSources

pytestmark = pytest.mark.slow  # each test merges real checkpoints, some in a process of their own

BUFFER = "fsdpfast_probe_buffer"  # (3, 4), held whole by every rank (CheckpointSpec.buffer)


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """The kind of each Source opened in this process, in order."""
    found: list[str] = []
    real = source_module.open_sources

    def counted(buffers, read_mode="mmap"):
        found.append(read_mode)
        return real(buffers, read_mode)

    monkeypatch.setattr(source_module, "open_sources", counted)
    for module in ("fsdpfast.checks.tensor_bytes", "fsdpfast.verify.against", "fsdpfast.pipeline.job"):
        monkeypatch.setattr(sys.modules[module], "open_sources", counted, raising=False)
    return found


def edit_config(folder, **changes) -> None:
    path = folder / "huggingface" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("mode", ["mmap", "pread"])
def test_a_tie_whose_bytes_differ_is_refused_in_both_modes(checkpoints, tmp_path, opened, mode):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)  # trained untied
    edit_config(folder, tie_word_embeddings=True)
    cli_refuses(
        folder,
        tmp_path / "out",
        "--read-mode",
        mode,
        mentions=["ties lm_head.weight to model.embed_tokens.weight", "differ from element 0 on"],
    )
    assert opened and set(opened) == {mode}, opened


@pytest.mark.parametrize("mode", ["mmap", "pread"])
def test_buffer_copies_that_differ_are_refused_in_both_modes(checkpoints, tmp_path, opened, mode):
    folder = copy_checkpoint(checkpoints, "w2-guide-local-buffer", tmp_path)

    def add_one(state: dict) -> None:
        value = state[BUFFER]
        (value._local_tensor if hasattr(value, "_local_tensor") else value).view(-1)[5] += 1

    edit_state_dict(folder / "model_pt_rank_1.pt", add_one)
    cli_refuses(
        folder, tmp_path / "out", "--allow-extra-tensors", "--read-mode", mode, mentions=[BUFFER, "first at element 5"]
    )
    assert opened == [mode], opened


@pytest.mark.parametrize("mode", ["mmap", "pread"])
def test_verify_against_reads_as_asked_and_finds_a_changed_byte(checkpoints, tmp_path, opened, mode):
    _, folder = checkpoints.get("w4-hsdp-tied")  # copies held twice: compared in full by verify
    out = tmp_path / "merged"
    fsdpfast.merge(folder, out, dtype="bf16", read_mode="mmap")
    opened.clear()
    assert fsdpfast.verify(out, against=folder, read_mode=mode).ok
    assert opened and set(opened) == {mode}, opened
    shard = next(p for p in sorted(out.iterdir()) if p.suffix == ".safetensors")
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0x01  # the last tensor's last element
    shard.write_bytes(bytes(data))
    report = fsdpfast.verify(out, against=folder, read_mode=mode)
    assert not report.ok and any("bytes differ from the checkpoint's" in m.what for m in report.mismatches)


def test_verify_on_the_command_line_reads_as_asked(checkpoints, tmp_path, opened):
    _, folder = checkpoints.get("w2-llama")
    out = tmp_path / "merged"
    fsdpfast.merge(folder, out, read_mode="mmap")
    opened.clear()
    done = run_cli_here("verify", out, "--against", folder, "--read-mode", "pread")
    assert done.returncode == 0, done.stderr
    assert opened and set(opened) == {"pread"}, opened


def test_preads_read_only_the_compared_windows(checkpoints, tmp_path, monkeypatch):
    """A check announces its windows: a pread Source reads those bytes, not whole rank files."""
    read: list[int] = []
    real = PreadSources._read

    def counted(self, index, memory, start, end):
        read.append(end - start)
        return real(self, index, memory, start, end)

    monkeypatch.setattr(PreadSources, "_read", counted)
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    edit_config(folder, tie_word_embeddings=True)
    cli_refuses(folder, tmp_path / "out", "--read-mode", "pread", mentions=["ties lm_head.weight"])
    sizes = sum(os.path.getsize(p) for p in folder.iterdir() if p.suffix == ".pt")
    assert 0 < sum(read) < sizes / 2, (sum(read), sizes)


def test_a_wrong_config_is_refused_under_pread_after_every_byte_is_written(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    edit_config(folder, num_hidden_layers=3)
    out = tmp_path / "merged"
    env = {**os.environ, "FSDPFAST_CACHE_DIR": str(tmp_path / "cold-cache")}  # the model built in the child
    command = [sys.executable, "-m", "fsdpfast", "merge", str(folder), "--out", str(out), "-v"]
    found = {}
    for mode in ("mmap", "pread"):
        run = subprocess.run(command + ["--read-mode", mode], capture_output=True, text=True, timeout=600, env=env)
        lines = run.stderr.splitlines()
        assert run.returncode == 2, run.stderr
        assert "do not match LlamaForCausalLM" in lines[-1] and "weights missing" in lines[-1], run.stderr
        found[mode] = lines[-1]
        assert leftovers(out) == []  # nothing published, no staging folder left
        if mode == "pread":
            wrote = next(i for i, line in enumerate(lines) if "rank 0 wrote" in line)
            assert any("sources read with pread" in line for line in lines[:wrote]), run.stderr
        env["FSDPFAST_CACHE_DIR"] = str(tmp_path / f"cold-cache-{mode}")
    assert found["pread"] == found["mmap"]
    quiet = subprocess.run(
        command[:-1] + ["--read-mode", "pread"], capture_output=True, text=True, timeout=600, env=env
    )
    assert the_error_line(quiet) == found["mmap"]
    assert leftovers(out) == []
