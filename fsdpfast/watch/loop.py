"""The watcher: find each complete checkpoint of a run (watch.discover), merge it into
OUT_ROOT/<its name> unless that already holds it (watch.published), then run --then and apply
--keep-last; poll again after `interval` seconds (sooner when inotify says the run folder
changed: watch.wakeups), or stop (`once`).

One merge at a time, in this process, with the options parsed once (options.MergeOptions), or by
several processes torchrun starts (`nproc`: watch.processes). A
checkpoint that is refused or fails is said (watch.events) and tried again only once its files
change (a signature of their names, sizes and modification times), so the watcher goes on.
SIGTERM (and Ctrl-C) stop it between two bytecodes: a merge under way is discarded by the merge
itself (its staging folder removed, nothing published; or, after its rename, published whole),
then the watcher says `stopped` and exits 0.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from ..api import merge_with
from ..errors import EXIT_BAD_INPUT, EXIT_FAILURE, BadInput, FsdpfastError, InterruptedAfterPublishing
from ..options import MergeOptions
from ..remote.urls import is_remote
from .discover import Checkpoint, complete_checkpoints, publishing_order
from .events import Events
from .processes import merge_in_processes
from .published import outputs_of_run, published, remove_output
from .then import run_then
from .wakeups import Wakeups


class Stop(KeyboardInterrupt):
    """A signal asked the watcher to stop (a KeyboardInterrupt: a merge under way discards itself)."""


@dataclass(frozen=True)
class WatchSettings:
    run_dir: str
    out_root: str
    options: MergeOptions
    once: bool = False
    interval: float = 30.0
    keep_last: int | None = None
    then: str | None = None
    then_shell: bool = False
    nproc: int = 1  # processes per merge (torchrun-started `fsdpfast merge`s: watch.processes)
    merge_words: tuple = ()  # the merge options as command-line words, for those processes
    nnodes: int = 1  # nodes merging each checkpoint together, each running this watcher (watch.processes)
    rdzv_endpoint: str | None = None  # their rendezvous, HOST:PORT


def watch(settings: WatchSettings, events: Events) -> int:
    """Watch until stopped (`once`: one pass); the exit status (once: 2 if a checkpoint was refused,
    1 if one failed, else 0; 0 when stopped by a signal)."""
    watcher = _Watcher(settings, events)
    wakeups = Wakeups(settings.run_dir)
    previous = _on_sigterm()
    events(
        "watching",
        run_dir=_shown(settings.run_dir),
        out_root=_shown(settings.out_root),
        once=settings.once,
        interval=settings.interval,
        notified=wakeups.notified,
    )
    try:
        while True:
            watcher.one_pass()
            if settings.once:
                return watcher.status
            wakeups.wait(settings.interval)
    except KeyboardInterrupt as exc:
        why = str(exc) if isinstance(exc, Stop) else "interrupted"
        current = f"; the merge of {watcher.current} was discarded, nothing of it published" if watcher.current else ""
        events("stopped", reason=why + current)
        return 0
    finally:
        wakeups.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _Watcher:
    def __init__(self, settings: WatchSettings, events: Events):
        self.settings = settings
        self.events = events
        self.done: dict[str, tuple] = {}  # published or found published, by name: its files' signature then
        self.tried: dict[str, tuple] = {}  # refused or failed: the signature it had
        self.current: str | None = None  # the checkpoint being merged
        self.reported = True  # the last merge's report came here (with --nnodes: its rank 0 ran on this node)
        self.status = 0

    def one_pass(self) -> None:
        complete = complete_checkpoints(self.settings.run_dir)
        if self.settings.keep_last is not None:  # older ones would be removed again at once
            complete = complete[-self.settings.keep_last :]
        for checkpoint in complete:
            signature = checkpoint.signature()
            name = checkpoint.name
            if self.done.get(name) == signature or self.tried.get(name) == signature:
                continue
            out = _output(self.settings.out_root, name)
            if published(out, checkpoint.path, self.settings.options.dtype, self.settings.options.fp8_skip):
                self.events("skipped", checkpoint=name, out=out)
                self.done[name] = signature
                continue
            self.events("found", checkpoint=name, framework=checkpoint.framework, path=checkpoint.path)
            if self._merge(checkpoint, out):
                self.done[name] = signature
                self.tried.pop(name, None)
                self._then(out)
                self._keep_last()
            else:
                self.tried[name] = signature
        self._keep_last()  # also what an earlier watcher published

    def _merge(self, checkpoint: Checkpoint, out: str) -> bool:
        name = checkpoint.name
        self.events("started", checkpoint=name, out=out)
        self.current = name
        try:
            if self.settings.nproc > 1 or self.settings.nnodes > 1:
                report = self._merge_in_processes(checkpoint, out)
            else:
                report = merge_with(checkpoint.path, out, self.settings.options)
        except InterruptedAfterPublishing:
            self.current = None
            self.events("published", checkpoint=name, out=out, seconds=None, bytes=None, files=[], warnings=[])
            raise
        except BadInput as exc:
            self._failed("refused", name, str(exc), EXIT_BAD_INPUT)
            return False
        except FsdpfastError as exc:
            self._failed("failed", name, str(exc), EXIT_FAILURE)
            return False
        except OSError as exc:
            self._failed("failed", name, f"{exc.filename or ''}: {exc.strerror or exc}", EXIT_FAILURE)
            return False
        self.current = None
        self.reported = report.bytes_written is not None
        self.events(
            "published",
            checkpoint=name,
            out=out,
            seconds=None if report.seconds is None else round(report.seconds, 3),
            bytes=report.bytes_written,
            files=report.files,
            warnings=report.warnings,
        )
        return True

    def _merge_in_processes(self, checkpoint: Checkpoint, out: str):
        try:
            settings = self.settings
            nodes = (settings.nnodes, settings.rdzv_endpoint, checkpoint.name)
            return merge_in_processes(checkpoint.path, out, settings.nproc, list(settings.merge_words), nodes)
        except KeyboardInterrupt as exc:  # the processes were stopped: had they renamed their output into place?
            if published(out, checkpoint.path, self.settings.options.dtype, self.settings.options.fp8_skip):
                raise InterruptedAfterPublishing(str(exc)) from exc
            raise

    def _failed(self, event: str, name: str, reason: str, status: int) -> None:
        self.current = None
        self.events(event, checkpoint=name, reason=reason)
        self.status = max(self.status, status)

    def _then(self, out: str) -> None:
        """--then once per published folder: on several nodes, on the one that got the report."""
        if self.settings.then and self.reported:
            status = run_then(self.settings.then, out, self.settings.then_shell)
            self.events("then", command=self.settings.then, out=out, status=status)

    def _keep_last(self) -> None:
        """Remove all but the newest K outputs merged from this run (by the step in their names)."""
        settings = self.settings
        if settings.keep_last is None:
            return
        ours = sorted(outputs_of_run(settings.out_root, settings.run_dir), key=publishing_order)
        for name in ours[: max(0, len(ours) - settings.keep_last)]:
            folder = _output(settings.out_root, name)
            try:
                kept = remove_output(folder)
            except BadInput as exc:  # a merge into it is running (another watcher): next pass
                self.events("failed", checkpoint=name, reason=str(exc))
                continue
            self.events("removed", out=folder, kept=kept)


def _output(out_root: str, name: str) -> str:
    """OUT_ROOT/<name>: a folder, or an object-store prefix (a URL, "/"-joined)."""
    return f"{out_root.rstrip('/')}/{name}" if is_remote(out_root) else os.path.join(out_root, name)


def _shown(path: str) -> str:
    """A folder as the events say it: absolute, or the object store's URL as given."""
    return path if is_remote(path) else os.path.abspath(path)


def _on_sigterm():
    """SIGTERM stops the watcher as Ctrl-C does (the handler it replaces, to put back), or None off the main thread."""

    def stop(signum, frame):
        raise Stop("SIGTERM")

    try:
        return signal.signal(signal.SIGTERM, stop)
    except ValueError:
        return None
