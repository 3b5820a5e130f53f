"""The progress bar's delay setting: a bad FSDPFAST_PROGRESS_AFTER means the default, never a traceback."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

import fsdpfast
from fsdpfast.progress import DEFAULT_DELAY, Progress, progress_delay


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    "value,delay",
    [
        (None, DEFAULT_DELAY),
        ("0", 0.0),
        ("2.5", 2.5),
        ("soon", DEFAULT_DELAY),
        ("", DEFAULT_DELAY),
        ("-1", DEFAULT_DELAY),
        ("nan", DEFAULT_DELAY),
        ("inf", DEFAULT_DELAY),
    ],
)
def test_the_delay_is_read_when_a_bar_is_made(monkeypatch, value, delay):
    if value is None:
        monkeypatch.delenv("FSDPFAST_PROGRESS_AFTER", raising=False)
    else:
        monkeypatch.setenv("FSDPFAST_PROGRESS_AFTER", value)
    assert progress_delay() == delay
    terminal = Terminal()
    bar = Progress(100, stream=terminal)
    assert bar.delay == delay
    bar.advance(100)
    assert ("GB/s" in terminal.getvalue()) == (delay == 0.0)  # drawn at once only with no delay


@pytest.mark.slow
def test_a_bad_value_does_not_stop_any_command(checkpoints, tmp_path, monkeypatch):
    _, folder = checkpoints.get("w2-llama")
    monkeypatch.setenv("FSDPFAST_PROGRESS_AFTER", "one second")
    version = subprocess.run(
        [sys.executable, "-m", "fsdpfast", "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.returncode == 0 and version.stderr == "", version.stderr  # the setting was read at import once
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)  # a terminal, so the merge makes its bar and reads the setting
    fsdpfast.merge(folder, tmp_path / "out", progress=True)
    assert (tmp_path / "out" / "model.safetensors").is_file() and "Traceback" not in terminal.getvalue()
