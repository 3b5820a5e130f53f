"""What every other process of a merge checks against rank 0 before it writes a byte: that it was
started with the same options, and that it reads the same copy of the checkpoint. Rank 0 alone
plans; without these checks another rank's own options would be ignored without a word, and its
own copy of the checkpoint read into its share of the output.

Allowed to differ per rank: the folders' paths (the same folders may be mounted elsewhere on each
node; the checkpoint is compared by content, the output folder by the staging folder rank 0 made),
progress output (rank 0 alone draws it), and on the command line --quiet, --verbose (each rank's
own log), --json (rank 0 alone reports) and --timeout (how long that rank waits).
"""

from __future__ import annotations

import os

from .errors import BadInput, on_command_line, option
from .execute.engines import check_engine_name
from .io.fingerprint import fingerprints, first_difference, planned_from
from .plan.layout import parse_size
from .plan.normalise import parse_dtype


class RankDisagrees(BadInput):
    """A process of the merge does not see what rank 0 planned from; the message names the rank."""


def compared_options(asked: dict) -> dict[str, tuple]:
    """Each option of `merge` that decides the output -> (its value as compared, as given):
    spellings of one value compare equal (bf16 and bfloat16, 1MB and 1000KB)."""
    return {name: (_compared(name, value), value) for name, value in asked.items()}


def check_same_options(mine: dict[str, tuple], rank0: dict[str, tuple], rank: int, function: str = "merge") -> None:
    """Refuse, naming the option and both values, the first option this rank was given otherwise
    (`function`: what was called, for the message from Python)."""
    for name in sorted(set(mine) | set(rank0)):
        own, theirs = mine.get(name, (None, None)), rank0.get(name, (None, None))
        if own[0] == theirs[0]:
            continue
        if on_command_line():
            given, fix = f"rank {rank} was started with", "start every rank with the same options"
        else:
            given, fix = f"rank {rank} called {function} with", "call it with the same arguments on every rank"
        if own[1] == theirs[1]:  # the same folder's path, with other files in it on this rank
            raise RankDisagrees(
                f"{given} {_given(name, own[1])} as rank 0 did, but the folder holds other files on "
                "this rank; every rank must see the same folder"
            )
        raise RankDisagrees(f"{given} {_given(name, own[1])}, rank 0 with {_given(name, theirs[1])}; {fix}")


def check_ranks_options(options_by_rank: list[dict[str, tuple]], function: str) -> None:
    """The same, on rank 0, for every rank's options gathered there."""
    for rank, options in enumerate(options_by_rank):
        check_same_options(options, options_by_rank[0], rank, function)


def content_of(checkpoint: str, paths) -> dict[str, str]:
    """The fingerprints rank 0 sends: the tensor files (`paths`, as the manifest names them) and
    the small files the readers planned from beside them."""
    return fingerprints(checkpoint, planned_from(checkpoint, paths))


def check_same_copy(checkpoint: str, rank0: dict[str, str], rank: int) -> None:
    """Refuse, naming the file, if this rank's copy of a file rank 0 planned from holds other bytes."""
    found = first_difference(checkpoint, rank0)
    if found is not None:
        path, how = found
        raise RankDisagrees(
            f"rank {rank}: {os.path.join(checkpoint, path)}: not the file rank 0 planned from ({how}); "
            "every rank of a merge must read the same checkpoint (one folder on a filesystem they share, "
            "not a copy per node)"
        )


def _compared(name: str, value):
    if name == "dtype":
        return parse_dtype(value)
    if name == "max_shard_size":
        return parse_size(value)
    if name == "engine":
        check_engine_name(value)
        return value
    if name in ("config", "base"):  # folders read by rank 0 alone: compared by what they hold
        return None if value is None else _folder_content(os.fspath(value))
    if name == "lora_alpha":
        return None if value is None else float(value)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return None if value is False else value  # a switch not given


def _folder_content(folder: str):
    if not os.path.isdir(folder):
        return ("not a folder", folder)
    try:
        return tuple(sorted(fingerprints(folder, planned_from(folder, [])).items()))
    except OSError:
        return ("unreadable", folder)


def _given(name: str, value) -> str:
    if value is None or value is False:
        return f"no {option(name)}"
    return option(name, True) if value is True else option(name, value)
