"""Faults around a merge: killed runs, a full disk, unwritable or misplaced outputs, concurrent
merges, symbolic links. Each checks the contract: OUT_DIR complete or absent, nothing left
beside it, the checkpoint byte for byte as it was, and one clear line for the user.

A merge is paused deterministically by running the real command line in a child process
whose `fsdpfast.execute.writer.write_part` (or `os.rename`, for the --overwrite swap) is wrapped to
stop after the real call and wait: test-only wrapping in the child, nothing in fsdpfast.
An interrupt (KeyboardInterrupt, as Ctrl-C and SIGTERM arrive) at each rename of the
--overwrite swap is injected in-process the same way, by wrapping `os.rename`.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import assert_bit_exact, copy_checkpoint, load_reference, rank_file, read_merged
from refusals import assert_mentions, cli_refuses, leftovers, run_cli, the_error_line, tree_digest

import fsdpfast
from fsdpfast.cli import main
from fsdpfast.errors import EXIT_FAILURE
from fsdpfast.io.output_guard import STAGING_MARKER, lock_path

# The real CLI, held after the first output file is written (`file`), after the previous
# OUT_DIR was moved aside by --overwrite (`swap`), after the new one took its place (`renamed`)
# or once that was recorded beside the previous one (`published`), until the test deletes the
# ready file.
HELD_CLI = r"""
import os, sys, time
import fsdpfast.execute.writer as writer
from fsdpfast.cli import main

ready, point = os.environ["FSDPFAST_TEST_READY"], os.environ["FSDPFAST_TEST_HOLD_AT"]

def hold():
    open(ready, "w").close()
    while os.path.exists(ready):
        time.sleep(0.01)

if point == "file":
    real_write_file = writer.write_part
    def write_file_then_hold(*args, **kwargs):
        result = real_write_file(*args, **kwargs)
        writer.write_part = real_write_file
        hold()
        return result
    writer.write_part = write_file_then_hold
elif point == "published":
    import fsdpfast.io.local_target as staging
    real_write_marker = staging.write_marker
    def write_marker_then_hold(folder, marker, out_dir):
        real_write_marker(folder, marker, out_dir)
        if marker == staging.PUBLISHED_MARKER:
            hold()
    staging.write_marker = write_marker_then_hold
else:
    real_rename = os.rename
    def rename_then_hold(src, dst):
        real_rename(src, dst)
        moved_aside = str(dst).endswith(os.sep + "previous")
        if moved_aside == (point == "swap"):  # "renamed": the new folder renamed into place
            hold()
    os.rename = rename_then_hold
sys.exit(main(sys.argv[1:]))
"""


class HeldMerge:
    """`fsdpfast merge SRC --out OUT ...` in a child, paused at `point` once it gets there."""

    def __init__(self, tmp_path: Path, src, out, *options, point: str = "file"):
        self.ready = tmp_path / f"ready-{out.name}"
        env = {**os.environ, "FSDPFAST_TEST_READY": str(self.ready), "FSDPFAST_TEST_HOLD_AT": point}
        self.process = subprocess.Popen(
            [sys.executable, "-c", HELD_CLI, "merge", str(src), "--out", str(out), *map(str, options)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 120
        while not self.ready.exists():
            if self.process.poll() is not None:
                raise AssertionError(f"the merge ended before pausing: {self.process.communicate()}")
            assert time.monotonic() < deadline, "the merge never reached the pause"
            time.sleep(0.01)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        assert self.process.wait(timeout=60) == -signal.SIGKILL

    def resume(self) -> subprocess.CompletedProcess:
        self.ready.unlink()
        stdout, stderr = self.process.communicate(timeout=300)
        return subprocess.CompletedProcess(self.process.args, self.process.returncode, stdout, stderr)


def reference_of(checkpoints, name: str):
    spec, _ = checkpoints.get(name)
    return load_reference(spec.reference_path(checkpoints.root))


def staging_folders(out: Path) -> list[Path]:
    return sorted(p for p in out.parent.glob(f".{out.name}.fsdpfast-*") if p.is_dir())


# --- killed mid-merge -------------------------------------------------------------------------


@pytest.mark.slow
def test_killed_mid_merge_leaves_no_output_and_the_next_run_cleans_up(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    before = tree_digest(folder)
    out = tmp_path / "merged"
    held = HeldMerge(tmp_path, folder, out, "--max-shard-size", "20KB")  # several files: killed between them
    (staging,) = staging_folders(out)
    assert any(name.endswith(".safetensors") for name in os.listdir(staging)), "killed before any file was written"
    held.kill()

    assert not out.exists()
    assert staging.is_dir() and (staging / STAGING_MARKER).is_file()  # SIGKILL leaves these behind
    assert os.path.exists(lock_path(str(out)))  # and the lock file, whose lock died with the process

    result = run_cli("merge", folder, "--out", out, "--max-shard-size", "20KB")
    assert result.returncode == 0, result.stderr
    assert leftovers(out) == [out.name]  # the killed run's staging folder and lock file are gone
    assert not (out / STAGING_MARKER).exists()
    reference, tied = reference_of(checkpoints, "w2-llama")
    assert_bit_exact(read_merged(out), reference, tied=tied)
    assert tree_digest(folder) == before


@pytest.mark.slow
def test_terminated_mid_merge_cleans_up_on_the_way_out(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    out = tmp_path / "merged"
    held = HeldMerge(tmp_path, folder, out, "--max-shard-size", "20KB")
    held.process.send_signal(signal.SIGTERM)
    stdout, stderr = held.process.communicate(timeout=60)
    assert held.process.returncode == 130, stderr
    assert stderr.splitlines() == ["fsdpfast: interrupted; nothing was published"]
    assert not leftovers(out), leftovers(out)


@pytest.mark.slow
def test_killed_during_the_overwrite_swap_gets_the_previous_output_back(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    out = tmp_path / "merged"
    fsdpfast.merge(folder, out, dtype="bf16")  # --overwrite replaces only an earlier merge (or an empty folder)
    earlier = tree_digest(out)
    held = HeldMerge(tmp_path, folder, out, "--overwrite", point="swap")
    held.kill()
    assert not out.exists()  # killed between moving the old folder aside and renaming the new one in

    # The next run puts the earlier output back before anything else; without --overwrite it then stops.
    line = the_error_line(run_cli("merge", folder, "--out", out))
    assert_mentions(line, [out, "already exists"])
    assert tree_digest(out) == earlier
    assert leftovers(out) == [out.name]


@pytest.mark.slow
@pytest.mark.parametrize("made", ["an empty folder", "a folder with a file"])
def test_killed_during_the_overwrite_swap_then_out_made_again_keeps_the_earlier_merge(checkpoints, tmp_path, made):
    """`mkdir OUT` after the kill, then a plain merge: OUT_DIR existing does not mean the new one was
    published. An empty OUT_DIR gives way to the earlier merge (then refused: it is not empty); a
    non-empty one is refused before anything beside it is touched, and the earlier merge waits, still
    marked, until OUT_DIR is empty or gone again."""
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    out = tmp_path / "merged"
    fsdpfast.merge(folder, out, dtype="bf16")
    earlier = tree_digest(out)
    HeldMerge(tmp_path, folder, out, "--overwrite", point="swap").kill()
    (old,) = [name for name in leftovers(out) if name.startswith(f".{out.name}.old-")]
    previous = tmp_path / old / "previous"
    out.mkdir()
    if made == "a folder with a file":
        (out / "notes.md").write_text("mine")
        for options in ((), ("--overwrite",)):
            line = the_error_line(run_cli("merge", folder, "--out", out, *options))
            assert_mentions(line, [out])
            assert tree_digest(previous) == earlier and (out / "notes.md").read_text() == "mine"
        (out / "notes.md").unlink()  # OUT_DIR empty again

    line = the_error_line(run_cli("merge", folder, "--out", out))
    assert_mentions(line, [out, "already exists"])  # without --overwrite a non-empty OUT_DIR is refused
    assert tree_digest(out) == earlier  # the earlier merge is back under its name
    assert leftovers(out) == [out.name]


@pytest.mark.slow
def test_killed_between_the_new_folders_rename_and_its_record_keeps_the_earlier_merge(checkpoints, tmp_path):
    """The new OUT_DIR renamed in but not yet recorded as published: the next run cannot tell it from a
    folder someone made, so the earlier merge is kept (named), never removed."""
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    out = tmp_path / "merged"
    fsdpfast.merge(folder, out, dtype="bf16")
    earlier = tree_digest(out)
    HeldMerge(tmp_path, folder, out, "--overwrite", point="renamed").kill()
    (old,) = [name for name in leftovers(out) if name.startswith(f".{out.name}.old-")]
    previous = tmp_path / old / "previous"

    result = run_cli("merge", folder, "--out", out, "--overwrite")
    assert result.returncode == 0, result.stderr
    assert f"the earlier merge is kept in {previous}" in result.stderr
    assert tree_digest(previous) == earlier
    reference, tied = reference_of(checkpoints, "w2-llama")
    assert_bit_exact(read_merged(out), reference, tied=tied)


@pytest.mark.slow
def test_killed_once_the_overwrite_published_the_next_run_removes_only_the_earlier_merge(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    out = tmp_path / "merged"
    fsdpfast.merge(folder, out, dtype="bf16")
    held = HeldMerge(tmp_path, folder, out, "--overwrite", point="published")
    held.kill()
    (old,) = [name for name in leftovers(out) if name.startswith(f".{out.name}.old-")]  # the earlier merge, aside
    previous = tmp_path / old / "previous"
    (previous / "eval_results.json").write_text("written into it meanwhile")

    result = run_cli("merge", folder, "--out", out, "--overwrite")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"fsdpfast: warning: eval_results.json appeared in {out} while it was being replaced: "
        f"not written by fsdpfast, kept in {previous}"
    ]
    assert [p.name for p in previous.iterdir()] == ["eval_results.json"]  # the earlier merge's own files are gone
    reference, tied = reference_of(checkpoints, "w2-llama")
    assert_bit_exact(read_merged(out), reference, tied=tied)


@pytest.mark.parametrize("rename,when", [(1, "before"), (1, "after"), (2, "before"), (2, "after")])
def test_interrupted_at_any_point_of_the_overwrite_swap(checkpoints, tmp_path, monkeypatch, capsys, rename, when):
    """Ctrl-C / SIGTERM (KeyboardInterrupt, at any bytecode) at the swap's first rename (OUT_DIR
    aside) or second (the new folder in), just before it or just after it took effect."""
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    out = tmp_path / "merged"
    fsdpfast.merge(folder, out, dtype="bf16")  # the earlier output, unlike the new float32 one
    earlier = tree_digest(out)
    renames = []
    real_rename = os.rename

    def interrupting_rename(src, dst):
        renames.append(str(dst))
        if len(renames) == rename and when == "before":
            raise KeyboardInterrupt
        real_rename(src, dst)
        if len(renames) == rename:
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "rename", interrupting_rename)
    terminate_handler = signal.getsignal(signal.SIGTERM)  # main() installs its own
    try:
        status = main(["merge", str(folder), "--out", str(out), "--overwrite"])
    finally:
        signal.signal(signal.SIGTERM, terminate_handler)
        monkeypatch.undo()
    # OUT_DIR aside, then only renames to OUT_DIR (the new folder in, or the previous one back)
    assert renames[0].endswith(os.sep + "previous") and all(dst == str(out) for dst in renames[1:]), renames

    stderr = capsys.readouterr().err.splitlines()
    assert status == 130
    if (rename, when) == (2, "after"):  # the new folder was in place before the interrupt
        assert stderr == [f"fsdpfast: interrupted; {out} was published complete before the interrupt"]
        reference, tied = reference_of(checkpoints, "w2-llama")
        assert_bit_exact(read_merged(out), reference, tied=tied)
    else:
        assert stderr == ["fsdpfast: interrupted; nothing was published"]
        assert tree_digest(out) == earlier  # the previous OUT_DIR is back under its name
    assert leftovers(out) == [out.name]  # no staging folder, no .merged.old-*
    assert not os.path.exists(lock_path(str(out)))


@pytest.mark.slow
def test_leftovers_that_are_not_our_own_are_never_removed(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    out = tmp_path / "merged"
    unmarked = tmp_path / f".{out.name}.fsdpfast-made-by-hand"  # our name pattern, no marker
    unmarked.mkdir()
    (unmarked / "keep.txt").write_text("mine")
    foreign = tmp_path / f".{out.name}.fsdpfast-x.fsdpfast-abc"  # a real staging folder of OUT_DIR "merged.fsdpfast-x"
    foreign.mkdir()
    (foreign / STAGING_MARKER).write_text(str(tmp_path / f"{out.name}.fsdpfast-x"))
    linked = tmp_path / f".{out.name}.fsdpfast-link"  # a link to a marked folder is not followed
    linked.symlink_to(foreign)
    old_lookalike = tmp_path / f".{out.name}.old-lookalike"
    old_lookalike.mkdir()

    result = run_cli("merge", folder, "--out", out)
    assert result.returncode == 0, result.stderr
    assert (unmarked / "keep.txt").read_text() == "mine"
    assert (foreign / STAGING_MARKER).is_file()
    assert linked.is_symlink() and old_lookalike.is_dir()
    assert (out / "model.safetensors").is_file() and not os.path.exists(lock_path(str(out)))


# --- two merges into one folder ---------------------------------------------------------------


@pytest.mark.slow
def test_a_second_merge_into_the_same_folder_is_refused_while_the_first_runs(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    before = tree_digest(folder)
    out = tmp_path / "merged"
    held = HeldMerge(tmp_path, folder, out)
    staging = staging_folders(out)

    line = the_error_line(run_cli("merge", folder, "--out", out))
    assert_mentions(line, [out, "another fsdpfast merge into this folder is running"])
    with pytest.raises(fsdpfast.errors.BadInput, match="another fsdpfast merge"):
        fsdpfast.merge(folder, out, overwrite=True)
    assert staging_folders(out) == staging  # the refused runs did not touch the running one's folder

    other = tmp_path / "merged-elsewhere"  # the lock is per output folder
    assert run_cli("merge", folder, "--out", other).returncode == 0

    finished = held.resume()
    assert finished.returncode == 0, finished.stderr
    assert leftovers(out) == [out.name]
    reference, tied = reference_of(checkpoints, "w2-llama")
    assert_bit_exact(read_merged(out), reference, tied=tied)
    assert read_merged(other).keys() == read_merged(out).keys()
    assert tree_digest(folder) == before


# --- the disk fills up ------------------------------------------------------------------------


def _limit_file_size(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so writes past the limit fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def assert_write_failure(result: subprocess.CompletedProcess, mentions) -> str:
    lines = result.stderr.splitlines()
    assert result.returncode == EXIT_FAILURE, f"exit {result.returncode}:\n{result.stderr}"
    assert len(lines) == 1 and lines[0].startswith("fsdpfast: error: cannot write "), result.stderr
    assert_mentions(lines[0], ["nothing was published", *mentions])
    assert result.stdout == ""
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["cpu", "torch"])
def test_file_size_limit_during_the_write(checkpoints, tmp_path, engine):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    before = tree_digest(folder)
    out = tmp_path / "merged"
    result = subprocess.run(
        [sys.executable, "-m", "fsdpfast", "merge", str(folder), "--out", str(out), "--engine", engine],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limit_file_size(64 << 10),
    )
    assert_write_failure(result, ["File too large", "ulimit -f"])
    assert not leftovers(out), leftovers(out)
    assert tree_digest(folder) == before


@pytest.fixture
def small_filesystem(tmp_path):
    """A 256 KB tmpfs (needs root to mount; skipped elsewhere, the file size limit test still runs)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["cpu", "torch"])
def test_disk_full_during_the_write(checkpoints, tmp_path, small_filesystem, engine):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)  # ~400 KB of model: more than the disk holds
    before = tree_digest(folder)
    out = small_filesystem / "merged"
    assert_write_failure(
        run_cli("merge", folder, "--out", out, "--engine", engine),
        ["No space left on device", "free space on that disk"],
    )
    assert os.listdir(small_filesystem) == []  # no OUT_DIR, staging folder or lock file
    assert tree_digest(folder) == before
    # With room again, the same command succeeds.
    big_enough = tmp_path / "merged"
    assert run_cli("merge", folder, "--out", big_enough, "--engine", engine).returncode == 0


# --- where the output goes --------------------------------------------------------------------


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder this process cannot write in: chmod for a normal user, a read-only mount for root."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"root, and cannot mount a read-only tmpfs: {made.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_read_only_output_parent(checkpoints, tmp_path, read_only_folder):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    out = read_only_folder / "merged"
    cli_refuses(folder, out, mentions=["cannot write in", read_only_folder])
    assert os.listdir(read_only_folder) == []


@pytest.mark.parametrize("where", ["checkpoint", "checkpoint/huggingface", "checkpoint/sub/deeper"])
def test_output_inside_the_checkpoint_is_refused(checkpoints, tmp_path, where):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    out = folder / where.partition("/")[2] / "merged" if "/" in where else folder / "merged"
    (folder / "sub").mkdir()
    line = cli_refuses(folder, out, "--overwrite", mentions=["inside the checkpoint folder", folder])
    assert "outside" in line


@pytest.mark.slow
def test_output_inside_or_equal_to_the_config_folder_is_refused(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    config = tmp_path / "base-model"
    shutil.copytree(folder / "huggingface", config)
    before = tree_digest(config)
    for out, problem in (
        (config, "would replace or contain"),
        (config / "merged", "is inside"),
        (config / ".", "would replace or contain"),
    ):
        line = the_error_line(run_cli("merge", folder, "--out", out, "--config", config, "--overwrite"))
        assert_mentions(line, [f"{problem} the --config folder", config])
        assert tree_digest(config) == before
        assert not leftovers(config / "merged")


# Where the output may not go: (OUT_DIR relative to tmp_path, --config relative to tmp_path).
# The checkpoint is tmp_path/ckpt.
FORBIDDEN_PLACES = {
    "the checkpoint": ("ckpt", None),
    "above the checkpoint": (".", None),
    "inside the checkpoint": ("ckpt/merged", None),
    "inside its huggingface folder": ("ckpt/huggingface/merged", None),
    "the --config folder": ("base/model", "base/model"),
    "above the --config folder": ("base", "base/model"),
    "inside the --config folder": ("base/model/merged", "base/model"),
}


@pytest.mark.slow
@pytest.mark.parametrize("place", FORBIDDEN_PLACES)
def test_dry_run_refuses_every_output_place_the_merge_refuses(checkpoints, tmp_path, place):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    shutil.copytree(folder / "huggingface", tmp_path / "base" / "model")
    out, config = (tmp_path / p if p else None for p in FORBIDDEN_PLACES[place])
    options = ("--config", config) if config else ()
    before = tree_digest(tmp_path)
    merged = the_error_line(run_cli("merge", folder, "--out", out, *options, "--overwrite"))
    dry = the_error_line(run_cli("merge", folder, "--out", out, *options, "--dry-run"))
    assert dry == merged and "fsdpfast never writes into its inputs" in merged
    with pytest.raises(fsdpfast.errors.BadInput, match="fsdpfast never writes into its inputs"):
        fsdpfast.api.dry_run(folder, out, config=config)
    assert tree_digest(tmp_path) == before


# --- symbolic links ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w2-llama", "w2-dcp"])
def test_shard_files_that_are_symbolic_links_are_read_through(checkpoints, tmp_path, name):
    _, original = checkpoints.get(name)
    real = Path(shutil.copytree(original, tmp_path / "real"))
    before = tree_digest(real)
    linked = tmp_path / "linked"
    linked.mkdir()
    for entry in real.iterdir():
        (linked / entry.name).symlink_to(entry)  # every file and the huggingface folder a link
    out = tmp_path / "merged"
    result = run_cli("merge", linked, "--out", out)
    assert result.returncode == 0, result.stderr
    reference, tied = reference_of(checkpoints, name)
    assert_bit_exact(read_merged(out), reference, tied=tied)
    assert tree_digest(real) == before
    assert all(entry.is_symlink() for entry in linked.iterdir())


@pytest.mark.parametrize("kind", ["dangling", "loop"])
def test_broken_shard_links_are_named(checkpoints, tmp_path, kind):
    folder = copy_checkpoint(checkpoints, "w2-llama", tmp_path)
    victim = rank_file(folder, 1)
    victim.unlink()
    if kind == "dangling":
        victim.symlink_to(tmp_path / "moved-away.pt")
        problem = "points to nothing"
    else:
        (tmp_path / "b.pt").symlink_to(victim)
        victim.symlink_to(tmp_path / "b.pt")
        problem = "loop"
    cli_refuses(folder, tmp_path / "merged", mentions=[victim, "symbolic link", problem])


def test_broken_distcp_link_is_named(checkpoints, tmp_path):
    folder = copy_checkpoint(checkpoints, "w2-dcp", tmp_path)
    victim = sorted(folder.glob("*.distcp"))[-1]
    victim.unlink()
    victim.symlink_to(tmp_path / "elsewhere.distcp")
    cli_refuses(folder, tmp_path / "merged", mentions=[victim, "symbolic link", "points to nothing"])
