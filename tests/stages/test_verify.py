"""verify, the manifest and the merge's own checks, on real FSDP2 / DCP checkpoints.

A fresh merge verifies clean (manifest, recomputed from the shards, reference, smoke); one
flipped bit in an output file is caught and named by each check; a source touched after the
merge is reported, and one changed during the merge aborts it with nothing published.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import copy_checkpoint, read_merged

import fsdpfast
from fsdpfast import _ops
from fsdpfast.errors import EXIT_BAD_INPUT, EXIT_MISMATCH
from fsdpfast.execute import writer
from fsdpfast.io.safetensors_folder import read_folder
from fsdpfast.manifest import MANIFEST_NAME, SourceChanged
from fsdpfast.verify import verify

needs_native = pytest.mark.skipif(not _ops.native_cpu(), reason="checksums need the native extension")


def run_cli(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdpfast", *map(str, args)], capture_output=True, text=True, timeout=300, **kwargs
    )


def crc32c_reference(data: bytes) -> int:
    """CRC-32C the textbook way (table of the reflected Castagnoli polynomial), independent of csrc/."""
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    crc = 0xFFFFFFFF
    for byte in data:
        crc = (crc >> 8) ^ table[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


def flip_bit(out_dir: Path, tensor: str, byte: int, bit: int = 3) -> None:
    """Flip one bit of `tensor`'s data in the merged file, at `byte` from the tensor's start."""
    stored = read_folder(str(out_dir))[tensor]
    with open(out_dir / stored.file, "r+b") as f:
        f.seek(stored.byte_offset + byte)
        value = f.read(1)[0]
        f.seek(stored.byte_offset + byte)
        f.write(bytes([value ^ (1 << bit)]))


# --- the checksum ---------------------------------------------------------------------------


@needs_native
def test_crc32c_known_answer_and_continuation():
    assert _ops.crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    data = (
        torch.randint(0, 256, (100_003,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
        .numpy()
        .tobytes()
    )
    whole = _ops.crc32c(data)
    assert whole == crc32c_reference(data)
    assert _ops.crc32c(data[40_001:], _ops.crc32c(data[:40_001])) == whole


@pytest.mark.slow
@pytest.mark.torch_ops
@needs_native
@pytest.mark.parametrize("chunk_bytes", [64, 200, 4096])
def test_chunked_checksums_combine_to_the_whole_tensors(checkpoints, tmp_path, chunk_bytes):
    """The native engine's per-chunk CRCs, combined, equal the torch engine's CRC of whole tensors."""
    from fsdpfast.execute.cpu import NativeCpuEngine
    from fsdpfast.execute.torch_engine import TorchEngine
    from fsdpfast.execute.writer import write_file
    from fsdpfast.io.sources import SourceFiles
    from fsdpfast.plan.layout import plan_files

    _, folder = checkpoints.get("w3-bert-dim1")
    plan = fsdpfast.plan_merge(folder, dtype="bf16")
    results = []
    for name, engine in (("torch", TorchEngine()), ("cpu", NativeCpuEngine(chunk_bytes=chunk_bytes))):
        (tmp_path / name).mkdir()
        checksums = {}
        with SourceFiles(plan.sources) as sources:
            for planned in plan_files(plan, "40KB"):
                checksums.update(write_file(str(tmp_path / name / planned.name), planned, engine, sources))
        results.append(checksums)
    assert results[0] == results[1]
    merged = read_merged(str(tmp_path / "cpu"))
    assert results[1].keys() == merged.keys()
    for name, tensor in merged.items():
        assert results[1][name] == crc32c_reference(tensor.contiguous().view(torch.uint8).numpy().tobytes()), name


# --- a fresh merge verifies --------------------------------------------------------------------


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("name,dtype", [("w2-tied-bf16", "keep"), ("w3-bert-dim1", "bf16"), ("w2-dcp", "fp16")])
def test_fresh_merge_verifies_and_its_manifest_matches_the_files(checkpoints, tmp_path, name, dtype):
    _, folder = checkpoints.get(name)
    out = tmp_path / "out"
    fsdpfast.merge(folder, out, dtype=dtype, max_shard_size="40KB")
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    merged = read_merged(str(out))
    assert manifest["checksum"] == "crc32c" and manifest["layout"] == fsdpfast.inspect(folder)["layout"]
    assert set(manifest["tensors"]) == set(merged)
    for tensor_name, tensor in merged.items():
        entry = manifest["tensors"][tensor_name]
        assert int(entry["crc32c"], 16) == crc32c_reference(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        assert entry["shape"] == list(tensor.shape) and entry["nbytes"] == tensor.numel() * tensor.element_size()
    sources = sorted({os.path.relpath(s.path, folder) for s in fsdpfast.plan_merge(folder).sources})
    assert [s["path"] for s in manifest["sources"]] == sources
    assert all(s["size"] == os.path.getsize(os.path.join(folder, s["path"])) for s in manifest["sources"])
    for options in ({}, {"against": folder}, {"reference": out}):
        report = verify(out, **options)
        assert report.ok, report.summary()
        assert report.bytes_checked == sum(t.numel() * t.element_size() for t in merged.values())


@pytest.mark.slow
def test_cli_verify_against_without_manifest_and_json(checkpoints, tmp_path):
    """--against recomputes from the shards even with the manifest gone; --json lists the checks."""
    _, folder = checkpoints.get("w3-dcp-safetensors")
    out = tmp_path / "out"
    fsdpfast.merge(folder, out, dtype="bf16")
    (out / MANIFEST_NAME).unlink()
    result = run_cli("verify", out, "--against", folder, "--json")
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["ok"] and found["mismatches"] == [] and found["tensors"] == len(read_folder(str(out)))
    alone = run_cli("verify", out)  # nothing to check against
    assert alone.returncode == EXIT_BAD_INPUT and alone.stderr.count("\n") == 1 and "--against" in alone.stderr


# --- one flipped bit is caught ---------------------------------------------------------------


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("engine", ["cpu", "torch"])
def test_a_flipped_bit_is_named_by_every_check(checkpoints, tmp_path, engine):
    _, folder = checkpoints.get("w4-hsdp-bert-dim1")
    good, bad = tmp_path / "good", tmp_path / "bad"
    fsdpfast.merge(folder, good, engine=engine, max_shard_size="40KB")
    fsdpfast.merge(folder, bad, engine=engine, max_shard_size="40KB")
    target = "bert.encoder.layer.1.attention.self.value.weight"
    flip_bit(bad, target, byte=1001)
    element = 1001 // 4
    for options in ([], ["--against", folder], ["--reference", good]):
        result = run_cli("verify", bad, *options)
        assert result.returncode == EXIT_MISMATCH, (options, result.stdout, result.stderr)
        mismatch_lines = [line for line in result.stdout.splitlines() if line.startswith("mismatch:")]
        assert len(mismatch_lines) == 1 and target in mismatch_lines[0], result.stdout
        if options:  # recomputed or compared bytes: the exact place
            assert f"element {element}, byte 1001" in mismatch_lines[0]
        assert "FAILED, 1 mismatch:" in result.stdout.splitlines()[-1]
    assert run_cli("verify", good, "--against", folder).returncode == 0


# --- reference with tolerances, smoke ----------------------------------------------------------


def test_reference_exact_by_default_tolerances_on_request(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    fsdpfast.merge(folder, tmp_path / "fp32")
    fsdpfast.merge(folder, tmp_path / "bf16", dtype="bf16")
    exact = verify(tmp_path / "bf16", reference=tmp_path / "fp32")
    assert not exact.ok and all("the reference has float32" in m.what for m in exact.mismatches)
    assert len(exact.mismatches) == exact.tensors
    assert verify(tmp_path / "bf16", reference=tmp_path / "fp32", rtol=1 / 128).ok  # bf16 rounding: < 2^-8 relative
    strict = verify(tmp_path / "bf16", reference=tmp_path / "fp32", rtol=1e-6)
    assert not strict.ok and all("not within tolerance" in m.what for m in strict.mismatches)
    # One value pushed far off (the highest exponent bit of a bf16 element) fails even the loose check.
    flip_bit(tmp_path / "bf16", "model.norm.weight", byte=2 * 5 + 1, bit=6)
    loose = verify(tmp_path / "bf16", reference=tmp_path / "fp32", rtol=1 / 128)
    assert [(m.tensor, m.element) for m in loose.mismatches] == [("model.norm.weight", 5)]


@pytest.mark.slow
def test_smoke_passes_on_a_good_merge_and_fails_on_nan(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    out = tmp_path / "out"
    fsdpfast.merge(folder, out)
    good = run_cli("verify", out, "--smoke")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "smoke" in good.stdout and "OK" in good.stdout
    stored = read_folder(str(out))["model.layers.1.mlp.down_proj.weight"]
    with open(out / stored.file, "r+b") as f:  # one NaN among the weights spreads to the logits
        f.seek(stored.byte_offset + 4 * 17)
        f.write(torch.tensor([float("nan")], dtype=torch.float32).numpy().tobytes())
    poisoned = run_cli("verify", out, "--smoke", "--json")
    assert poisoned.returncode == EXIT_MISMATCH
    problems = [m["what"] for m in json.loads(poisoned.stdout)["mismatches"]]
    assert any("not finite" in p for p in problems), problems


# --- sources changed ----------------------------------------------------------------------------


@needs_native
def test_a_source_touched_after_the_merge_is_reported(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    out = tmp_path / "out"
    fsdpfast.merge(folder, out)
    assert verify(out).notes == []
    touched = folder / "model_world_size_2_rank_1.pt"
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    for options in ({}, {"against": folder}):
        report = verify(out, **options)
        assert report.ok  # the output is still what was merged (and the bytes did not change)
        assert any("changed since the merge" in n and touched.name in n for n in report.notes), report.notes


@pytest.mark.parametrize("read_mode", ["mmap", "pread"])
@pytest.mark.parametrize("change", ["mtime", "size"])
def test_a_source_changing_during_the_merge_aborts_it(checkpoints, tmp_path, monkeypatch, change, read_mode):
    """The first output file is written, then a rank file changes: nothing is published (the sources
    mapped or read with preads, io.read_modes)."""
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    victim = folder / "model_world_size_2_rank_0.pt"
    real_write_file = writer.write_part
    written = []

    def write_then_change(*args, **kwargs):
        result = real_write_file(*args, **kwargs)
        if not written:  # after the first file: what a trainer still writing the checkpoint does
            if change == "size":
                with open(victim, "ab") as f:
                    f.write(b"\0" * 16)
            else:
                st = victim.stat()
                os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        written.append(args[0])
        return result

    monkeypatch.setattr(writer, "write_part", write_then_change)
    out = tmp_path / "out"
    with pytest.raises(SourceChanged, match=victim.name):
        fsdpfast.merge(folder, out, max_shard_size="40KB", read_mode=read_mode)
    assert len(written) == 1  # aborted at once, not at the end
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


# --- seeing the work: progress, -v, --json, --dry-run ----------------------------------------------


def _merge_on_terminal(folder, out, *options) -> str:
    """Run a merge with a pseudo-terminal as stderr; what the terminal received."""
    import pty

    controller, terminal = pty.openpty()
    env = {**os.environ, "FSDPFAST_PROGRESS_AFTER": "0"}  # draw at once: the test merge is small
    result = subprocess.run(
        [sys.executable, "-m", "fsdpfast", "merge", str(folder), "--out", str(out), *options],
        stdout=subprocess.PIPE,
        stderr=terminal,
        env=env,
        timeout=300,
    )
    os.close(terminal)
    received = b""
    while True:
        try:
            data = os.read(controller, 65536)
        except OSError:  # the terminal side is closed and drained
            break
        if not data:
            break
        received += data
    os.close(controller)
    assert result.returncode == 0
    return received.decode(errors="replace")


@pytest.mark.slow
def test_progress_bar_only_on_a_terminal_and_not_with_quiet(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    shown = _merge_on_terminal(folder, tmp_path / "a")
    assert "GB/s" in shown and "ETA" in shown and "[####" in shown, shown
    assert "GB/s" not in _merge_on_terminal(folder, tmp_path / "b", "--quiet")
    piped = run_cli("merge", folder, "--out", tmp_path / "c", env={**os.environ, "FSDPFAST_PROGRESS_AFTER": "0"})
    assert piped.returncode == 0 and piped.stderr == ""


@pytest.mark.slow
def test_verbose_logs_decisions_and_json_reports(checkpoints, tmp_path):
    _, folder = checkpoints.get("w3-llama")
    result = run_cli("merge", folder, "--out", tmp_path / "out", "--json", "-v", "--max-shard-size", "40KB")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert "layout fsdp-ranks, world size 3" in result.stderr and f"engine {report['engine']}" in result.stderr
    stored = read_folder(str(tmp_path / "out"))
    for name, tensor in stored.items():  # every tensor's file and byte offset is logged
        assert f"{name} -> {tensor.file} at byte {tensor.byte_offset} " in result.stderr


@pytest.mark.slow
def test_dry_run_prints_the_plan_and_writes_nothing(checkpoints, tmp_path):
    _, folder = checkpoints.get("w3-bert-dim1")
    planned = run_cli(
        "merge", folder, "--out", tmp_path / "out", "--dtype", "bf16", "--max-shard-size", "40KB", "--dry-run", "--json"
    )
    assert planned.returncode == 0, planned.stderr
    assert os.listdir(tmp_path) == []  # no output folder, no staging folder
    text = run_cli("merge", folder, "--out", tmp_path / "out", "--dry-run")
    assert text.returncode == 0 and "nothing written" in text.stdout and os.listdir(tmp_path) == []
    plan = json.loads(planned.stdout)
    fsdpfast.merge(folder, tmp_path / "out", dtype="bf16", max_shard_size="40KB")
    stored = read_folder(str(tmp_path / "out"))
    promised = {
        t["name"]: (f["name"], t["offset"], t["bytes"], t["dtype"], tuple(t["shape"]))
        for f in plan["files"]
        for t in f["tensors"]
    }
    assert promised == {n: (s.file, s.byte_offset, s.nbytes, s.dtype, s.shape) for n, s in stored.items()}
    assert {f["name"]: f["bytes"] for f in plan["files"]} == {
        f: (tmp_path / "out" / f).stat().st_size for f in {s.file for s in stored.values()}
    }
    for name in promised:
        assert name in text.stdout


@pytest.mark.slow
def test_verify_of_a_folder_that_is_not_a_merge_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_cli("verify", tmp_path / "empty")
    assert result.returncode == EXIT_BAD_INPUT and result.stderr.count("\n") == 1 and ".safetensors" in result.stderr


@pytest.mark.slow
@pytest.mark.torch_ops
@needs_native
def test_a_later_merge_is_checked_against_an_earlier_manifest(checkpoints, tmp_path):
    """Split differently and by another engine, a re-merge of the same checkpoint matches the old
    manifest; a merge of another checkpoint of the same model (other seed) does not."""
    _, folder = checkpoints.get("w3-llama")
    _, other = checkpoints.get("w2-llama")
    fsdpfast.merge(folder, tmp_path / "first", dtype="bf16", max_shard_size="40KB", engine="torch")
    old_manifest = tmp_path / "first" / MANIFEST_NAME
    fsdpfast.merge(folder, tmp_path / "again", dtype="bf16", engine="cpu")
    same = verify(tmp_path / "again", manifest_of=old_manifest)
    assert same.ok and same.notes == [] and same.bytes_checked > 0, same.summary()
    fsdpfast.merge(other, tmp_path / "other", dtype="bf16")
    result = run_cli("verify", tmp_path / "other", "--manifest", tmp_path / "first", "--json")
    assert result.returncode == EXIT_MISMATCH
    found = json.loads(result.stdout)
    ours, theirs = read_merged(str(tmp_path / "first")), read_merged(str(tmp_path / "other"))
    differing = {n for n in ours if not torch.equal(ours[n].view(torch.uint8), theirs[n].view(torch.uint8))}
    assert differing and {m["tensor"] for m in found["mismatches"]} == differing  # (norm weights start as ones in both)
    assert any("different source files" in n for n in found["notes"])


@pytest.mark.slow
def test_a_truncated_output_file_fails_verify(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    out = tmp_path / "out"
    fsdpfast.merge(folder, out)
    path = out / "model.safetensors"
    os.truncate(path, path.stat().st_size - 100)
    result = run_cli("verify", out)
    assert result.returncode == EXIT_MISMATCH and "truncated" in result.stdout, result.stdout + result.stderr
