"""Where and how the output folder is published: its mode under the user's umask, an existing
empty folder replaced in one rename, missing parents created (and removed again when nothing
is published), and --overwrite replacing only what an earlier merge's manifest lists (anything
else in the folder refused, or kept if it appears during the swap). Merges of real FSDP2
checkpoints, checked bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_bit_exact, load_reference, read_merged
from refusals import leftovers, run_cli, the_error_line, tree_digest

import fsdpfast
import fsdpfast.api as api
import fsdpfast.execute.writer as writer
from fsdpfast.manifest import MANIFEST_NAME

# Minutes of Python-only checks: CI runs them with the CPU torch, not again with the CUDA one (docs/development.md)
pytestmark = pytest.mark.slow


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


@pytest.mark.parametrize("where", ["making the job", "after making it", "writing the staging marker"])
def test_an_interrupt_just_after_the_staging_folder_is_made_leaves_nothing(checkpoints, tmp_path, monkeypatch, where):
    # the moment a watcher's SIGTERM lands when it has just seen the staging folder appear
    from fsdpfast.io import local_target
    from fsdpfast.pipeline import job, run

    _, folder = checkpoints.get("w2-llama")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    if where == "making the job":
        monkeypatch.setattr(job, "MergeJob", interrupted)
    elif where == "after making it":
        real_info = run.log.info
        monkeypatch.setattr(
            run.log,
            "info",
            lambda message, *a: interrupted() if message.startswith("planned") else real_info(message, *a),
        )
    else:
        monkeypatch.setattr(local_target, "write_marker", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fsdpfast.merge(folder, tmp_path / "out")
    assert os.listdir(tmp_path) == []  # no staging folder, no lock file


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


# --- --overwrite removes only what an earlier merge wrote --------------------------------------


def earlier_merge(checkpoints, tmp_path, name: str = "merged", **options) -> tuple[str, Path]:
    """(checkpoint, OUT): a real earlier merge of w2-llama (config, tokenizer files beside the weights)."""
    _, folder = checkpoints.get("w2-llama")
    out = tmp_path / name
    fsdpfast.merge(folder, out, **options)
    return folder, out


def entries(folder: Path) -> list[str]:
    """Every path below `folder`, links included (not followed)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def refused_and_kept(folder, out: Path, mentions) -> str:
    """`--overwrite` (command line and Python) refuses OUT in one line naming `mentions`; OUT, every
    entry in it and the checkpoint are as they were, and nothing is left beside OUT."""
    before, listed, source = tree_digest(out), entries(out), tree_digest(folder)
    line = the_error_line(run_cli("merge", folder, "--out", out, "--overwrite"))
    for text in mentions:
        assert str(text) in line, (text, line)
    with pytest.raises(fsdpfast.BadInput) as refused:
        fsdpfast.merge(folder, out, overwrite=True)
    assert "\n" not in str(refused.value)
    assert tree_digest(out) == before and entries(out) == listed and tree_digest(folder) == source
    assert leftovers(out) == [out.name]
    return line


def test_overwrite_refuses_a_merge_the_user_added_to(checkpoints, tmp_path):
    folder, out = earlier_merge(checkpoints, tmp_path, dtype="bf16")
    (out / "eval_results.json").write_text('{"accuracy": 0.5}')
    (out / "notes").mkdir()
    (out / "notes" / "run.md").write_text("keep me")
    line = refused_and_kept(folder, out, [out, "2 entries fsdpfast did not write (eval_results.json, notes/)"])
    assert "move them out" in line and "--overwrite" in line
    # the look-alike: the same earlier merge, nothing added, is replaced, and the result is the model
    (out / "eval_results.json").unlink()
    shutil.rmtree(out / "notes")
    result = run_cli("merge", folder, "--out", out, "--overwrite")
    assert result.returncode == 0, result.stderr
    assert_is_the_model(checkpoints, out)  # float32 now: the bf16 folder was replaced
    assert leftovers(out) == [out.name]


def test_overwrite_refuses_a_manifest_copied_among_other_models(checkpoints, tmp_path):
    """`cp -p merged/* ~/models/`: the manifest lists the copied files (times kept), not the models beside them."""
    folder, merged = earlier_merge(checkpoints, tmp_path)
    models = tmp_path / "models"
    models.mkdir()
    for file in merged.iterdir():
        shutil.copy2(file, models / file.name)
    shutil.copytree(merged, models / "llama-sft")  # other models: folders of safetensors
    (models / "qwen").mkdir()
    shutil.copy(merged / "model.safetensors", models / "qwen" / "model.safetensors")
    refused_and_kept(folder, models, [models, "2 entries fsdpfast did not write (llama-sft/, qwen/)"])


def _replace_a_listed_file(out: Path, other: Path) -> str:
    shutil.copy(other / "model.safetensors", out / "model.safetensors")  # another model of the same name
    return "model.safetensors ("


def _manifest_with_files_as_a_list(out: Path, other: Path) -> str:
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["files"] = []
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    return "'files' is a list; the manifest is damaged, so --overwrite cannot tell what in"


def _link_inside(out: Path, other: Path) -> str:
    (out / "latest").symlink_to(other)
    return "latest (a link)"


def _edit_the_manifest(out: Path, other: Path) -> str:
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["written"]["config.json"]["size"] = "big"
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    return "the manifest is damaged, so --overwrite cannot tell what in"


def _cut_the_manifest(out: Path, other: Path) -> str:
    (out / MANIFEST_NAME).write_bytes((out / MANIFEST_NAME).read_bytes()[:100])
    return "not JSON"


def _manifest_without_its_list(out: Path, other: Path) -> str:
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    del manifest["written"]
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    return "does not list the files of its folder"


def _manifest_as_a_link(out: Path, other: Path) -> str:
    (out / MANIFEST_NAME).unlink()
    (out / MANIFEST_NAME).symlink_to(other / MANIFEST_NAME)
    return "is a link, not a manifest a merge wrote"


@pytest.mark.parametrize(
    "change",
    [
        _replace_a_listed_file,
        _link_inside,
        _edit_the_manifest,
        _manifest_with_files_as_a_list,
        _cut_the_manifest,
        _manifest_without_its_list,
        _manifest_as_a_link,
    ],
)
def test_overwrite_refuses_what_the_manifest_does_not_vouch_for(checkpoints, tmp_path, change):
    folder, out = earlier_merge(checkpoints, tmp_path)
    _, other = earlier_merge(checkpoints, tmp_path, "other", dtype="bf16")  # a model of another size
    refused_and_kept(folder, out, [out, change(out, other)])


def test_overwrite_refuses_a_listed_file_replaced_by_one_of_the_same_size(checkpoints, tmp_path):
    """`cp other_run/model.safetensors merged/`: a same-architecture model has exactly its size."""
    folder, out = earlier_merge(checkpoints, tmp_path)
    _, other = earlier_merge(checkpoints, tmp_path, "other")
    assert (other / "model.safetensors").stat().st_size == (out / "model.safetensors").stat().st_size
    shutil.copyfile(other / "model.safetensors", out / "model.safetensors")  # as cp without -p: a new mtime
    refused_and_kept(folder, out, [out, "1 entry fsdpfast did not write (model.safetensors (modified"])
    assert (out / "model.safetensors").is_file()


def test_a_whole_copy_of_an_earlier_merge_that_keeps_the_times_stays_replaceable(checkpoints, tmp_path):
    """`cp -a merged copy` / `rsync -a` keep each file's size and mtime: --overwrite still replaces it."""
    folder, merged = earlier_merge(checkpoints, tmp_path, dtype="bf16")
    out = tmp_path / "copy"
    shutil.copytree(merged, out)  # copy2: times kept to the nanosecond
    result = run_cli("merge", folder, "--out", out, "--overwrite")
    assert result.returncode == 0, result.stderr
    assert_is_the_model(checkpoints, out)
    assert leftovers(out) == [out.name]


def test_dry_run_refuses_a_manifest_whose_files_is_a_list(checkpoints, tmp_path):
    folder, out = earlier_merge(checkpoints, tmp_path)
    _manifest_with_files_as_a_list(out, out)
    result = run_cli("merge", folder, "--out", out, "--overwrite", "--dry-run")
    assert result.returncode == 0 and not result.stderr, result.stderr  # no traceback: the plan says why
    assert "'files' is a list; the manifest is damaged, so --overwrite cannot tell what in" in result.stdout


def test_the_previous_folder_keeps_a_manifest_it_cannot_read(tmp_path):
    from fsdpfast.io.earlier_output import remove_written

    previous = tmp_path / "previous"
    previous.mkdir()
    (previous / "model.safetensors").write_bytes(b"x" * 10)
    (previous / MANIFEST_NAME).write_text("{ damaged")
    assert remove_written(str(previous)) == [MANIFEST_NAME, "model.safetensors"]
    assert (previous / MANIFEST_NAME).read_text() == "{ damaged"


def test_only_the_process_that_made_the_target_writes_the_manifest(tmp_path):
    from fsdpfast.io.local_target import LocalTarget
    from fsdpfast.io.output_guard import STAGING_MARKER

    target = LocalTarget(str(tmp_path / "out"), overwrite=False)
    try:
        joined = LocalTarget.join(str(tmp_path / "out"), target.token)
        with pytest.raises(RuntimeError, match="manifest"):
            joined.write_manifest({"tensors": {}})
        assert sorted(os.listdir(target.path)) == [STAGING_MARKER]
    finally:
        target.discard()


def test_files_in_the_output_folder_during_the_swap_keep_the_earlier_merge_and_say_where(
    checkpoints, tmp_path, monkeypatch
):
    """Someone makes OUT_DIR non-empty between the swap's renames: nothing is published, the earlier
    merge is kept (and named) where it was moved, and no later run removes it."""
    folder, out = earlier_merge(checkpoints, tmp_path, dtype="bf16")
    earlier = tree_digest(out)
    real_rename = os.rename

    def someone_makes_out(src, dst):
        real_rename(src, dst)
        if str(dst).endswith(os.sep + "previous"):
            out.mkdir()
            (out / "notes.md").write_text("mine")

    monkeypatch.setattr(os, "rename", someone_makes_out)
    with pytest.raises(fsdpfast.BadInput) as refused:
        fsdpfast.merge(folder, out, overwrite=True)
    monkeypatch.undo()
    (old,) = [name for name in leftovers(out) if name != out.name]
    kept = tmp_path / old / "previous"
    assert str(refused.value).endswith(f"nothing was published; the earlier merge is kept in {kept}")
    assert tree_digest(kept) == earlier and entries(out) == ["notes.md"]
    line = the_error_line(run_cli("merge", folder, "--out", out))  # a later run leaves it alone
    assert "already exists" in line
    assert tree_digest(kept) == earlier and entries(out) == ["notes.md"]


def test_overwrite_refuses_a_link_to_an_earlier_merge(checkpoints, tmp_path):
    folder, merged = earlier_merge(checkpoints, tmp_path)
    out = tmp_path / "current"
    out.symlink_to(merged)
    before = tree_digest(merged)
    line = the_error_line(run_cli("merge", folder, "--out", out, "--overwrite"))
    assert f"{out} is a link to {merged}" in line and "give the folder it points to" in line
    assert out.is_symlink() and tree_digest(merged) == before


@pytest.mark.parametrize("options", [{}, {"dtype": "bf16", "max_shard_size": "40KB"}])
def test_overwrite_replaces_every_file_an_earlier_merge_wrote(checkpoints, tmp_path, options):
    """Weights, index, config.json with its dtype, generation config, tokenizer files, manifest."""
    folder, out = earlier_merge(checkpoints, tmp_path, **options)
    written = sorted(p.name for p in out.iterdir())
    assert {"config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(written)
    assert ("model.safetensors.index.json" in written) == bool(options)
    listed = json.loads((out / MANIFEST_NAME).read_text())["written"]
    assert sorted(listed) == sorted(set(written) - {MANIFEST_NAME})
    assert all(
        listed[name] == {"size": (out / name).stat().st_size, "mtime_ns": (out / name).stat().st_mtime_ns}
        for name in listed
    )
    assert len([n for n in written if n.endswith(".safetensors")]) == (1 if not options else len(written) - 6)
    report = fsdpfast.merge(folder, out, overwrite=True)  # float32, one file
    assert report.files == ["model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        {n for n in written if not n.startswith("model")} | {"model.safetensors"}
    )
    assert_is_the_model(checkpoints, out)
    assert leftovers(out) == [out.name]


def test_overwrite_replaces_a_live_saves_folder(checkpoints, tmp_path):
    """save_pretrained's folder (its tokenizer's files too) is an earlier output like a merge's."""
    from helpers import tiny_tokenizer

    from fsdpfast._testing.fsdp2_writer import CheckpointSpec, build_model

    _, folder = checkpoints.get("w2-llama")
    out = tmp_path / "merged"
    fsdpfast.save_pretrained(build_model(CheckpointSpec("live", seed=61)), out, tokenizer=tiny_tokenizer())
    assert (out / "tokenizer.json").is_file()
    result = run_cli("merge", folder, "--out", out, "--overwrite")
    assert result.returncode == 0, result.stderr
    assert not (out / "tokenizer.json").exists()
    assert_is_the_model(checkpoints, out)
    assert leftovers(out) == [out.name]


@pytest.mark.parametrize("moment", ["after the check", "into the folder moved aside"])
def test_a_file_added_during_the_swap_is_kept(checkpoints, tmp_path, monkeypatch, caplog, moment):
    """Between the last check and the removal of the previous OUT_DIR only the listed files go."""
    folder, out = earlier_merge(checkpoints, tmp_path, dtype="bf16")
    real_rename = os.rename

    def someone_writes(src, dst):
        if moment == "after the check" and str(src) == str(out):
            (out / "eval_results.json").write_text("written meanwhile")
        real_rename(src, dst)
        if moment == "into the folder moved aside" and str(dst).endswith(os.sep + "previous"):
            (Path(dst) / "eval_results.json").write_text("written meanwhile")

    monkeypatch.setattr(os, "rename", someone_writes)
    report = fsdpfast.merge(folder, out, overwrite=True)
    monkeypatch.undo()
    assert_is_the_model(checkpoints, out)
    (old,) = [name for name in leftovers(out) if name != out.name]
    kept = tmp_path / old / "previous"
    assert [p.name for p in kept.iterdir()] == ["eval_results.json"]  # the earlier merge's files are gone
    assert (kept / "eval_results.json").read_text() == "written meanwhile"
    assert report.warnings == [
        f"eval_results.json appeared in {out} while it was being replaced: not written by fsdpfast, kept in {kept}"
    ]
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == report.warnings  # logged too
    assert not fsdpfast.merge(folder, out, overwrite=True).warnings  # a later run leaves the kept folder alone
    assert [p.name for p in kept.iterdir()] == ["eval_results.json"]
