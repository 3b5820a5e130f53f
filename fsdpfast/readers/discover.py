"""Find the numbered rank files of a per-rank layout and check none is missing."""

from __future__ import annotations

import errno
import os
import re

from ..errors import BadInput


def find_rank_files(folder: str, pattern: re.Pattern) -> dict[int, dict[int, str]]:
    """{world size or 0: {rank: path}} for file names matching `pattern` (groups: [world,] rank)."""
    found: dict[int, dict[int, str]] = {}
    for entry in sorted(os.listdir(folder)):
        match = pattern.fullmatch(entry)
        if match:
            check_not_broken_link(os.path.join(folder, entry))
        if match and os.path.isfile(os.path.join(folder, entry)):
            groups = [int(g) for g in match.groups()]
            world, rank = (groups[0], groups[1]) if len(groups) == 2 else (0, groups[0])
            same = found.setdefault(world, {}).get(rank)
            if same is not None:  # rank_1 and rank_01: which one is the checkpoint's cannot be told
                raise BadInput(
                    f"{same} and {entry} both name rank {rank}; remove the one that does not belong to this checkpoint"
                )
            found[world][rank] = os.path.join(folder, entry)
    return found


def complete_ranks(folder: str, ranks: dict[int, str], world: int, file_name) -> list[tuple[int, str]]:
    """Ranks 0..world-1 in order; an error naming the first missing file otherwise."""
    for rank in range(world):
        if rank not in ranks:
            raise BadInput(
                f"{os.path.join(folder, file_name(rank))} is missing: a checkpoint of {world} ranks needs every rank's file"
            )
    extra = sorted(r for r in ranks if r >= world)
    if extra:
        raise BadInput(f"{ranks[extra[0]]}: rank {extra[0]} is outside a world of {world} ranks")
    return [(rank, ranks[rank]) for rank in range(world)]


def check_not_broken_link(path: str) -> None:
    """Shard files may be symbolic links (they are read through); a link to nowhere is named as such."""
    if os.path.islink(path) and not os.path.exists(path):
        try:
            os.stat(path)
            problem = "cannot be followed"
        except OSError as exc:
            problem = "is part of a loop of links" if exc.errno == errno.ELOOP else "points to nothing"
        raise BadInput(
            f"{path} is a symbolic link to {os.readlink(path)}, which {problem}; fix the link or copy the file there"
        )
