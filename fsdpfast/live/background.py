"""`save_pretrained(..., background=True)`: the files written by a thread while training goes on.

save_pretrained is collective: the ranks agree on the plan, rank 0 makes the output, all hand rank
0 their checksums, rank 0 publishes. Collectives issued from a thread would run beside training's
own on the same process group, in an order no rank can rely on (gloo and NCCL match collectives by
the order they are issued), so this thread issues none. The call does every collective up to the
output's creation in the caller's thread, as a blocking save does, copies this rank's pieces to
host memory (live.write.snapshot: pinned for CUDA pieces; the model may change as soon as the call
returns) and starts the thread, which only writes those pieces at their offsets in the staging
folder. `wait()`, called on every rank in the same place of the program as any collective, joins
the thread and does the rest in the caller's thread: every rank's checksums (or failure) to rank
0, then rank 0's index, config, manifest and the publish. A failure on any rank, in the thread or
not, publishes nothing. A second save (background or not) first waits for the one before: one
save's files at a time, and their collectives in the same order on every rank.

Host memory: this rank's pieces once, as stored (`host_bytes`), held until the thread has written
them. A process that ends without `wait()` leaves the staging folder unpublished (the next save
or merge into the same folder removes it).
"""

from __future__ import annotations

import threading

from ..io.local_target import JoinedTarget
from .write import held_bytes, snapshot, write_runs

_pending: BackgroundSave | None = None  # the save whose wait() has not run yet


class BackgroundSave:
    """The handle of a background save; `wait()` (collective) returns the SaveReport."""

    def __init__(self, processes, target, out_dir: str, token: str, files, held, ways, publish, error=None):
        self.out_dir = out_dir
        self.host_bytes = held_bytes(held)
        self._processes, self._target, self._publish = processes, target, publish
        self._written, self._error, self._report, self._failed = None, error, None, None
        self._thread = threading.Thread(
            target=self._write, args=(out_dir, token, files, held, ways), name="fsdpfast-save", daemon=False
        )
        if error is None:  # a rank that could not copy its pieces says so at wait(), with the others
            self._thread.start()

    def _write(self, out_dir, token, files, held, ways) -> None:
        rank = self._processes.rank
        try:
            if self._target is None:
                self._target = JoinedTarget(out_dir, token)
            self._written = write_runs(files, [t for t, _ in held], self._target.open, rank, ways, held=held)
        except Exception as exc:  # said on every rank at wait()
            self._error = exc
        finally:
            held.clear()  # the host copies go as soon as they are written

    def done(self) -> bool:
        """Whether this rank's files are written (wait() still publishes)."""
        return not self._thread.is_alive()

    def wait(self):
        """Publish once every rank has written its pieces; the SaveReport (every rank). Collective."""
        global _pending
        if self._report is not None:
            return self._report
        if self._failed is not None:  # a second wait() says it again, without a collective no rank would match
            raise self._failed
        try:
            if self._thread.ident is not None:
                self._thread.join()
            pieces = self._processes.gather(self._result)
            self._report = self._publish(pieces)
            return self._report
        except Exception as exc:
            self._failed = exc
            raise
        finally:
            if self._thread.ident is not None:
                self._thread.join()  # Ctrl-C during the join above: the writer finishes before its folder goes
            if _pending is self:
                _pending = None
            if self._target is not None:
                self._target.discard()

    def _result(self):
        if self._error is not None:
            raise self._error
        return self._written


def start_background(processes, target, out_dir, token, files, tensors, ways, publish) -> BackgroundSave:
    """Copy this rank's pieces to host memory, then write them in a thread (module doc)."""
    global _pending
    held, error = [], None
    try:
        held = snapshot(tensors, processes.rank, ways)
    except Exception as exc:  # the other ranks learn of it at wait(), as of a failed write
        error = exc
    except BaseException:
        if target is not None:
            target.discard()
        raise
    _pending = BackgroundSave(processes, target, out_dir, token, files, held, ways, publish, error)
    return _pending


def wait_for_previous() -> None:
    """A save waits for the background save before it (on every rank: it is collective)."""
    if _pending is not None:
        _pending.wait()
