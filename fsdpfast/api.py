"""The public functions: plan a merge, run it, report what was done."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace

from . import readers
from .checks.copies import check_copies
from .checks.ties import check_tied_bytes
from .errors import BadInput, InterruptedAfterPublishing, option
from .execute.engines import check_engine_name, select_engine
from .execute.measurements import job_kind
from .execute.parts import share_out, tensor_bytes, tensor_checksums
from .execute.writer import execute
from .group import MergeGroup, local_processes
from .hf.config_files import copy_config_files, write_built_config
from .io.earlier_output import overwrite_refusal
from .io.local_target import LocalTarget
from .io.output_place import check_output_place
from .io.sources import rebased
from .lora import output as lora_output
from .lora import plan as lora_plan
from .lora.targets import check_targets
from .manifest import build_manifest, check_same_sources, check_unchanged, source_identity
from .plan.checks import check_plan
from .plan.layout import DEFAULT_MAX_SHARD_SIZE, OutputFile, index_json, plan_files, tensor_nbytes
from .plan.model import MergePlan
from .plan.model_check import check_against_model, load_expected_model
from .plan.normalise import clean_name, parse_dtype, prepare
from .progress import Progress
from .rank_agreement import check_same_copy, check_same_options, compared_options, content_of
from .wording import count, size

log = logging.getLogger("fsdpfast")  # -v shows each decision on stderr


@dataclass
class MergeReport:
    """What `merge` did: where, from which layout and world size, with which engine, how many tensors
    and bytes in which files, how long; `tied` maps each name written to the names it stands for,
    `copied` the config and tokenizer files, `notes` what was assumed or left out. `summary()` is
    the command line's text."""

    out_dir: str
    layout: str
    world_size: int
    engine: str
    tensors: int
    bytes_written: int  # tensor data, as in the index's total_size
    files: list[str]
    seconds: float
    tied: dict[str, list[str]] = field(default_factory=dict)  # kept name -> names not written
    copied: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # the output needs something more before it is usable
    adapters: list[str] = field(default_factory=list)  # PEFT adapter folders written (OUT/lora_adapter...)
    processes: int = 1  # how many processes wrote it (torchrun)

    def summary(self) -> str:
        lines = [
            f"merged {count(self.tensors, 'tensor')} ({size(self.bytes_written)}) from {count(self.world_size, 'rank')} "
            f"[{self.layout}] into {self.out_dir} in {self.seconds:.2f} s with the {self.engine} engine"
            + (f" in {self.processes} processes" if self.processes > 1 else ""),
            f"files: {', '.join(self.files)}",
        ]
        lines += [f"tied: {', '.join(names)} written once as {kept}" for kept, names in self.tied.items()]
        lines += [
            f"adapter: {os.path.join(self.out_dir, folder)} (PeftModel.from_pretrained(base, that folder))"
            for folder in self.adapters
        ]
        lines += [f"note: {note}" for note in self.notes]
        lines += [f"warning: {warning}" for warning in self.warnings]
        return "\n".join(lines)


def plan_merge(
    src: str,
    *,
    dtype: str | None = "keep",
    layout: str | None = None,
    config: str | None = None,
    allow_extra_tensors: bool = False,
    full_copy_check: bool = False,
    merge_lora=None,
    lora_alpha: float | None = None,
    lora_r: int | None = None,
    base: str | None = None,
    **options,
) -> MergePlan:
    """Read a checkpoint folder's metadata and return the MergePlan, moving no tensor bytes.

    When config.json is known (CKPT_DIR/huggingface/, the folder's own, or `config`) and
    transformers is importable, the model class it names is built on the meta device and the
    merge's names and shapes must match it: a missing weight, a wrong shape or (unless
    `allow_extra_tensors`) a tensor the model does not have is refused before any byte moves.

    Copies the checkpoint holds twice (buffers on every rank, HSDP replicas) must agree with the
    one that is read: a sample of each is compared (checks.copies), every byte with `full_copy_check`.

    `options`, each for one layout (readers.LAYOUT_OPTIONS), None meaning not given:
    `prefix` (dcp) the model part of a nested state dict; `tag` (deepspeed-zero) the checkpoint
    tag, default the one `latest` names; `exclude_frozen` (deepspeed-zero) True leaves out frozen
    parameters, as zero_to_fp32's exclude_frozen_parameters; `wrap` (fsdp1-flat) the module class
    names FSDP1 wrapped, default the model's decoder-layer class; `use_orig_params` (fsdp1-flat),
    default detected.

    PEFT LoRA checkpoints (lora.plan): the plan is the base model under its own names, with
    `plan.adapters` to write beside it; `merge_lora` (True, or adapter names in order) fuses them
    into the weights instead; `lora_alpha` / `lora_r` give what the checkpoint does not record;
    `base` is the model folder a LoRA-only checkpoint was trained on.
    """
    if config is not None and not os.path.isfile(os.path.join(config, "config.json")):
        raise BadInput(f"{config}: --config folder has no config.json")
    plan = readers.read_plan(os.fspath(src), layout, os.fspath(config) if config else None, lora_r=lora_r, **options)
    check_plan(plan)  # every element of every tensor exactly once, inside its file
    plan = check_copies(plan, full=full_copy_check)
    if config is not None:
        plan = plan.but(config_dir=os.fspath(config))
    lora = dict(merge_lora=merge_lora, lora_alpha=lora_alpha, lora_r=lora_r, base=base)
    plan = lora_plan.read_adapters(plan, os.fspath(src), **lora)
    expected, why_not = load_expected_model(plan.config_dir, plan.built_config)
    plan = check_targets(plan, expected, why_not)  # each adapted module the model's, written or fused
    plan = lora_plan.fuse_chosen(plan, os.fspath(src), **lora)
    for adapter in plan.adapters:  # PEFT's own names: not checked against the model class
        adapter.plan = prepare(adapter.plan, dtype, None, check_tied_bytes=check_tied_bytes)
    lora_only = not plan.tensors and bool(plan.adapters)
    if lora_only:
        expected, why_not = None, "a LoRA-only checkpoint"
    plan = prepare(plan, dtype, plan.config_dir, expected, check_tied_bytes=check_tied_bytes)
    if allow_extra_tensors:  # recorded with the layout options, so verify --against plans the same way
        plan = plan.but(options={**plan.options, "allow_extra_tensors": True})
    if expected is not None:
        shapes = {name: t.shape for t in plan.tensors for name in (t.name, *t.aliases)}
        plan = plan.noted(
            *check_against_model(shapes, expected, allow_extra_tensors, tuple(map(clean_name, plan.left_out)))
        )
    elif why_not == "no config.json":
        plan = plan.noted(
            warnings=(
                "the output has no config.json, so from_pretrained cannot load it until one is added: "
                f"pass {option('config', meta='DIR')} (a folder with the model's config.json), or copy it in",
            )
        )
    elif not lora_only:
        plan = plan.noted(f"the names and shapes were not checked against the model: {why_not}")
    return plan


def inspect(
    src: str,
    *,
    layout: str | None = None,
    config: str | None = None,
    allow_extra_tensors: bool = False,
    lora_alpha: float | None = None,
    lora_r: int | None = None,
    **options,
) -> dict:
    """What a merge would write, from metadata alone: layout, world size, every tensor, totals, notes,
    what was assumed rather than read (fsdp1-flat: the model, wrap classes, units, param order), and
    PEFT LoRA adapters (rank, alpha, target modules)."""
    plan = plan_merge(
        src,
        layout=layout,
        config=config,
        allow_extra_tensors=allow_extra_tensors,
        lora_alpha=lora_alpha,
        lora_r=lora_r,
        **options,
    )
    tensors = [
        {
            "name": t.name,
            "shape": list(t.shape),
            "dtype": t.source_dtype,
            "bytes": tensor_nbytes(t),
            "tied": list(t.aliases),
        }
        for t in plan.tensors
    ]
    return {
        "checkpoint": os.fspath(src),
        "layout": plan.layout,
        "model_folder": plan.model_folder,  # where a framework put the model inside the folder given (None: itself)
        "world_size": plan.world_size,
        "tensors": tensors,
        "total_tensors": len(tensors),
        "total_bytes": sum(t["bytes"] for t in tensors),
        "source_files": sorted({s.path for s in plan.sources}),
        "config_dir": plan.config_dir,
        "built_config": plan.built_config,  # config.json built from the checkpoint's own records (no config_dir)
        "notes": list(plan.notes),
        "warnings": list(plan.warnings),
        "assumed": plan.assumed,
        "adapters": lora_plan.describe(plan),
    }


def merge(
    src: str,
    dst: str,
    *,
    dtype: str | None = "keep",
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    layout: str | None = None,
    config: str | None = None,
    overwrite: bool = False,
    engine: str = "auto",
    progress: bool = False,
    allow_extra_tensors: bool = False,
    merge_lora=None,
    lora_alpha: float | None = None,
    lora_r: int | None = None,
    base: str | None = None,
    group=None,
    **options,
) -> MergeReport:
    """Merge the sharded checkpoint in folder `src` into a Hugging Face folder `dst`; a MergeReport.

    dtype: "keep" (default), "bf16", "fp16" or "fp32" (or "bfloat16", "float16", "float32"):
        floating tensors are cast, rounding as torch's `.to()`; others are kept.
    max_shard_size: the largest output file ("5GB", "500MB", "2GiB" or bytes); more than one file
        adds model.safetensors.index.json.
    layout: force a layout instead of detecting it ("fsdp-ranks", "guide-ranks", "dcp", "dcp-hf",
        "deepspeed-zero", "fsdp1-flat", "megatron").
    config: a folder whose config.json, generation config and tokenizer files are copied (default:
        the checkpoint's huggingface/ folder).
    overwrite: replace `dst` if it is an earlier merge (an empty `dst` is replaced anyway; any other
        existing folder is refused).
    engine: "auto" (default: the engine measured fastest on this machine for this kind of conversion,
        execute/measurements.py; without such a record the native cpu engine, else torch), "cpu",
        "cuda", "torch".
    progress: a progress bar on stderr when it is a terminal.
    options: the layout options of `plan_merge` (prefix, tag, exclude_frozen, wrap, use_orig_params).
    group: a torch.distributed process group (gloo) of processes that all call `merge` with the same
        arguments, `src` and `dst` being the same folders of a filesystem they share: rank 0 plans and
        publishes, every rank writes its share of the bytes (fsdpfast.group). The group's timeout is
        how long a rank waits for the others. None, or a group of one: this process alone.

    `dst` (and its missing parents) appears complete or not at all: everything is written to a
    hidden sibling folder that is renamed into place at the end, with the manifest
    (fsdpfast-manifest.json). A source file that changes size or modification time during the
    merge aborts it (SourceChanged). Raises BadInput (a ValueError) for input it cannot merge as
    given, FsdpfastError for the rest.
    merge_lora, lora_alpha, lora_r, base: PEFT LoRA checkpoints (plan_merge), whose adapters are
        written to `dst/lora_adapter` unless fused.
    """
    start = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    processes = MergeGroup(group)
    # plan -> layout -> target: on rank 0; every rank gets the same job
    asked = dict(  # what decides the output: the same on every process (rank_agreement)
        dtype=dtype,
        max_shard_size=max_shard_size,
        layout=layout,
        config=config,
        overwrite=overwrite,
        engine=engine,
        allow_extra_tensors=allow_extra_tensors,
        merge_lora=merge_lora,
        lora_alpha=lora_alpha,
        lora_r=lora_r,
        base=base,
        **options,
    )
    job = processes.lead(
        lambda: _prepare(src, dst, asked, several=not processes.alone), abandon=lambda job: job.target.discard()
    )
    log.info("planned in %.2f s", time.perf_counter() - start)
    try:
        # execute: each process its share of the bytes; rank 0 gets every piece's checksum
        pieces = processes.gather(lambda: _write_share(job, processes, src, dst, progress, asked))
        # finish (index, config, manifest) and publish, on rank 0
        return processes.lead(lambda: _finish(job, [p for share in pieces for p in share], start, processes.size))
    except KeyboardInterrupt:
        if (
            job.target is not None and job.target.published
        ):  # Ctrl-C or SIGTERM came after the rename: OUT_DIR is complete
            raise InterruptedAfterPublishing(f"{dst} was published complete before the interrupt") from None
        raise
    finally:
        if job.target is not None:  # None: another rank that never joined it
            job.target.discard()


@dataclass
class MergeJob:
    """What every process of a merge works from: the plan, the files, the engine's name, the sources'
    identity and the target (rank 0's; the others join it by its token); with several processes,
    rank 0's options and the fingerprints of the files it planned from, for the others to compare."""

    src: str
    dst: str
    dtype: str | None
    plan: MergePlan
    files: list[OutputFile]
    adapter_files: list[OutputFile]
    identity: list[dict]
    engine: object  # the Engine; its name travels to the other ranks, which make their own
    target: object  # the Target; its token travels
    token: str = ""
    options: dict = field(default_factory=dict)  # rank_agreement.compared_options
    content: dict = field(default_factory=dict)  # path -> fingerprint (rank_agreement.content_of)

    def __getstate__(self):  # what rank 0 sends: names, not its engine or its lock
        state = dict(self.__dict__, engine=self.engine.name, target=None, token=self.target.token)
        state["plan"] = self.plan.but(copies=())  # checked by rank 0 already
        return state

    def join(self, src: str, dst: str, rank: int, asked: dict) -> None:
        """On another rank: its own view of the sources and the target (the same folders, perhaps
        mounted elsewhere), checked to be rank 0's, as its options are."""
        check_same_options(compared_options(asked), self.options, rank)
        self.plan = self.plan.but(sources=rebased(self.plan.sources, self.src, src))
        self.src = src
        check_same_sources(src, self.identity)
        check_same_copy(src, self.content, rank)
        self.target = LocalTarget.join(dst, self.token)
        self.engine = select_engine(self.engine, threads_share=local_processes())

    def check_sources(self) -> None:
        check_unchanged(self.src, self.identity)


def _prepare(src: str, dst: str, asked: dict, several: bool) -> MergeJob:
    """Plan and lay out the merge, choose the engine, and make the target (lock, staging folder)."""
    check_engine_name(asked["engine"])
    plan_args = {name: value for name, value in asked.items() if name not in ("engine", "overwrite")}
    plan, files = _plan_and_lay_out(src, dst, **plan_args)
    runner = select_engine(asked["engine"], job_kind(plan.tensors), threads_share=local_processes())
    _log_plan(plan, files, runner.name)
    identity = source_identity(src, (s.path for s in plan.sources))  # before any byte moves
    options, content = {}, {}
    if several:  # for the other ranks to compare theirs with (a few small reads per file)
        options, content = compared_options(asked), content_of(src, (entry["path"] for entry in identity))
    return MergeJob(
        src,
        dst,
        parse_dtype(asked["dtype"]),
        plan,
        files,
        lora_output.adapter_outputs(plan),
        identity,
        runner,
        LocalTarget(dst, asked["overwrite"]),
        options=options,
        content=content,
    )


def _plan_and_lay_out(src: str, dst: str, *, dtype, max_shard_size, config, base, **plan_args):
    """What merge and dry_run both do first: check the output's place, plan, and lay out the files
    (none for a LoRA-only checkpoint: its adapter alone is written)."""
    parse_dtype(dtype)
    check_output_place(dst, src, os.fspath(config) if config else None)
    if base:
        check_output_place(dst, os.fspath(base), None)
    plan = plan_merge(src, dtype=dtype, config=config, base=base, **plan_args)
    lora_output.check_writable(plan)
    files = plan_files(plan, max_shard_size) if plan.tensors or not plan.adapters else []
    return plan, files


def _write_share(job: MergeJob, processes: MergeGroup, src: str, dst: str, progress: bool, asked: dict) -> list:
    """This process's share of the bytes (all of them, alone); the CRC-32C of each piece written."""
    if processes.rank != 0:
        job.join(src, dst, processes.rank, asked)
    share = share_out(job.files + job.adapter_files, processes.size)[processes.rank]
    bar = Progress(tensor_bytes(share), enabled=progress and processes.rank == 0)
    start = time.perf_counter()
    try:
        written = execute(
            job.plan,
            share,
            job.target,
            engine=job.engine,
            progress=bar.advance,
            after_file=lambda _: job.check_sources(),
        )
    finally:
        bar.close()
    log.info(
        "rank %d wrote %d bytes in %.2f s",
        processes.rank,
        sum(part.nbytes for part in share),
        time.perf_counter() - start,
    )
    return written


def _finish(job: MergeJob, pieces: list, start: float, processes: int) -> MergeReport:
    """The small files (index, config, adapter configs, manifest), a last look at the sources, then publish."""
    plan, files, target = job.plan, job.files, job.target
    checksums = tensor_checksums(files + job.adapter_files, pieces)
    if len(files) > 1:
        target.write_json("model.safetensors.index.json", index_json(files))
    copied = copy_config_files(plan.config_dir, target, job.dtype) if plan.config_dir and files else []
    if plan.built_config is not None and not plan.config_dir and files:
        copied = write_built_config(plan.built_config, target, job.dtype)
    adapters, adapter_notes = lora_output.write_adapter_files(
        plan, target, checksums, job.src, job.identity, job.engine.name, job.dtype, job.dst
    )
    model_checksums = {name: crc for f in files for name, crc in checksums[f.name].items()}
    manifest = build_manifest(job.src, plan, files, model_checksums, job.identity, job.engine.name, job.dtype)
    if adapters:
        manifest["adapters"] = adapters  # each with a manifest of its own (lora.output)
    target.write_manifest(manifest)  # last: it lists every file above
    job.check_sources()
    target.publish()
    return MergeReport(
        out_dir=job.dst,
        layout=plan.layout,
        world_size=plan.world_size,
        engine=job.engine.name,
        tensors=len(plan.tensors) + sum(len(a.plan.tensors) for a in plan.adapters),
        bytes_written=sum(p.nbytes for f in files + job.adapter_files for p in f.tensors),
        files=[f.name for f in files]
        + (["model.safetensors.index.json"] if len(files) > 1 else [])
        + lora_output.written_files(adapters),
        seconds=time.perf_counter() - start,
        tied={t.name: list(t.aliases) for t in plan.tensors if t.aliases},
        copied=copied,
        notes=list(plan.notes) + adapter_notes,
        warnings=[*plan.warnings, *target.warnings],
        adapters=adapters,
        processes=processes,
    )


def dry_run(
    src: str,
    dst: str,
    *,
    dtype: str | None = "keep",
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    layout: str | None = None,
    config: str | None = None,
    allow_extra_tensors: bool = False,
    merge_lora=None,
    lora_alpha: float | None = None,
    lora_r: int | None = None,
    base: str | None = None,
    **options,
) -> dict:
    """What `merge` would write (files, each tensor's file, offset, bytes, dtype), writing nothing."""
    plan, files = _plan_and_lay_out(
        os.fspath(src),
        os.fspath(dst),
        dtype=dtype,
        max_shard_size=max_shard_size,
        layout=layout,
        config=config,
        allow_extra_tensors=allow_extra_tensors,
        merge_lora=merge_lora,
        lora_alpha=lora_alpha,
        lora_r=lora_r,
        base=base,
        **options,
    )
    files += [replace(f, name=name) for name, f in lora_output.dry_run_files(plan)]
    return {
        "checkpoint": os.fspath(src),
        "out_dir": os.fspath(dst),
        "layout": plan.layout,
        "world_size": plan.world_size,
        "files": [
            {
                "name": f.name,
                "bytes": f.size,
                "header_bytes": len(f.header),
                "tensors": [
                    {
                        "name": p.tensor.name,
                        "dtype": p.tensor.target_dtype,
                        "shape": list(p.tensor.shape),
                        "offset": p.offset,
                        "bytes": p.nbytes,
                    }
                    for p in f.tensors
                ],
            }
            for f in files
        ],
        "total_bytes": sum(p.nbytes for f in files for p in f.tensors),
        "notes": list(plan.notes) + _existing_output_notes(os.fspath(dst)),
        "warnings": list(plan.warnings),
    }


def _existing_output_notes(dst: str) -> list[str]:
    if not os.path.lexists(dst):
        parent = os.path.dirname(os.path.abspath(dst))
        return [] if os.path.isdir(parent) else [f"{parent} does not exist: the merge will create it"]
    if os.path.isdir(dst) and not os.path.islink(dst) and not os.listdir(dst):
        return [f"{dst} is an empty folder: the merge will replace it"]
    refusal = overwrite_refusal(dst, dst) if os.path.isdir(dst) else f"{dst} is not a folder"
    if refusal is None:
        return [f"{dst} exists: the merge needs {option('overwrite', True)}"]
    return [f"{dst} exists: the merge will refuse it, even with {option('overwrite', True)} ({refusal})"]


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
