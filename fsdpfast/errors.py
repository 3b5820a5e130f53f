"""Errors the command line turns into one clear line and an exit status."""
from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_MISMATCH = 3  # verify found a difference


class FsdpfastError(Exception):
    """Something fsdpfast could not do; the message says what and what to do."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str = "", *args):
        # Messages quote names read from checkpoints, which may hold line breaks: keep one line.
        super().__init__(str(message).replace("\r", "\\r").replace("\n", "\\n"), *args)


class BadInput(FsdpfastError):
    """The checkpoint, the options or the output folder are not usable as given."""

    exit_code = EXIT_BAD_INPUT


class ModelMismatch(BadInput):
    """The merged names or shapes are not those of the model config.json describes."""


class UnsafeCheckpoint(BadInput):
    """A pickle asked for something a checkpoint of tensors never needs (code, arbitrary classes)."""


class InterruptedAfterPublishing(KeyboardInterrupt):
    """Ctrl-C or SIGTERM arrived after OUT_DIR was renamed into place: the output is complete."""
