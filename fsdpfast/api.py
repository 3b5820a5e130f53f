"""The public functions: plan a merge, run it, report what was done (each composes options -> pipeline)."""

from __future__ import annotations

import os

from .options import MergeOptions, layout_options_only, merge_options
from .pipeline import job as merge_job
from .pipeline import plan as pipeline_plan
from .pipeline.report import DryRun, Inspection, MergeReport
from .pipeline.run import run_merge
from .plan.layout import DEFAULT_MAX_SHARD_SIZE
from .plan.model import MergePlan
from .readers.dcp import archive_windows
from .remote.metadata_mirror import mirrored_metadata
from .remote.urls import is_remote

__all__ = ["MergeReport", "dry_run", "inspect", "merge", "plan_merge"]

_NOT_OPTIONS = ("src", "dst", "progress", "group", "options")  # the public functions' other arguments


def _options(arguments: dict) -> MergeOptions:
    """MergeOptions from a public function's own arguments (its `locals()` on entry): parsed once, here."""
    given = {name: value for name, value in arguments.items() if name not in _NOT_OPTIONS}
    return merge_options(**given, **layout_options_only(arguments["options"]))


def plan_merge(
    src: str,
    *,
    dtype: str | None = "keep",
    layout: str | None = None,
    config: str | None = None,
    allow_extra_tensors: bool = False,
    expert_layout: str = "hub",
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

    PEFT LoRA checkpoints (lora.transform): the plan is the base model under its own names, with
    `plan.adapters` to write beside it; `merge_lora` (True, or adapter names in order) fuses them
    into the weights instead; `lora_alpha` / `lora_r` give what the checkpoint does not record;
    `base` is the model folder a LoRA-only checkpoint was trained on.
    """
    return pipeline_plan.plan_merge(os.fspath(src), _options(locals()))


def inspect(
    src: str,
    *,
    layout: str | None = None,
    config: str | None = None,
    allow_extra_tensors: bool = False,
    expert_layout: str = "hub",
    lora_alpha: float | None = None,
    lora_r: int | None = None,
    **options,
) -> dict:
    """What a merge would write, from metadata alone: layout, world size, every tensor, totals, notes,
    what was assumed rather than read (fsdp1-flat: the model, wrap classes, units, param order), and
    PEFT LoRA adapters (rank, alpha, target modules)."""
    src, asked = os.fspath(src), _options(locals())
    if is_remote(src):  # planned from the metadata fetched into a stand-in; paths said as the store's
        with mirrored_metadata(src, windows_of=archive_windows) as mirror:
            plan = pipeline_plan.plan_merge(mirror.root, asked)
            features = {
                k: v for t in pipeline_plan.plan_transforms(mirror.root, asked) for k, v in t.describe(plan).items()
            }
            return Inspection.of(mirror.url, plan, features, said=mirror.said).as_dict()
    plan = pipeline_plan.plan_merge(src, asked)
    features = {
        key: value for t in pipeline_plan.plan_transforms(src, asked) for key, value in t.describe(plan).items()
    }
    return Inspection.of(src, plan, features).as_dict()


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
    read_mode: str = "auto",
    progress: bool = False,
    allow_extra_tensors: bool = False,
    expert_layout: str = "hub",
    merge_lora=None,
    lora_alpha: float | None = None,
    lora_r: int | None = None,
    base: str | None = None,
    group=None,
    **options,
) -> MergeReport:
    """Merge the sharded checkpoint in folder `src` into a Hugging Face folder `dst`; a MergeReport.

    dtype: "keep" (default), "bf16", "fp16" or "fp32" (or "bfloat16", "float16", "float32"):
        floating tensors are cast, rounding as torch's `.to()`; others are kept. "fp8" (or
        "fp8-block"): the linear weights in block-scaled float8_e4m3fn with a float32 scale_inv per
        128x128 block, the rest bf16, config.json's quantization_config (docs/usage.md, FP8 output);
        `fp8_skip="PATTERN,..."` leaves the names it matches unquantized.
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
    read_mode: how the sources are read: "auto" (default: with large parallel reads when the checkpoint
        is on a network filesystem or a FUSE mount, NFS, Lustre, GPFS, BeeGFS, CIFS/SMB, CephFS, 9p;
        else mapped), "mmap" or "pread". The output is the same either way.
    progress: a progress bar on stderr when it is a terminal.
    options: the layout options of `plan_merge` (prefix, tag, exclude_frozen, wrap, use_orig_params).
    group: a torch.distributed process group (gloo) of processes that all call `merge` with the same
        arguments, `src` and `dst` being the same folders of a filesystem they share (or the same store
        URLs): rank 0 plans and publishes, every rank writes its share of the bytes (pipeline.processes;
        into a store, whole files of its own: remote.object_target). The group's timeout is
        how long a rank waits for the others. None, or a group of one: this process alone.

    `dst` (and its missing parents) appears complete or not at all: everything is written to a
    hidden sibling folder that is renamed into place at the end, with the manifest
    (fsdpfast-manifest.json). A source file that changes size or modification time during the
    merge aborts it (SourceChanged). Raises BadInput (a ValueError) for input it cannot merge as
    given, FsdpfastError for the rest.
    merge_lora, lora_alpha, lora_r, base: PEFT LoRA checkpoints (plan_merge), whose adapters are
        written to `dst/lora_adapter` unless fused.
    """
    given = {name: value for name, value in locals().items() if name not in _NOT_OPTIONS}
    given.update(options)  # what decides the output, as given: the same on every process (rank_agreement)
    return run_merge(src, dst, lambda: merge_options(**given), given, progress, group)


def merge_with(src: str, dst: str, options: MergeOptions, *, progress: bool = False) -> MergeReport:
    """`merge` in this process with options parsed already (options.merge_options): one parse for
    the many merges of a `watch`."""
    return run_merge(src, dst, lambda: options, options.given, progress, None)


def dry_run(
    src: str,
    dst: str,
    *,
    dtype: str | None = "keep",
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    layout: str | None = None,
    config: str | None = None,
    allow_extra_tensors: bool = False,
    expert_layout: str = "hub",
    merge_lora=None,
    lora_alpha: float | None = None,
    lora_r: int | None = None,
    base: str | None = None,
    **options,
) -> dict:
    """What `merge` would write (files, each tensor's file, offset, bytes, dtype), writing nothing."""
    src, dst, asked = os.fspath(src), os.fspath(dst), _options(locals())
    plan, files, extras = merge_job.lay_out(src, dst, asked)
    return DryRun.of(src, dst, plan, files + [extra.placed for extra in extras]).as_dict()
