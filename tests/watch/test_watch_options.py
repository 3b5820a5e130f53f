"""`fsdpfast watch`'s own options: a mistake is one line and exit status 2, before anything is watched."""

from __future__ import annotations

import pytest
from refusals import run_cli_here


@pytest.mark.parametrize(
    "options, mentions",
    [
        (("--keep-last", "0"), "--keep-last 0"),
        (("--interval", "0"), "--interval 0"),
        (("--dtype", "fp4"), "fp4"),
        (("--nproc-per-merge", "0"), "--nproc-per-merge 0"),
    ],
)
def test_a_bad_option_is_refused_in_one_line(tmp_path, options, mentions):
    result = run_cli_here("watch", tmp_path / "run", "--out", tmp_path / "out", *options)
    assert result.returncode == 2 and not result.stdout, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and mentions in lines[0], result.stderr
    assert not (tmp_path / "out").exists()


def test_the_run_folder_must_be_a_folder_and_not_the_output(tmp_path):
    (tmp_path / "file").write_text("x")
    assert "not a folder" in run_cli_here("watch", tmp_path / "file", "--out", tmp_path / "out").stderr
    same = run_cli_here("watch", tmp_path, "--out", tmp_path)
    assert same.returncode == 2 and "the run folder itself" in same.stderr


def test_a_run_in_an_object_store_is_refused_as_its_own_output_or_with_several_merge_processes(tmp_path):
    """Refused before the store is reached (no server here)."""
    same = run_cli_here("watch", "s3://ckpt/run/", "--out", "s3://ckpt/run")
    assert same.returncode == 2 and "the run folder itself" in same.stderr, same.stderr
    for options in (("--nproc-per-merge", "2"), ("--nnodes", "2", "--rdzv-endpoint", "localhost:1")):
        several = run_cli_here("watch", "s3://ckpt/run", "--out", tmp_path / "out", *options)
        lines = several.stderr.strip().splitlines()
        assert several.returncode == 2 and len(lines) == 1 and "s3://ckpt/run" in lines[0], several.stderr
        assert "--nproc-per-merge" in lines[0] and not (tmp_path / "out").exists()


def test_once_on_a_run_with_nothing_complete_publishes_nothing(tmp_path):
    (tmp_path / "run" / "global_step_5" / "actor").mkdir(parents=True)  # no tracker file names it yet
    result = run_cli_here("watch", tmp_path / "run", "--out", tmp_path / "out", "--once")
    assert result.returncode == 0 and "found" not in result.stdout, result.stdout
    assert not (tmp_path / "out").exists()


def test_the_merge_options_reach_several_processes_as_the_words_that_gave_them():
    """watch --nproc-per-merge passes its merge options on as words: parsed again, they are the same."""
    import argparse

    from fsdpfast.cli import _add_merge_options
    from fsdpfast.watch.processes import merge_words

    parser = argparse.ArgumentParser(add_help=False)
    _add_merge_options(parser)
    given = [
        "--dtype",
        "bf16",
        "--max-shard-size",
        "2GB",
        "--config",
        "/c f",
        "--overwrite",
        "--expert-layout",
        "packed",
    ]
    args = parser.parse_args(given)
    words = merge_words(parser, args)
    assert vars(parser.parse_args(words)) == vars(args)
    assert merge_words(parser, parser.parse_args([])) == []  # defaults are not repeated
    assert "/c f" in words  # one word, not split
