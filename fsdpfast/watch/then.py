"""--then CMD: a command run on each published folder, the folder's path its last argument.

No shell: CMD is split as a shell would split words (shlex) and run directly, so a folder's name
is never read as shell syntax. With --then-shell, CMD is run by /bin/sh with the folder as "$1".
Its output goes to the watcher's stderr, so stdout stays the watcher's events (--json).
"""

from __future__ import annotations

import shlex
import subprocess
import sys


def run_then(command: str, folder: str, shell: bool = False) -> int:
    """The command's exit status (127: it could not be started)."""
    argv = ["/bin/sh", "-c", command, "fsdpfast-then", folder] if shell else [*shlex.split(command), folder]
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=_stderr(), check=False).returncode
    except OSError as exc:
        print(f"fsdpfast watch: --then {command}: {exc.strerror or exc}", file=sys.stderr)
        return 127


def _stderr() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):  # replaced by an object without a descriptor (a test's capture)
        return 2
