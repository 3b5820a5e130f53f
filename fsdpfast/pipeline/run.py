"""One merge run to its end on every process of the group: plan (rank 0), write (each its share),
finish (rank 0 publishes), with the staging folder removed on any way out but publishing.

A first merge of a config whose model ties other names than config.json says (found once the
model check's build finishes: pipeline.model_check.TiesChanged) is planned and written again.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

from ..errors import InterruptedAfterPublishing
from ..readers.dcp import archive_windows
from ..remote.metadata_mirror import mirrored_metadata
from ..remote.urls import is_remote
from . import job as merge_job
from .model_check import TiesChanged
from .processes import MergeGroup
from .report import MergeReport

log = logging.getLogger("fsdpfast")


def run_merge(src, dst, options_of, given: dict, progress: bool, group) -> MergeReport:
    """`options_of()`: the MergeOptions (parsed on rank 0 only); `given`: as given, for the other ranks to compare."""
    start = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    processes = MergeGroup(group)
    if not is_remote(src) or processes.rank != 0:  # the other ranks read a store as rank 0's job says
        return _merge_twice(src, dst, options_of, given, processes, progress, start, None)
    with mirrored_metadata(src, windows_of=archive_windows) as mirror:  # planned from its metadata, read from the store
        report = _merge_twice(mirror.root, dst, options_of, given, processes, progress, start, mirror)
        # the notes name the store's objects, never the stand-in
        return replace(
            report, notes=[mirror.said(n) for n in report.notes], warnings=[mirror.said(w) for w in report.warnings]
        )


def _merge_twice(src, dst, options_of, given, processes, progress, start, remote) -> MergeReport:
    try:
        return _merge_once(src, dst, options_of, given, processes, progress, start, remote)
    except TiesChanged as changed:  # one process alone, first build of this config: now planned with the model
        log.info("%s", changed)
        return _merge_once(src, dst, options_of, given, processes, progress, start, remote)


def _merge_once(
    src: str, dst: str, options_of, given: dict, processes, progress: bool, start: float, remote=None
) -> MergeReport:
    job = None
    try:  # from the moment the job (its lock and staging folder) exists, `finally` closes it
        job = processes.plan(  # on rank 0, which parses the options (a bad one fails every rank as rank 0's)
            lambda: merge_job.prepare(src, dst, options_of(), several=not processes.alone, remote=remote),
            abandon=lambda job: job.close(),
        )
        log.info("planned in %.2f s", time.perf_counter() - start)
        pieces = processes.write(lambda: merge_job.write_share(job, processes, src, dst, progress, given))
        return processes.finish(
            lambda: merge_job.finish(job, [p for share in pieces for p in share], start, processes.size)
        )
    except KeyboardInterrupt:
        if job is not None and job.target is not None and job.target.published:  # Ctrl-C or SIGTERM after the rename
            raise InterruptedAfterPublishing(f"{dst} was published complete before the interrupt") from None
        raise
    finally:
        if job is not None:
            job.close()  # the staging folder removed unless published, the model check stopped if still running
