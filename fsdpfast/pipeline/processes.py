"""The processes of one merge (`torchrun ... -m fsdpfast merge`, or `merge(..., group=pg)`) and
the few messages they exchange.

A merge is three named steps: `plan` (rank 0 plans, lays out and makes the target; every rank
gets the job), `write` (every rank writes its share; rank 0 gets the checksums) and `finish`
(rank 0 writes the small files and publishes).

Three exchanges, all object collectives of torch.distributed (gloo; no tensor collectives):
`lead` runs a step on rank 0 and gives its result (or its failure) to every rank (planning,
then finishing and publishing); `gather` runs a step on every rank, gives rank 0 all results,
and then every rank every rank's status, so that one failure stops all of them before anything
is published. A process killed outright closes its connections, which fails the others'
next exchange at once; a rank that hangs fails them when the process group's timeout runs out.

One process alone (no group, or a group of one) runs each step in place: exactly the merge of
a single process, with no torch import.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

from ..errors import EXIT_FAILURE, FsdpfastError

DEFAULT_TIMEOUT_S = 600.0  # how long a rank waits for the others at one exchange (torch's own default is 30 min)


@dataclass(frozen=True)
class Failure:
    rank: int
    exit_code: int
    message: str


class OtherRankFailed(FsdpfastError):
    """Another process of the merge failed (or went away): nothing is published. The exit status is the failed rank's."""

    def __init__(self, failure: Failure):
        said = failure.message.removesuffix("; nothing was published")  # said once, at the end
        super().__init__(f"rank {failure.rank} failed: {said}; nothing was published")
        self.exit_code = failure.exit_code


class LostRank(FsdpfastError):
    """An exchange between the merge's processes failed: one of them went away or did not answer in time."""


class MergeGroup:
    def __init__(self, group=None):
        self.group = group
        self.rank, self.size = 0, 1
        if group is not None:
            import torch.distributed as dist

            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    @property
    def alone(self) -> bool:
        return self.size == 1

    def plan(self, step, abandon):
        """Step 1, on rank 0: the job every rank works from (`abandon(job)` removes its target)."""
        return self.lead(step, abandon=abandon)

    def write(self, step) -> list | None:
        """Step 2, on every rank: its share of the bytes; every rank's result on rank 0."""
        return self.gather(step)

    def finish(self, step):
        """Step 3, on rank 0 once every rank has written: the small files, then publish."""
        return self.lead(step)

    def lead(self, step, abandon=None):
        """`step()` on rank 0; its result on every rank (rank 0's exception is raised there, and
        OtherRankFailed everywhere else). `abandon(result)` undoes rank 0's step if the others
        cannot be told."""
        if self.alone:
            return step()
        message, error = [None], None
        if self.rank == 0:
            try:
                message[0] = ("ok", step())
            except Exception as exc:
                error, message[0] = exc, ("failed", _failure(0, exc))
        try:
            self._exchange(self._dist().broadcast_object_list, message, src=self._global(0), group=self.group)
        except LostRank:
            if abandon is not None and self.rank == 0 and error is None:
                abandon(message[0][1])
            raise
        if error is not None:
            raise error
        kind, value = message[0]
        if kind == "failed":
            raise OtherRankFailed(value)
        return value

    def gather(self, step) -> list | None:
        """`step()` on every rank; the results, in rank order, on rank 0 (None elsewhere) once every
        rank has told every other that it succeeded. A failure anywhere raises on every rank."""
        if self.alone:
            return [step()]
        dist = self._dist()
        error, result = None, None
        try:
            result = ("ok", step())
        except Exception as exc:
            error, result = exc, ("failed", _failure(self.rank, exc))
        gathered = [None] * self.size if self.rank == 0 else None
        self._exchange(dist.gather_object, result, gathered, dst=self._global(0), group=self.group)
        status = result[1] if error is not None else None
        if self.rank == 0 and status is None:
            status = next((value for kind, value in gathered if kind == "failed"), None)
        statuses = [None] * self.size
        self._exchange(dist.all_gather_object, statuses, status, group=self.group)  # every rank learns of any failure
        if error is not None:
            raise error
        failed = next((s for s in statuses if s is not None), None)
        if failed is not None:
            raise OtherRankFailed(failed)
        return [value for _, value in gathered] if self.rank == 0 else None

    def _exchange(self, collective, *args, **kwargs) -> None:
        try:
            collective(*args, **kwargs)
        except RuntimeError as exc:  # gloo: "Connection closed by peer", "Timed out waiting ..."
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise LostRank(
                f"rank {self.rank} lost touch with the merge's other processes ({reason[:300]}); "
                "another rank was killed, failed to start or took longer than the timeout; "
                "nothing was published"
            ) from None

    def _dist(self):
        import torch.distributed as dist

        return dist

    def _global(self, rank: int) -> int:
        return self._dist().get_global_rank(self.group, rank)


def _failure(rank: int, exc: Exception) -> Failure:
    if isinstance(exc, FsdpfastError):
        return Failure(rank, exc.exit_code, str(exc))
    if isinstance(exc, OSError):
        return Failure(rank, EXIT_FAILURE, f"{exc.filename or ''}: {exc.strerror or exc}")
    return Failure(rank, EXIT_FAILURE, f"{type(exc).__name__}: {exc}".splitlines()[0])


# --- the process group of a torchrun launch -----------------------------------------------------


def launched_by_torchrun() -> bool:
    """torchrun (and launchers like it) tell each process its rank and the world in the environment."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ and "MASTER_ADDR" in os.environ
    except ValueError:
        return False


_started = False


def start_process_group(timeout_s: float = DEFAULT_TIMEOUT_S):
    """The default process group on gloo from the environment torchrun sets; the group."""
    global _started
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    _started = True
    return dist.group.WORLD


def end_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def started_here() -> bool:
    return _started


def leave(status: int) -> None:
    """End the process now, with `status`. Interpreter shutdown after gloo has run sometimes aborts
    (a gloo thread still joinable when destroyed: SIGABRT), which would turn a merge that published
    its output, or failed cleanly, into exit status 134; all that is left to do is flush."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def this_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_processes() -> int:
    """How many of the merge's processes share this machine (torchrun's LOCAL_WORLD_SIZE), to share its cores."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1
