"""Check a merged folder: against its manifest, against the shards it came from, against a reference.

- manifest (default): every tensor's place and CRC-32C as recorded while it was written; fast,
  needs no sources.
- against a checkpoint: every tensor recomputed from the shards chunk by chunk (the merge's own
  plan and kernels, nothing held whole) and compared byte for byte.
- against a reference folder: tensor by tensor, exact, or within rtol/atol in float64.
A folder in an object store is checked against a manifest, its bytes streamed by ranged GETs (store_folder).
Each mismatch names the tensor and, where known, the first differing element and byte.

`verify` here runs the checks asked for, in order; each lives in its own module (manifest_check,
against, reference, smoke), and all of them write to the report (report.py). Folders a plan
transform wrote beside the model (PEFT adapters) are checked by that transform's FolderChecks
(plan.transform, found through pipeline.plan.folder_checks), which is handed `verify` to run on each.
"""

from __future__ import annotations

import os

from ..errors import BadInput, option
from ..io.safetensors_folder import DamagedFile, MappedFiles, StoredTensor, read_folder
from ..pipeline.plan import folder_checks
from ..remote.urls import is_remote
from .against import check_against
from .manifest_check import check_manifest, check_other_manifest, note_source_changes, other_manifest, own_manifest
from .reference import check_reference
from .report import Mismatch, VerifyReport
from .smoke import smoke_base, smoke_test
from .store_folder import verify_in_store

__all__ = ["verify", "VerifyReport", "Mismatch"]


def verify(
    out_dir: str,
    *,
    against: str | None = None,
    reference: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    smoke: bool = False,
    layout: str | None = None,
    manifest_of: str | None = None,
    **options,
) -> VerifyReport:
    """Check the merged folder `out_dir`; a VerifyReport (`.ok`, `.mismatches`, `.summary()`).

    With no other argument, every tensor's place and CRC-32C against the folder's own manifest.
    against: the checkpoint folder: every tensor recomputed from the shards, compared byte for byte.
    reference: another safetensors folder, compared tensor by tensor: exactly, or within `rtol` /
        `atol` (in float64) when either is given.
    manifest_of: another merge's manifest (its file or folder), e.g. an earlier merge of the same
        checkpoint: every tensor's dtype, shape and checksum must match it.
    smoke: load the folder with transformers and run one forward pass.
    layout, options: for `against`, as in `plan_merge`; by default what the merge recorded; and
        read_mode ("auto", "mmap" or "pread", as a merge's): how the checkpoint is read.

    Mismatches are reported, not raised; BadInput (a ValueError) means the check itself could not
    run as asked.
    """
    out_dir = os.fspath(out_dir)
    if is_remote(out_dir):
        return _verify_in_store(out_dir, against, reference, rtol, atol, smoke, manifest_of)
    # A damaged output (its headers or its own manifest) is a failed check, not a usage error.
    extras = folder_checks()
    try:
        stored = {} if any(c.model_less(out_dir) for c in extras) else read_folder(out_dir)
    except DamagedFile as exc:
        return VerifyReport(out_dir, checks=["headers"], mismatches=[Mismatch("(file)", str(exc))])
    report = VerifyReport(out_dir, tensors=len(stored))
    manifest = own_manifest(report)
    if (rtol is not None or atol is not None) and reference is None:
        raise BadInput(f"{option('rtol')} and {option('atol')} apply to {option('reference', meta='HF_DIR')}")
    other = other_manifest(os.fspath(manifest_of)) if manifest_of is not None else None  # bad input: refused first
    if against is None and reference is None and manifest is None and other is None and not smoke:
        return _nothing_to_check(report)
    _check_tensors(
        report,
        stored,
        manifest,
        other,
        against=against,
        reference=reference,
        rtol=rtol,
        atol=atol,
        layout=layout,
        manifest_of=manifest_of,
        options=options,
    )
    listed = [(c, c.listed(manifest)) for c in extras]  # the folders written beside the model, by transform
    for c, folders in listed:
        c.check(
            report,
            out_dir,
            folders,
            verify_folder=verify,
            against=against,
            reference=reference,
            rtol=rtol,
            atol=atol,
            layout=layout,
            options=options,
        )
    if smoke:
        _smoke(report, [(c, folders) for c, folders in listed if folders])
    return report


def _verify_in_store(url, against, reference, rtol, atol, smoke, manifest_of) -> VerifyReport:
    """A folder in an object store: its manifest's checksums (or another merge's), by streamed ranged GETs."""
    if reference is not None or smoke or rtol is not None or atol is not None:
        raise BadInput(
            f"{url}: {option('reference', meta='HF_DIR')} and --smoke read the folder whole and need it on local "
            "disk; verify the folder in the store against its manifest, or download it first"
        )
    other = other_manifest(os.fspath(manifest_of)) if manifest_of is not None else None
    return verify_in_store(url, against=against, other=other, manifest_of=manifest_of, refuse_nothing=_nothing_to_check)


def _nothing_to_check(report: VerifyReport) -> VerifyReport:
    if report.mismatches:  # the damaged manifest was all there was to check against
        return report
    raise BadInput(
        f"{report.out_dir}: no fsdpfast-manifest.json (not merged by fsdpfast, or by an older one); "
        f"check it with {option('against', meta='CKPT_DIR')} or {option('reference', meta='HF_DIR')}"
    )


def _check_tensors(
    report: VerifyReport,
    stored: dict[str, StoredTensor],
    manifest: dict | None,
    other: dict | None,
    *,
    against: str | None,
    reference: str | None,
    rtol: float | None,
    atol: float | None,
    layout: str | None,
    manifest_of: str | None,
    options: dict,
) -> None:
    """The checks of the output's tensors that were asked for (the own manifest's only when nothing else is)."""
    with MappedFiles(stored) as files:
        if manifest is not None:
            note_source_changes(report, manifest, against)
        if against is not None:
            check_against(report, stored, files, os.fspath(against), manifest, layout, options)
        elif manifest is not None and reference is None:
            check_manifest(report, stored, files, manifest)
        if other is not None:
            check_other_manifest(report, stored, files, os.fspath(manifest_of), other, manifest)
        if reference is not None:
            check_reference(report, stored, files, os.fspath(reference), rtol, atol)


def _smoke(report: VerifyReport, listed: list) -> None:
    """The forward pass, with the folders beside the model (`listed`: (FolderChecks, folders)) applied to it."""
    report.checks.append("smoke: transformers forward pass" + "".join(f" with {c.what}" for c, _ in listed))
    alone = next((c for c in folder_checks() if c.is_own_folder(report.out_dir)), None)
    if alone is not None:  # one such folder given by itself: its own base model
        problems = alone.smoke_folder(report.out_dir, report.notes, smoke_base)
    else:
        problems = smoke_test(report.out_dir)
        for c, folders in listed:
            problems += c.smoke(report.out_dir, folders, report.notes, smoke_base)
    report.mismatches += [Mismatch("(smoke)", problem) for problem in problems]
