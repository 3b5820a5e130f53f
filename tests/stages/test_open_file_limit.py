"""More rank files than the process may hold open: planning reads each file and closes it, the
merge maps inputs without keeping them open, so the open-file limit does not bound the world size.

The checkpoint: 80 ranks of real FSDP2 (`fully_shard`) over torch's fake process group, written in
one process (fsdpfast._testing.many_ranks), each rank saving its real shards of a tiny Llama-shaped
model built from a seed; the reference is that model before sharding. Each merge runs in a child
whose soft and hard RLIMIT_NOFILE are set below the number of rank files, so it cannot raise them.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest
import torch
from helpers import assert_bit_exact, read_merged, write_many_ranks

from fsdpfast._testing.many_ranks import TINY, unsharded_state

pytestmark = [pytest.mark.slow]

WORLD = 80
LIMIT = 48  # open files a child may hold: well under WORLD, enough for Python, torch and the output
SEED = 31


@pytest.fixture(scope="module")
def many_ranks(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("many-ranks") / "ckpt")
    write_many_ranks(folder, WORLD, SEED)
    assert len([n for n in os.listdir(folder) if n.endswith(".pt")]) == WORLD
    return folder


def _open_file_limit(limit: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return apply


def _run(*args, limit: int = LIMIT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdpfast", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=_open_file_limit(limit),
    )


@pytest.mark.parametrize("engine, read_mode", [("cpu", "mmap"), ("torch", "mmap"), ("cpu", "pread")])
def test_merge_of_more_rank_files_than_the_open_file_limit(many_ranks, tmp_path, engine, read_mode):
    out = tmp_path / "merged"
    result = _run("merge", many_ranks, "--out", out, "--engine", engine, "--read-mode", read_mode, "--quiet")
    assert result.returncode == 0, result.stderr
    assert_bit_exact(read_merged(str(out)), unsharded_state(TINY, torch.float32, SEED))
    verified = _run("verify", out, "--against", many_ranks)  # recomputes every tensor from the rank files
    assert verified.returncode == 0, verified.stdout + verified.stderr


CHILD = """
import os, sys
import fsdpfast.api  # what the command imports when it runs, imported while files can still be opened
from fsdpfast.cli import main
free = int(sys.argv[2])
held = []
while True:  # take every descriptor the limit allows, then give back `free` of them
    try:
        held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        break
for fd in held[len(held) - free:]:
    os.close(fd)
sys.exit(main(["inspect", sys.argv[1], "--json"]))
"""


def test_planning_needs_one_file_at_a_time_and_says_when_there_is_none(many_ranks):
    def inspect(free: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", CHILD, many_ranks, str(free)],
            capture_output=True,
            text=True,
            timeout=600,
            preexec_fn=_open_file_limit(256),
        )

    with_one = inspect(1)
    assert with_one.returncode == 0, with_one.stderr
    assert json.loads(with_one.stdout)["world_size"] == WORLD
    with_none = inspect(0)
    lines = with_none.stderr.strip().splitlines()
    assert with_none.returncode == 1 and len(lines) == 1, with_none.stderr
    assert "too many open files" in lines[0] and "ulimit -n" in lines[0], lines[0]
