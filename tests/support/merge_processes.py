"""Several processes of one `python -m fsdpfast merge`, started as torchrun starts them, and what
their shared output must be: the single-process merge's files byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fsdpfast._testing.fsdp2_writer import _free_port


class Ranks:
    """W processes of `fsdpfast merge`, each told its rank the way torchrun tells it, each alone on its "node"."""

    def __init__(self, argv_of_rank, world: int, scripts: dict[int, str] | None = None):
        port = _free_port()
        self.started = time.monotonic()
        self.processes = []
        for rank in range(world):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            head = ["-c", scripts[rank]] if scripts and rank in scripts else ["-m", "fsdpfast"]
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, *head, "merge", *map(str, argv_of_rank(rank))],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )

    def wait(self, limit: float = 300) -> list[tuple[int, str, str, float]]:
        """(exit status, stdout, stderr, seconds from the start to its exit) of each rank."""
        ended: dict[int, float] = {}
        while len(ended) < len(self.processes):
            for rank, process in enumerate(self.processes):
                if rank not in ended and process.poll() is not None:
                    ended[rank] = time.monotonic() - self.started
            if time.monotonic() - self.started > limit:
                for process in self.processes:
                    process.kill()
                raise AssertionError("the ranks did not finish")
            time.sleep(0.05)
        return [(p.returncode, *p.communicate(), ended[r]) for r, p in enumerate(self.processes)]


def same_output(single: Path, distributed: Path) -> None:
    """Every file below the two folders the same, byte for byte; JSON files equal as JSON, the folder's own path aside."""
    names = sorted(str(p.relative_to(single)) for p in single.rglob("*") if p.is_file())
    assert sorted(str(p.relative_to(distributed)) for p in distributed.rglob("*") if p.is_file()) == names
    for name in names:
        if name.endswith(".json"):  # a manifest's key order aside; adapter configs name their own folder's base
            own = [
                comparable_manifest(json.loads((folder / name).read_text().replace(str(folder.resolve()), "OUT")))
                for folder in (single, distributed)
            ]
            assert own[0] == own[1], name
        else:
            assert (distributed / name).read_bytes() == (single / name).read_bytes(), name


def comparable_manifest(manifest: dict) -> dict:
    """A manifest with its `written` list cut to the names: two merges write at two times, and a JSON
    file that names its own folder (an adapter config's base) differs in size with the folder's path.
    The files themselves are compared on their own."""
    if isinstance(manifest.get("written"), dict):
        manifest["written"] = sorted(manifest["written"])
    return manifest


def left_beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))
