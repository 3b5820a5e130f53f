"""Where and how the output folder is published: its mode under the user's umask, an existing
empty folder replaced in one rename, missing parents created (and removed again when nothing
is published). Merges of real FSDP2 checkpoints, checked bit for bit."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_bit_exact, load_reference, read_merged
from test_bad_input import leftovers, run_cli, the_error_line, tree_digest

import fsdpfast
import fsdpfast.api as api
import fsdpfast.execute.writer as writer


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def mkdir_mode(tmp_path: Path, umask: int) -> int:
    """The mode a plain `mkdir` gives under `umask`, made and measured (default ACLs included)."""
    probe = tmp_path / f"mkdir-probe-{umask:o}"
    subprocess.run(["mkdir", str(probe)], check=True, preexec_fn=lambda: os.umask(umask))
    return mode(probe)


def merge_cli(*args, umask: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdpfast", "merge", *map(str, args), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: os.umask(umask),
    )


def assert_is_the_model(checkpoints, out: Path, name: str = "w2-llama") -> None:
    spec, _ = checkpoints.get(name)
    reference, tied = load_reference(spec.reference_path(checkpoints.root))
    assert_bit_exact(read_merged(str(out)), reference, tied=tied)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002, 0o077])
def test_published_folder_has_the_mode_mkdir_gives(checkpoints, tmp_path, umask):
    _, folder = checkpoints.get("w2-llama")
    out = tmp_path / "merged"
    result = merge_cli(folder, "--out", out, umask=umask)
    assert result.returncode == 0, result.stderr
    assert mode(out) == mkdir_mode(tmp_path, umask)  # a serving account in the group (or others) can read the model
    for file in out.iterdir():
        assert mode(file) == 0o666 & ~umask, (file.name, oct(mode(file)))  # as `open()` / `touch` make files
    assert_is_the_model(checkpoints, out)


def test_empty_output_folder_is_replaced_and_keeps_its_mode(checkpoints, tmp_path):
    """Made ahead by the user (or a job script): no --overwrite needed, and its permissions stay."""
    _, folder = checkpoints.get("w2-llama")
    out = tmp_path / "merged"
    out.mkdir()
    os.chmod(out, 0o750)
    inode = os.stat(out).st_ino
    result = merge_cli(folder, "--out", out, umask=0o077)
    assert result.returncode == 0, result.stderr
    assert mode(out) == 0o750 and os.stat(out).st_ino != inode  # a new folder, renamed over the empty one
    assert leftovers(out) == [out.name]
    assert_is_the_model(checkpoints, out)


def test_missing_parents_are_created(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    out = tmp_path / "runs" / "step-100" / "hf"
    report = fsdpfast.merge(folder, out)
    assert report.out_dir == str(out)
    umask = os.umask(0)
    os.umask(umask)
    assert mode(tmp_path / "runs") == mkdir_mode(tmp_path, umask)
    assert sorted(p.name for p in (tmp_path / "runs" / "step-100").iterdir()) == ["hf"]  # no lock or staging left
    assert_is_the_model(checkpoints, out)


def test_dry_run_says_what_the_merge_will_do_with_the_output(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    empty = tmp_path / "empty"
    empty.mkdir()
    plan = api.dry_run(folder, empty)
    assert f"{empty} is an empty folder: the merge will replace it" in plan["notes"]
    plan = api.dry_run(folder, tmp_path / "a" / "b" / "out")
    assert f"{tmp_path / 'a' / 'b'} does not exist: the merge will create it" in plan["notes"]
    assert not (tmp_path / "a").exists()  # a dry run writes nothing


def test_interrupted_merge_removes_the_parents_it_made(checkpoints, tmp_path, monkeypatch):
    _, folder = checkpoints.get("w2-llama")
    real_write_file = writer.write_part

    def write_then_interrupt(*args, **kwargs):  # Ctrl-C after the first file is written
        real_write_file(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "write_part", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        fsdpfast.merge(folder, tmp_path / "new" / "deeper" / "out")
    assert not (tmp_path / "new").exists()  # output complete or absent, and nothing made for it is left


def test_files_put_in_the_empty_folder_during_the_merge_are_never_replaced(checkpoints, tmp_path, monkeypatch):
    _, folder = checkpoints.get("w2-llama")
    out = tmp_path / "merged"
    out.mkdir()
    real_write_file = writer.write_part

    def write_then_someone_writes_into_out(*args, **kwargs):
        result = real_write_file(*args, **kwargs)
        (out / "notes.txt").write_text("written meanwhile")
        return result

    monkeypatch.setattr(writer, "write_part", write_then_someone_writes_into_out)
    with pytest.raises(fsdpfast.BadInput, match="already exists and is not empty"):
        fsdpfast.merge(folder, out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "written meanwhile"
    assert leftovers(out) == [out.name]


def test_non_empty_folder_is_still_refused_without_overwrite(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    out = tmp_path / "merged"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    before = tree_digest(out)
    line = the_error_line(run_cli("merge", folder, "--out", out))
    assert "already exists and is not empty" in line and "--overwrite" in line
    assert tree_digest(out) == before
