"""What a user reads: --help (layouts, examples, every option explained), the Python API's errors
and docstrings, sizes and counts in summaries, and exit statuses that a closed pipe cannot change."""

from __future__ import annotations

import os
import pydoc
import re
import shlex
import subprocess
import sys

import pytest
from refusals import run_cli

import fsdpfast
from fsdpfast import readers
from fsdpfast._text import count, size
from fsdpfast.cli import build_parser
from fsdpfast.dtypes import TARGET_ALIASES
from fsdpfast.errors import EXIT_BAD_INPUT, EXIT_MISMATCH
from fsdpfast.io.safetensors_folder import read_folder
from fsdpfast.options import FP8_NAMES

# Minutes of Python-only checks: CI runs them with the CPU torch, not again with the CUDA one (docs/development.md)
pytestmark = pytest.mark.slow

VERBS = ("merge", "inspect", "verify", "demo")


def help_text(*verb: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "fsdpfast", *verb, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


# --- --help -----------------------------------------------------------------------------------


@pytest.mark.parametrize("verb", ["merge", "inspect", "verify"])
def test_layout_help_names_every_layout(verb):
    line = next(line for line in help_text(verb).splitlines() if line.strip().startswith("--layout"))
    assert all(name in line for name in readers.READERS), line


@pytest.mark.parametrize("verb", ["merge", "inspect", "verify"])
def test_layout_options_are_the_readers_own(verb):
    """Each reader's options, and no other layout option, are on the command line, with the reader's
    name in their help; what a user types reaches that reader's read() under the option's name."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "verb").choices[verb]
    offered = {a.dest: a for a in sub._actions}
    for reader in readers.READERS.values():
        for opt in reader.options:
            if opt.internal:
                assert opt.name not in offered, opt.name
                continue
            assert offered[opt.name].option_strings[0] == opt.flag
            assert f"{reader.name}: " in offered[opt.name].help
    layout_flags = {a.dest for a in sub._actions} & set(readers.LAYOUT_OPTIONS)
    assert layout_flags == {opt.name for _, opt in readers.user_options()}


@pytest.mark.parametrize("verb", VERBS)
def test_every_subcommand_shows_examples_that_parse(verb):
    text = help_text(verb)
    examples = text.split("examples:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert examples, text
    for example in examples:
        argv = shlex.split(example, comments=True)
        assert argv[:2] == ["fsdpfast", verb], example
        build_parser().parse_args(argv[1:])  # a wrong example would exit 2 here


@pytest.mark.parametrize("verb", VERBS)
def test_every_option_has_help(verb):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "verb").choices[verb]
    undocumented = [a.option_strings for a in sub._actions if a.option_strings and not a.help]
    assert not undocumented


def test_dtype_spellings_are_exactly_those_the_help_lists(w2_folder, tmp_path):
    line = next(line for line in help_text("merge").splitlines() if line.strip().startswith("--dtype"))
    listed = set(re.findall(r"\b(keep|[a-z]+\d+(?:-block)?)\b", line))
    assert listed == set(TARGET_ALIASES) | set(FP8_NAMES), line
    for spelling in ("half", "float", "BF16", "Float32", " bf16"):
        result = run_cli("merge", w2_folder, "--out", tmp_path / "out", "--dtype", spelling)
        assert result.returncode == EXIT_BAD_INPUT and f"--dtype {spelling!r} is not one of" in result.stderr, (
            result.stderr
        )
    assert not (tmp_path / "out").exists()


# --- the Python face ------------------------------------------------------------------------


@pytest.fixture
def w2_folder(checkpoints) -> str:
    return checkpoints.get("w2-llama")[1]


def test_errors_are_exported_and_bad_input_is_a_value_error():
    assert issubclass(fsdpfast.BadInput, ValueError) and issubclass(fsdpfast.BadInput, fsdpfast.FsdpfastError)
    assert issubclass(fsdpfast.UnsafeCheckpoint, fsdpfast.BadInput)
    assert issubclass(fsdpfast.SourceChanged, fsdpfast.FsdpfastError)
    assert {"FsdpfastError", "BadInput", "UnsafeCheckpoint", "SourceChanged"} <= set(fsdpfast.__all__)


@pytest.mark.parametrize(
    "argument, value, cli, api",
    [
        ("dtype", "fp4", ["--dtype", "fp4"], "dtype='fp4' is not one of"),
        ("max_shard_size", "5XB", ["--max-shard-size", "5XB"], "max_shard_size='5XB' is not a size"),
        ("engine", "warp", ["--engine", "warp"], "engine='warp' is not one of"),
        ("layout", "fsdp9", ["--layout", "fsdp9"], "layout='fsdp9' is not a known layout"),
        ("tag", "global_step1", ["--tag", "global_step1"], "the tag argument applies to deepspeed-zero checkpoints"),
    ],
)
def test_messages_name_options_as_each_face_takes_them(w2_folder, tmp_path, argument, value, cli, api):
    with pytest.raises(ValueError) as caught:
        fsdpfast.merge(w2_folder, tmp_path / "out", **{argument: value})
    assert api in str(caught.value) and "--" not in str(caught.value), str(caught.value)
    result = run_cli("merge", w2_folder, "--out", tmp_path / "out", *cli)
    flag = cli[0]
    assert result.returncode == EXIT_BAD_INPUT and flag in result.stderr and f"{argument}=" not in result.stderr, (
        result.stderr
    )
    assert not (tmp_path / "out").exists()


def test_help_on_the_package_explains_it():
    text = pydoc.render_doc(fsdpfast, renderer=pydoc.plaintext)
    for needed in (
        "merge(src, dst",
        "verify(out_dir",
        "inspect(src",
        "plan_merge(src",
        "BadInput",
        "ValueError",
        "exclude_frozen",
        "max_shard_size",
        "fsdpfast merge|inspect|verify|watch|demo --help",
    ):
        assert needed in text, needed
    for function in (fsdpfast.merge, fsdpfast.verify, fsdpfast.inspect, fsdpfast.plan_merge):
        assert function.__doc__ and len(function.__doc__.splitlines()) > 1, function.__name__


# --- sizes and counts -------------------------------------------------------------------------


def test_sizes_and_counts_read_right():
    assert [size(n) for n in (0, 999, 1000, 1499, 9995, 99_950, 999_500, 26_400_000, 3_810_000_000)] == [
        "0 B",
        "999 B",
        "1.00 KB",
        "1.50 KB",
        "10.0 KB",
        "100 KB",
        "1.00 MB",
        "26.4 MB",
        "3.81 GB",
    ]
    assert [count(1, "file"), count(2, "file"), count(0, "rank"), count(1, "mismatch", "mismatches")] == [
        "1 file",
        "2 files",
        "0 ranks",
        "1 mismatch",
    ]


def test_small_model_summaries(w2_folder, tmp_path):
    merged = run_cli("merge", w2_folder, "--out", tmp_path / "out", "--quiet")
    assert merged.returncode == 0, merged.stderr
    data = sum(t.nbytes for t in read_folder(str(tmp_path / "out")).values())
    assert f"({size(data)}) from 2 ranks" in merged.stdout and "0.000 GB" not in merged.stdout
    dry = run_cli("merge", w2_folder, "--out", tmp_path / "dry", "--dry-run")
    assert f", {size(data)} in 1 file; nothing written" in dry.stdout.splitlines()[0], dry.stdout
    found = run_cli("inspect", w2_folder)
    assert "2 ranks" in found.stdout and f"{size(data)}, 2 files" in found.stdout.splitlines()[0], found.stdout


# --- verify ---------------------------------------------------------------------------------


def test_verify_counts_each_byte_once_whatever_the_checks(w2_folder, tmp_path):
    fsdpfast.merge(w2_folder, tmp_path / "out")
    fsdpfast.merge(w2_folder, tmp_path / "again")
    data = sum(t.nbytes for t in read_folder(str(tmp_path / "out")).values())
    report = fsdpfast.verify(
        tmp_path / "out", against=w2_folder, manifest_of=tmp_path / "again", reference=tmp_path / "again"
    )
    assert report.ok and len(report.checks) == 3, report.checks
    assert report.bytes_checked == data
    assert f"{size(data)} checked" in report.summary()


def closed_pipe_run(*args) -> subprocess.CompletedProcess:
    """The command with stdout a pipe whose reader has gone (as `| head` after its lines): every write fails."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "fsdpfast", *map(str, args)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    finally:
        os.close(write_end)


def test_exit_status_does_not_depend_on_a_closed_pipe(w2_folder, tmp_path):
    out = tmp_path / "out"
    fsdpfast.merge(w2_folder, out)
    ok = closed_pipe_run("verify", out)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    with open(out / "model.safetensors", "r+b") as f:  # one byte of the last tensor's data changed
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    assert run_cli("verify", out).returncode == EXIT_MISMATCH
    for extra in ((), ("--json",)):
        failed = closed_pipe_run("verify", out, *extra)
        assert failed.returncode == EXIT_MISMATCH and failed.stderr == "", failed.stderr
    merged = closed_pipe_run("merge", w2_folder, "--out", tmp_path / "piped")
    assert merged.returncode == 0 and merged.stderr == "" and (tmp_path / "piped" / "model.safetensors").is_file()
    found = closed_pipe_run("inspect", w2_folder)
    assert found.returncode == 0 and found.stderr == "", found.stderr
