"""A watched merge by several processes (`watch --nproc-per-merge N`): torchrun starts N
`fsdpfast merge` processes on this machine for the checkpoint, as a user would by hand (they
share the files to write, pipeline.processes); rank 0's JSON report becomes the `published` event.

The child gets the watcher's merge options as the words that gave them (merge_words), so the one
parser decides both. It runs in its own process group: a watcher told to stop sends it SIGINT, so
each merge process discards its share as Ctrl-C does (nothing published, its staging removed); one
that does not end within GRACE_S is killed, and its staging folder is removed by the next merge
into that folder, as after kill -9.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

from ..errors import EXIT_BAD_INPUT, BadInput, FsdpfastError

GRACE_S = 60.0


@dataclass(frozen=True)
class ChildReport:  # None, [] on a node whose processes do not hold rank 0 (the report is printed there)
    seconds: float | None
    bytes_written: int | None
    files: list
    warnings: list


def merge_words(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The command-line words that give `parser`'s options the values `args` holds (defaults left out)."""
    words = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            words.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        elif isinstance(action, argparse._AppendAction):  # --storage-option K=V, once per value
            words += [word for item in value for word in (flag, str(item))]
        else:
            words += [flag, str(value)]
    return words


def merge_in_processes(src: str, out: str, nproc: int, words: list[str], nodes=(1, None, "")) -> ChildReport:
    """Merge `src` into `out` with `nproc` processes; BadInput (exit 2: refused) or FsdpfastError
    (anything else) with the child's error line when it does not publish. `nodes`: (how many nodes
    merge it together, their rendezvous HOST:PORT, the checkpoint's name): each node's watcher
    starts its torchrun into the c10d rendezvous named after the checkpoint, so nodes meet only
    over the same checkpoint."""
    nnodes, endpoint, name = nodes
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes > 1:
        command += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}"]
        command += [f"--rdzv-id=fsdpfast-{name}"]
    else:
        command += ["--standalone"]
    command += ["-m", "fsdpfast", "merge", src, "--out", out, "--json", "--quiet", *words]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    try:
        stdout, stderr = child.communicate()
    except BaseException:  # the watcher is stopping: each merge process discards its share
        _stop(child)
        raise
    if child.returncode == 0:
        if not stdout.strip():  # rank 0, which reports, ran on another node
            return ChildReport(None, None, [], [])
        report = json.loads(stdout)
        return ChildReport(report["seconds"], report["bytes_written"], report["files"], report["warnings"])
    errors = [line[len("fsdpfast: error: ") :] for line in stderr.splitlines() if line.startswith("fsdpfast: error: ")]
    reason = errors[0] if errors else (stderr.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
    if child.returncode == EXIT_BAD_INPUT or (errors and _all_refused(stderr)):
        raise BadInput(reason)
    raise FsdpfastError(reason)


def _all_refused(stderr: str) -> bool:
    """torchrun exits 1 whatever its processes returned: its summary names each one's exit code."""
    codes = [line.split(":", 1)[1].strip() for line in stderr.splitlines() if line.strip().startswith("exitcode")]
    return bool(codes) and all(code.split()[0] == str(EXIT_BAD_INPUT) for code in codes)


def _stop(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGINT)
        child.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    except ProcessLookupError:
        pass
