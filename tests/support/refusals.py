"""Running a merge that must be refused, and checking the refusal contract: one line, the exit
code, nothing written, the checkpoint untouched. Also the edits the refusal tests make to rank files."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (lets torch.load(weights_only=True) rebuild DTensors)

import fsdpfast
from fsdpfast.errors import EXIT_BAD_INPUT, BadInput

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"  # (64, 64) in the llama examples
K_PROJ = "model.layers.0.self_attn.k_proj.weight"  # (32, 64)
DOWN_PROJ = "model.layers.0.mlp.down_proj.weight"  # (64, 88)


def run_cli(*args) -> subprocess.CompletedProcess:
    """`python -m fsdpfast ARGS` in a process of its own: exit codes, signals, what reaches the terminal."""
    return subprocess.run(
        [sys.executable, "-m", "fsdpfast", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_cli_here(*args) -> subprocess.CompletedProcess:
    """fsdpfast's command line (cli.main) in this process, its exit code and output as `run_cli` gives
    them for a run that ends by itself; without the seconds a fresh Python and torch import take.
    Output is caught at the file descriptors too, so a line written below Python still counts."""
    from fsdpfast import cli

    argv = [str(arg) for arg in args]
    terminate = signal.getsignal(signal.SIGTERM)  # cli.main installs its own; the test process keeps pytest's
    with _fd_captured(1) as fd_out, _fd_captured(2) as fd_err:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv)
            except SystemExit as exc:  # argparse's own refusals
                code = exc.code if isinstance(exc.code, int) else 1
            finally:
                signal.signal(signal.SIGTERM, terminate)
    stdout, stderr = out.getvalue() + "".join(fd_out), err.getvalue() + "".join(fd_err)
    return subprocess.CompletedProcess(["fsdpfast", *argv], code, stdout, stderr)


@contextlib.contextmanager
def _fd_captured(fd: int):
    """What is written to file descriptor `fd` within the block: the list holds it once the block ends."""
    sys.stdout.flush()
    sys.stderr.flush()
    caught: list[str] = []
    with tempfile.TemporaryFile() as file:
        saved = os.dup(fd)
        os.dup2(file.fileno(), fd)
        try:
            yield caught
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            file.seek(0)
            caught.append(file.read().decode(errors="replace"))


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under `path` (or of `path` itself), keyed by relative path."""
    path = Path(path)
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    if not path.exists():
        return {}
    return {
        str(file.relative_to(path)): hashlib.sha256(file.read_bytes()).hexdigest()
        for file in sorted(path.rglob("*"))
        if file.is_file()
    }


def leftovers(out: Path) -> list[str]:
    """OUT_DIR itself, or a hidden staging / old-copy folder beside it, if any was left."""
    siblings = os.listdir(out.parent) if out.parent.is_dir() else []
    found = [name for name in siblings if name.startswith((f".{out.name}.fsdpfast-", f".{out.name}.old-"))]
    return found + ([out.name] if os.path.lexists(out) else [])


def the_error_line(result: subprocess.CompletedProcess) -> str:
    """The one `fsdpfast: error: ...` line of a refused run (exit 2, nothing else printed)."""
    lines = result.stderr.splitlines()
    assert result.returncode == EXIT_BAD_INPUT, f"exit {result.returncode}:\n{result.stderr}"
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}"
    assert lines[0].startswith("fsdpfast: error: "), lines[0]
    assert result.stdout == ""
    return lines[0]


def assert_mentions(line: str, mentions) -> None:
    for text in mentions:
        assert str(text) in line, f"{text!r} not in {line!r}"


def cli_refuses(src, out: Path, *options, mentions=()) -> str:
    """Run `fsdpfast merge SRC --out OUT [options]` (in this process) and check the whole refusal contract."""
    before = tree_digest(src)
    line = the_error_line(run_cli_here("merge", src, "--out", out, *options))
    assert_mentions(line, mentions)
    assert not leftovers(out), leftovers(out)
    assert tree_digest(src) == before, "the checkpoint was modified"
    return line


def api_form(mention):
    """How the Python API names what the command line calls `--tag` (`the tag argument`) or `--tag 'x'` (`tag='x'`)."""
    found = re.fullmatch(r"--([a-z][a-z-]*)(?: ('.*'))?", mention) if isinstance(mention, str) else None
    if not found:
        return mention
    name = found.group(1).replace("-", "_")
    return f"{name}={found.group(2)}" if found.group(2) else f"the {name} argument"


def api_refuses(src, out: Path, mentions=(), **options) -> str:
    """fsdpfast.merge raises BadInput with a one-line message; nothing written, nothing changed.
    The message names options as the API takes them (`mentions` may name them as flags)."""
    before = tree_digest(src)
    with pytest.raises(BadInput) as caught:
        fsdpfast.merge(src, out, **options)
    message = str(caught.value)
    assert "\n" not in message, message
    assert "--" not in message, message
    assert_mentions(message, [api_form(m) for m in mentions])
    assert not leftovers(out), leftovers(out)
    assert tree_digest(src) == before, "the checkpoint was modified"
    return message


def edit_state_dict(path: Path, edit: Callable[[dict], None]) -> None:
    """Load a rank file with torch, let `edit` change its state dict in place, save it with torch."""
    whole = torch.load(path, weights_only=True)
    edit(whole["state_dict"] if "state_dict" in whole else whole)
    torch.save(whole, path)


def load_state_dict(path: Path) -> dict:
    whole = torch.load(path, weights_only=True)
    return whole["state_dict"] if "state_dict" in whole else whole
