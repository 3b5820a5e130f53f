"""`verify --against CKPT`: every tensor recomputed from the shards and compared with the output byte for byte.

The merge's own plan, runner and kernels do the work, chunk by chunk, nothing held whole; the sink
compares instead of writing.
"""

from __future__ import annotations

import os
from dataclasses import replace

from .. import _ops
from ..dtypes import CASTABLE, itemsize, target_dtype
from ..errors import BadInput, ModelMismatch
from ..execute.compare import CompareSink
from ..execute.engines import compute_device
from ..execute.runner import run
from ..io.read_modes import chosen_read_mode
from ..io.safetensors_folder import MappedFiles, StoredTensor
from ..io.sources import open_sources, rebased
from ..manifest import CHECKSUM
from ..options import layout_options_only, merge_options
from ..pipeline.plan import folder_checks, kept_in_fp32, plan_merge
from ..plan.layout import PlacedTensor
from ..readers.dcp import archive_windows
from ..remote.metadata_mirror import mirrored_metadata
from ..remote.range_sources import RangeSources
from ..remote.urls import is_remote
from .report import Mismatch, VerifyReport, compare_names


def check_against(
    report: VerifyReport,
    stored: dict[str, StoredTensor],
    files: MappedFiles,
    checkpoint: str,
    manifest: dict | None,
    layout: str | None,
    options: dict,
) -> None:
    report.checks.append(f"recomputed from {checkpoint}")
    if is_remote(checkpoint):  # planned from its metadata's stand-in, the shards' bytes by ranged GETs
        with mirrored_metadata(checkpoint, windows_of=archive_windows) as mirror:
            return _check(report, stored, files, mirror.root, manifest or {}, layout, options, mirror)
    _check(report, stored, files, checkpoint, manifest or {}, layout, options, None)


def _check(report, stored, files, checkpoint: str, manifest: dict, layout, options: dict, mirror) -> None:
    options = dict(options)
    read_mode = options.pop("read_mode", None) or "auto"  # how the checkpoint is read, as a merge's --read-mode
    plan = _replan(report, checkpoint, manifest, layout, options, read_mode)
    if plan is None:
        return
    compare_names(report, {t.name for t in plan.tensors}, set(stored), "in the checkpoint", "the checkpoint")
    jobs = _comparable(report, plan, stored, manifest)
    recorded = manifest.get("tensors", {}) if manifest.get("checksum") == CHECKSUM else {}
    sink = CompareSink(files, _fused_device(manifest, plan))
    pieces = [PlacedTensor(tensor, have.byte_offset, have.nbytes) for tensor, have in jobs]
    opened = (
        RangeSources(rebased(plan.sources, mirror.root, mirror.url), etags=mirror.etags)
        if mirror is not None
        else open_sources(plan.sources, chosen_read_mode(read_mode, plan.sources)[0])
    )
    with opened as sources:
        crcs = run(pieces, sources, sink)
    for (tensor, have), crc in zip(jobs, crcs):
        report.count_checked(have)
        first = sink.first[tensor.name]
        if first >= 0:
            report.mismatches.append(
                Mismatch(tensor.name, "bytes differ from the checkpoint's", first, first // itemsize(have.dtype))
            )
        elif crc is not None and tensor.name in recorded and int(recorded[tensor.name][CHECKSUM], 16) != crc:
            report.mismatches.append(Mismatch(tensor.name, "matches the checkpoint but not the manifest's checksum"))


def _replan(
    report: VerifyReport, checkpoint: str, manifest: dict, layout: str | None, options: dict, read_mode: str = "auto"
):
    """The checkpoint's plan as the merge made it (its recorded layout and options, unless given); None: refused."""
    has_config = os.path.isfile(os.path.join(report.out_dir, "config.json"))
    layout = layout or manifest.get("layout")
    recorded = dict((manifest.get("layout_options") or {}) if layout == manifest.get("layout") else {})
    # A folder a plan transform wrote beside the model (a PEFT adapter) records what it holds of the checkpoint.
    checks = folder_checks()
    held = {name: recorded.pop(name) for c in checks for name in c.recorded if name in recorded}
    # The merge's own checks run again (names and shapes against the model, ranks and steps), and every
    # byte of the copies the checkpoint holds twice is compared, where the merge compared a sample.
    try:
        given = {**recorded, **{name: value for name, value in options.items() if value is not None}}
        config = report.out_dir if has_config else None
        plan = plan_merge(
            os.fspath(checkpoint),
            merge_options(
                dtype="keep",
                layout=layout,
                config=config,
                full_copy_check=True,
                read_mode=read_mode,  # the copies compared as the tensors are read
                **layout_options_only(given),
            ),
        )
    except ModelMismatch as exc:  # the output's config.json and the checkpoint's tensors disagree
        report.mismatches.append(Mismatch("(model)", str(exc)))
        return None
    return next(filter(None, (c.verified(plan, held) for c in checks)), plan)


def _comparable(report: VerifyReport, plan, stored: dict[str, StoredTensor], manifest: dict) -> list:
    """(planned tensor, stored tensor) for each tensor both have with the same dtype and shape; a mismatch for the rest."""
    wanted_dtype = manifest.get("dtype")
    # The replan keeps every dtype; the merge's cast left in float32 what transformers keeps there.
    kept = kept_in_fp32(plan, wanted_dtype) if manifest else None
    jobs = []
    for tensor in plan.tensors:
        have = stored.get(tensor.name)
        if have is None:
            continue
        # The merge's --dtype: from the manifest, else read off the output (a cast one is floating).
        wanted = wanted_dtype if manifest else (have.dtype if have.dtype in CASTABLE else None)
        if kept is not None and kept(tensor.name):
            wanted = "float32"
        if not getattr(tensor.compute, "keeps_dtype", False):  # --dtype fp8's tensors are in the format's dtypes
            tensor = replace(tensor, target_dtype=target_dtype(tensor.source_dtype, wanted))
        if (have.dtype, have.shape) != (tensor.target_dtype, tensor.shape):
            report.mismatches.append(
                Mismatch(
                    tensor.name,
                    f"stored as {have.dtype} {list(have.shape)}, the checkpoint "
                    f"gives {tensor.target_dtype} {list(tensor.shape)}",
                )
            )
            continue
        jobs.append((tensor, have))
    return jobs


def _fused_device(manifest: dict, plan) -> str:
    """Computed tensors (--merge-lora's fused weights) are recomputed on the kind of device the merge computed them on."""
    device = compute_device(manifest.get("engine", "cpu"))
    if device == "cuda" and any(t.compute is not None for t in plan.tensors) and not _ops.native_cuda():
        raise BadInput(
            "the LoRA weights of this output were fused on a GPU (engine cuda); recomputing them needs one: "
            "verify --against on a machine with a GPU, or check the output against its manifest"
        )
    return device
