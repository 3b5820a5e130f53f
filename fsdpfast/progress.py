"""A one-line progress bar on stderr (bytes, GB/s, ETA) for merges that take more than a moment."""

from __future__ import annotations

import math
import os
import sys
import time

# Seconds before the bar first appears: quick merges print nothing. FSDPFAST_PROGRESS_AFTER
# lets a test (or an impatient user) see it at once.
DEFAULT_DELAY = 1.0
REDRAW = 0.1  # seconds between redraws, so a fast merge does not spend its time printing


class Progress:
    """`advance(nbytes)` as work finishes; `close()` ends the line. Draws only on a terminal."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.total, self.done = total, 0
        self.enabled = enabled and total > 0 and _is_terminal(self.stream)
        self.delay = progress_delay() if self.enabled else DEFAULT_DELAY
        self.start = self._drawn_at = time.monotonic()
        self.shown = False

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.start >= self.delay and (
            now - self._drawn_at >= REDRAW or self.done >= self.total or not self.shown
        ):
            self._draw(now)

    def close(self) -> None:
        if self.shown:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
            self.shown = self.enabled = False

    def _draw(self, now: float) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        width = 30
        filled = int(width * self.done / self.total)
        line = (
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
            f"{rate / 1e9:.2f} GB/s ETA {eta:4.0f} s"
        )
        self.stream.write(line)
        self.stream.flush()
        self.shown, self._drawn_at = True, now


def progress_delay() -> float:
    """FSDPFAST_PROGRESS_AFTER in seconds; read when a bar is made, so a bad value only means the
    default (a typo in a cosmetic setting must not stop a merge, or every command, at import)."""
    try:
        value = float(os.environ.get("FSDPFAST_PROGRESS_AFTER", DEFAULT_DELAY))
    except ValueError:
        return DEFAULT_DELAY
    return value if math.isfinite(value) and value >= 0 else DEFAULT_DELAY


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
