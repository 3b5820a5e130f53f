"""The progress bar's delay setting: a bad FSDPFAST_PROGRESS_AFTER means the default, never a traceback."""
from __future__ import annotations

import io
import os
import pty
import subprocess
import sys

import pytest

from fsdpfast.progress import DEFAULT_DELAY, Progress, progress_delay


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("value,delay", [
    (None, DEFAULT_DELAY), ("0", 0.0), ("2.5", 2.5),
    ("soon", DEFAULT_DELAY), ("", DEFAULT_DELAY), ("-1", DEFAULT_DELAY), ("nan", DEFAULT_DELAY), ("inf", DEFAULT_DELAY),
])
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


def run_on_terminal(*args, env) -> tuple[int, str]:
    """`fsdpfast ARGS` with a pseudo-terminal as stderr (where the bar draws): exit status, what it received."""
    controller, terminal = pty.openpty()
    result = subprocess.run([sys.executable, "-m", "fsdpfast", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=terminal, env=env, timeout=300)
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
    return result.returncode, received.decode(errors="replace")


def test_a_bad_value_does_not_stop_any_command(checkpoints, tmp_path):
    _, folder = checkpoints.get("w2-llama")
    env = {**os.environ, "FSDPFAST_PROGRESS_AFTER": "one second"}
    assert run_on_terminal("--version", env=env) == (0, "")
    status, shown = run_on_terminal("merge", folder, "--out", tmp_path / "out", env=env)
    assert status == 0 and "Traceback" not in shown, shown
    assert (tmp_path / "out" / "model.safetensors").is_file()
