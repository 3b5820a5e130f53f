"""The job of one merge: the plan laid out into files, the engine and the target, and each step run on it.

`prepare` (rank 0) plans, lays out, chooses the engine and makes the target (lock, staging
folder); every process then works from the same MergeJob: `write_share` writes its share of the
bytes, `finish` (rank 0) writes the small files (pipeline.finish) and publishes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..errors import BadInput
from ..execute.engines import select_engine
from ..execute.measurements import job_kind
from ..execute.parts import share_out, share_whole_files, tensor_bytes
from ..execute.writer import execute
from ..hf.eos import eos_disagreements
from ..io.filesystems import nearest_existing, remote_filesystem
from ..io.local_target import LocalTarget
from ..io.output_place import check_output_place
from ..io.read_modes import chosen_read_mode, read_mode_note
from ..io.sources import open_sources, rebased
from ..manifest import check_same_sources, check_unchanged, source_identity
from ..options import MergeOptions
from ..plan.layout import OutputFile, plan_files
from ..plan.model import MergePlan
from ..plan.transform import ExtraFolder
from ..progress import Progress
from ..rank_agreement import check_same_copy, check_same_options, compared_options, content_of
from ..remote.object_target import ObjectTarget
from ..remote.range_sources import RangeSources
from ..remote.urls import is_remote
from .finish import FolderFiles, Provenance, write_small_files, written_names
from .model_check import DeferredCheck
from .plan import plan_transforms, planned_merge
from .processes import MergeGroup, local_processes
from .report import MergeReport

log = logging.getLogger("fsdpfast")  # -v shows each decision on stderr


@dataclass
class MergeJob:
    """What every process of a merge works from: the plan, the files (the model's, then each extra
    folder's), the engine's name, the sources' identity and the target (rank 0's; the others join it
    by its token); with several processes, rank 0's options and the fingerprints of the files it
    planned from, for the others to compare."""

    src: str
    dst: str
    dtype: str | None
    plan: MergePlan
    files: list[OutputFile]
    extras: list[ExtraFolder]
    identity: list[dict]
    engine: object  # the Engine; its name travels to the other ranks, which make their own
    target: object  # the Target; its token travels
    token: str = ""
    options: dict = field(default_factory=dict)  # rank_agreement.compared_options
    content: dict = field(default_factory=dict)  # path -> fingerprint (rank_agreement.content_of)
    read_mode: tuple[str, str | None] = ("mmap", None)  # io.read_modes.chosen_read_mode: the mode, and why
    check: DeferredCheck | None = None  # the model check still running (one process alone), done before publishing
    remote: object = None  # remote.metadata_mirror.Mirrored: `src` stands in for a checkpoint in an object store

    def __getstate__(self):  # what rank 0 sends: names, not its engine or its lock
        state = dict(self.__dict__, engine=self.engine.name, target=None, token=self.target.token, check=None)
        state["plan"] = self.plan.but(copies=())  # checked by rank 0 already
        return state

    def join(self, src: str, dst: str, rank: int, given: dict) -> None:
        """On another rank: its own view of the sources and the target (the same folders, perhaps
        mounted elsewhere), checked to be rank 0's, as its options are. A checkpoint in a store is
        read as rank 0 listed it: every ranged GET pinned to the ETags of its listing (`remote`)."""
        check_same_options(compared_options(given), self.options, rank)
        if self.remote is None:
            self.plan = self.plan.but(sources=rebased(self.plan.sources, self.src, src))
            self.src = src
            check_same_sources(src, self.identity)
            check_same_copy(src, self.content, rank)
        elif src.rstrip("/") != self.remote.url:
            raise BadInput(f"{src}: rank 0 merges {self.remote.url}; every rank must be given the same checkpoint")
        self.target = (ObjectTarget if is_remote(dst) else LocalTarget).join(dst, self.token)
        self.engine = large_writes_on_remote_output(select_engine(self.engine, threads_share=local_processes()), dst)

    def check_sources(self) -> None:
        if self.remote is None:  # a store's objects: each GET is pinned to its listed ETag instead
            check_unchanged(self.src, self.identity)

    def after_file(self, _part) -> None:
        """Once a file is written: the sources unchanged, and the model check if it has finished."""
        self.check_sources()
        self.check_model(wait=False)

    def check_model(self, wait: bool) -> None:
        """The model check of the plan, if it was left running: now if it is done (a refusal stops the
        writing early) or `wait`; the plan gets its notes."""
        if self.check is not None and (wait or self.check.ready()):
            self.plan = self.check.checked(self.plan)
            self.check = None

    def close(self) -> None:
        if self.check is not None:
            self.check.cancel()
        if self.target is not None:  # None: another rank that never joined it
            self.target.discard()

    @property
    def all_files(self) -> list[OutputFile]:
        """Every weights file executed: the extra folders' read the plan's sources too."""
        return self.files + [extra.placed for extra in self.extras]


def lay_out(src: str, dst: str, options: MergeOptions) -> tuple[MergePlan, list[OutputFile], list[ExtraFolder]]:
    """What merge and dry_run both do first: check the output's place, plan, and lay out the files
    (none when only extra folders are written: a LoRA-only checkpoint's adapter)."""
    plan, files, extras, _ = _lay_out(src, dst, options, wait=True)
    return plan, files, extras


def _lay_out(src: str, dst: str, options: MergeOptions, wait: bool):
    """lay_out, and the model check left running (None unless not `wait`)."""
    if not is_remote(dst):  # a prefix in a store cannot hold a local source
        check_output_place(dst, src, options.config_dir)
    if options.lora.base and not is_remote(dst):
        check_output_place(dst, options.lora.base, None)
    plan, check = planned_merge(src, options, wait=wait)
    try:
        extras = [extra for t in plan_transforms(src, options) for extra in t.outputs(plan, dst)]
        files = plan_files(plan, options.max_shard_bytes) if plan.tensors or not extras else []
        if files:  # the config folder's files are copied beside the weights: said where their eos ids disagree
            plan = plan.noted(warnings=tuple(eos_disagreements(plan.config_dir)))
    except BaseException:
        if check is not None:
            check.cancel()
        raise
    return plan, files, extras, check


def prepare(src: str, dst: str, options: MergeOptions, several: bool, remote=None) -> MergeJob:
    """Plan and lay out the merge, choose the engine, and make the target (lock, staging folder).
    One process alone writes while the model check runs (pipeline.model_check); with several, rank 0
    waits for it before the others are given the job. `remote`: the metadata_mirror.Mirrored that
    `src` stands in for (the checkpoint in a store), which the job carries to the other ranks."""
    plan, files, extras, check = _lay_out(src, dst, options, wait=several)
    job = None
    try:
        job = _job(src, dst, options, several, plan, files, extras, check)
        job.remote = remote
        return job
    except BaseException:
        if job is not None:
            job.close()  # its target discarded: interrupted between making it and handing it over
        elif check is not None:
            check.cancel()
        raise


def _job(src, dst, options: MergeOptions, several: bool, plan, files, extras, check) -> MergeJob:
    runner = select_engine(options.engine, job_kind(plan.tensors), threads_share=local_processes())
    runner = large_writes_on_remote_output(runner, dst)
    _log_plan(plan, files, runner.name)
    identity = source_identity(src, (s.path for s in plan.sources))  # before any byte moves
    compared, content = {}, {}
    if several:  # for the other ranks to compare theirs with (a few small reads per file)
        compared, content = compared_options(options.given), content_of(src, (entry["path"] for entry in identity))
    read_mode = chosen_read_mode(options.read_mode, plan.sources)
    log.info("sources read with %s%s", read_mode[0], f" ({read_mode[1]})" if read_mode[1] else "")
    # the target (lock, staging folder) last: from here to the caller's `finally: job.close()` only a few
    # bytecodes pass, where a SIGTERM or Ctrl-C could leave it behind (the next merge into it removes it)
    target = ObjectTarget(dst, options.overwrite) if is_remote(dst) else LocalTarget(dst, options.overwrite)
    try:
        return MergeJob(
            src,
            dst,
            options.dtype,
            plan,
            files,
            extras,
            identity,
            runner,
            target,
            "",
            compared,
            content,
            read_mode=read_mode,
            check=check,
        )
    except BaseException:
        target.discard()
        raise


def write_share(job: MergeJob, processes: MergeGroup, src: str, dst: str, progress: bool, given: dict) -> list:
    """This process's share of the bytes (all of them, alone); the CRC-32C of each piece written."""
    if processes.rank != 0:
        job.join(src, dst, processes.rank, given)
    shares = (share_whole_files if job.target.whole_files else share_out)(job.all_files, processes.size)
    if processes.rank == 0 and job.target.whole_files and processes.size > 1:
        job.target.written_elsewhere({p.file.name: p.file.size for share in shares[1:] for p in share})
    share = shares[processes.rank]
    bar = Progress(tensor_bytes(share), enabled=progress and processes.rank == 0)
    start = time.perf_counter()
    try:
        with _sources(job) as sources:
            written = execute(
                job.plan,
                share,
                job.target,
                engine=job.engine,
                sources=sources,
                progress=bar.advance,
                after_file=job.after_file,
            )
    finally:
        bar.close()
    if processes.rank != 0 and job.target.whole_files:
        job.target.hand_over()  # its objects are rank 0's to publish or delete (remote.object_target)
    log.info(
        "rank %d wrote %d bytes in %.2f s",
        processes.rank,
        sum(part.nbytes for part in share),
        time.perf_counter() - start,
    )
    return written


def _sources(job: MergeJob):
    """The plan's Source: its files read as io.read_modes chose, or, for a checkpoint in an object store,
    by ranged GETs of its objects (each pinned to the ETag its metadata was read from)."""
    if job.remote is None:
        return open_sources(job.plan.sources, job.read_mode[0])
    buffers = rebased(job.plan.sources, job.remote.root, job.remote.url)
    return RangeSources(buffers, etags=job.remote.etags)


REMOTE_WRITE_BYTES = 4 << 20  # one pwrite of the native engine where the output is on a network filesystem


def large_writes_on_remote_output(engine, dst: str):
    """The engine, writing 4 MB chunks instead of 1 MB where OUT_DIR is on a network filesystem or a
    FUSE mount: fewer, larger requests. Its threads take the chunks in file order, so the writes
    advance through each file nearly sequentially (a window of one chunk per thread)."""
    if is_remote(dst):
        return engine
    if getattr(engine, "chunk_bytes", None) is not None and remote_filesystem(nearest_existing(dst)):
        engine.chunk_bytes = max(engine.chunk_bytes, REMOTE_WRITE_BYTES)
    return engine


def finish(job: MergeJob, pieces: list, start: float, processes: int) -> MergeReport:
    """The model check (if it was still running), the small files (index, config, extra folders,
    manifest), a last look at the sources, then publish."""
    job.check_model(wait=True)
    plan, files, target = job.plan, job.files, job.target
    beside = FolderFiles(
        config_dir=plan.config_dir if files else None,
        config=plan.built_config if files and not plan.config_dir else None,
        dtype=job.dtype,
        extras=job.extras,
    )
    identity = job.remote.identity(job.identity) if job.remote else job.identity  # objects: by ETag
    source = Provenance(job.remote.url if job.remote else job.src, identity, job.engine.name)
    done = write_small_files(target, plan, files, pieces, beside, source, job.dtype)
    job.check_sources()
    target.publish()
    return MergeReport(
        out_dir=job.dst,
        layout=plan.layout,
        world_size=plan.world_size,
        engine=job.engine.name,
        tensors=len(plan.tensors) + sum(len(extra.plan.tensors) for extra in job.extras),
        bytes_written=sum(p.nbytes for f in job.all_files for p in f.tensors),
        files=written_names(files, job.extras),
        seconds=time.perf_counter() - start,
        tied={t.name: list(t.aliases) for t in plan.tensors if t.aliases},
        copied=done.copied,
        notes=list(plan.notes) + done.notes + [n for n in [read_mode_note(*job.read_mode)] if n],
        warnings=[*plan.warnings, *target.warnings],
        adapters=done.extras,
        processes=processes,
    )


def _log_plan(plan: MergePlan, files: list[OutputFile], engine: str) -> None:
    log.info(
        "layout %s, world size %d, %d tensors from %d source files",
        plan.layout,
        plan.world_size,
        len(plan.tensors),
        len({s.path for s in plan.sources}),
    )
    log.info("engine %s", engine)
    for f in files:
        log.info("file %s: %d tensors, %d bytes", f.name, len(f.tensors), f.size)
        for p in f.tensors:
            log.info(
                "  %s -> %s at byte %d (%d bytes, %s -> %s)",
                p.tensor.name,
                f.name,
                p.offset,
                p.nbytes,
                p.tensor.source_dtype,
                p.tensor.target_dtype,
            )
