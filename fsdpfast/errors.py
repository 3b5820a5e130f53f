"""The errors fsdpfast raises, the exit status each gives on the command line, and how messages
name options: `--max-shard-size` on the command line, `max_shard_size=` from Python."""

from __future__ import annotations

import contextlib
import contextvars
import errno

EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_MISMATCH = 3  # verify found a difference


class FsdpfastError(Exception):
    """Something fsdpfast could not do; the message (one line) says what and what to do.

    The base of every error fsdpfast raises on purpose; `exit_code` is the command line's exit status.
    """

    exit_code = EXIT_FAILURE

    def __init__(self, message: str = "", *args):
        # Messages quote names read from checkpoints, which may hold line breaks: keep one line.
        super().__init__(str(message).replace("\r", "\\r").replace("\n", "\\n"), *args)


class BadInput(FsdpfastError, ValueError):
    """The checkpoint, the options or the output folder are not usable as given (exit status 2).

    Also a ValueError, so code that catches bad arguments the usual way catches these too.
    """

    exit_code = EXIT_BAD_INPUT


class ModelMismatch(BadInput):
    """The merged names or shapes are not those of the model config.json describes."""


class UnsafeCheckpoint(BadInput):
    """A pickle asked for something a checkpoint of tensors never needs (code, arbitrary classes)."""


class InterruptedAfterPublishing(KeyboardInterrupt):
    """Ctrl-C or SIGTERM arrived after OUT_DIR was renamed into place: the output is complete."""


# --- naming options in messages -----------------------------------------------------------------

_COMMAND_LINE = contextvars.ContextVar("fsdpfast_command_line", default=False)
_FLAGS = {"manifest_of": "--manifest"}  # where the flag is not the argument's name with dashes
_NO_VALUE = object()


@contextlib.contextmanager
def command_line_messages():
    """Within this block (the CLI's main), messages name options as command-line flags."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


def on_command_line() -> bool:
    """Whether messages are being written for the command line (see command_line_messages)."""
    return _COMMAND_LINE.get()


def option(name: str, value=_NO_VALUE, *, meta: str | None = None) -> str:
    """An option as the user gave it: option("dtype", "x") is `--dtype 'x'` on the command line and
    `dtype='x'` from Python; True/False name a switch (`--overwrite` / `overwrite=True`); `meta`
    names an unquoted placeholder (`--config DIR` / `config=DIR`); with neither, the bare name
    (`--layout` / `the layout argument`)."""
    if _COMMAND_LINE.get():
        flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
        if value is True:
            return flag
        if value is False:
            return "--no-" + flag[2:]
        if value is not _NO_VALUE:
            return f"{flag} {value!r}"
        return f"{flag} {meta}" if meta else flag
    if value is not _NO_VALUE:
        return f"{name}={value!r}"
    return f"{name}={meta}" if meta else f"the {name} argument"


# Out of file descriptors. Planning opens each input file only while reading its metadata, and the
# merge maps input files without keeping them open, so fsdpfast needs a handful of descriptors at
# once whatever the world size: running out means the limit is very low, or something else in the
# process holds the rest.
def out_of_files(exc: OSError, path: str) -> FsdpfastError | None:
    """The error to raise instead of `exc` when it is EMFILE / ENFILE, else None."""
    if exc.errno == errno.EMFILE:
        return FsdpfastError(
            f"{path}: cannot open it: too many open files (this process may have {_soft_limit()} open at "
            "once, ulimit -n); fsdpfast itself keeps only a few open at a time, so something else holds "
            "the rest, or the limit is too low: raise it (ulimit -n 4096)"
        )
    if exc.errno == errno.ENFILE:
        return FsdpfastError(
            f"{path}: cannot open it: the system's table of open files is full; close files elsewhere "
            "or raise fs.file-max"
        )
    return None


def _soft_limit() -> str:
    try:
        import resource

        return str(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    except (ImportError, OSError, ValueError):
        return "a limited number"
