"""`verify` against a manifest: the output's own (places and CRC-32C as written) or another merge's (checksums).

Needs no sources: each tensor's bytes are read once from the output and checksummed.
"""

from __future__ import annotations

import os

from .. import _ops
from ..errors import BadInput, option
from ..execute.compare import SLICE_BYTES
from ..io.safetensors_folder import MappedFiles, StoredTensor
from ..manifest import CHECKSUM, MANIFEST_NAME, DamagedManifest, changed_sources, load_manifest, read_manifest
from ..remote.changed_objects import changed_objects
from ..remote.urls import is_remote
from .report import Mismatch, VerifyReport, compare_names


def own_manifest(report: VerifyReport) -> dict | None:
    """The output's manifest (None when it has none); a damaged one is a failed check, not a usage error."""
    try:
        return read_manifest(report.out_dir)
    except DamagedManifest as exc:
        report.checks.append("manifest")
        report.mismatches.append(
            Mismatch("(manifest)", f"{exc}; check the output with {option('against', meta='CKPT_DIR')}")
        )
        return None


def other_manifest(path: str) -> dict:
    """Another merge's manifest (the file or its folder); a damaged one is bad input, not a failed check."""
    file = os.path.join(path, MANIFEST_NAME) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise BadInput(f"{file}: no such file; give the {MANIFEST_NAME} of an earlier merge, or its folder")
    return load_manifest(file)


def note_source_changes(report: VerifyReport, manifest: dict, against: str | None) -> None:
    root = against or manifest.get("checkpoint")
    if root and is_remote(root):  # a checkpoint in an object store: its objects' sizes and ETags, listed
        changes = changed_objects(root, manifest.get("sources", []))
    elif not root or not os.path.isdir(root):
        report.notes.append(f"the merge's sources ({manifest.get('checkpoint')}) are not there to compare with")
        return
    else:
        changes = changed_sources(root, manifest.get("sources", []))
    if changes:
        report.notes.append(f"source files changed since the merge ({len(changes)}): {'; '.join(changes[:5])}")


def check_other_manifest(
    report: VerifyReport, stored: dict[str, StoredTensor], files: MappedFiles, path: str, other: dict, own: dict | None
) -> None:
    if own is not None and _identity(own) != _identity(other):
        report.notes.append(
            f"the two merges read different source files (or the files changed between them); see {path}"
        )
    check_manifest(report, stored, files, other, where=path)


def _identity(manifest: dict) -> list:
    return [(s["path"], s["size"], s["mtime_ns"], s.get("etag")) for s in manifest.get("sources", [])]


def check_manifest(
    report: VerifyReport, stored: dict[str, StoredTensor], files: MappedFiles, manifest: dict, where: str | None = None
) -> None:
    """Against the folder's own manifest (where=None: places must match too) or another merge's (checksums only)."""
    report.checks.append(f"manifest {where}" if where else "manifest")
    recorded = manifest.get("tensors", {})
    compare_names(report, set(recorded), set(stored), "in the manifest", "the manifest")
    for name in sorted(set(recorded) & set(stored)):
        want, have = recorded[name], stored[name]
        place = (want["file"], want["offset"], want["nbytes"], want["dtype"], tuple(want["shape"]))
        if where is not None:  # another merge may have split the files differently
            place = (have.file, have.byte_offset) + place[2:]
        if place != (have.file, have.byte_offset, have.nbytes, have.dtype, have.shape):
            report.mismatches.append(
                Mismatch(
                    name,
                    f"stored as {have.file} byte {have.byte_offset}, {have.dtype} "
                    f"{list(have.shape)}; the manifest says {want['file']} byte {want['offset']}, "
                    f"{want['dtype']} {want['shape']}",
                )
            )
            continue
        if manifest.get("checksum") != CHECKSUM or want.get(CHECKSUM) is None:
            continue
        view = files.tensor(have.name)
        crc = _crc(view)
        view.release()
        files.done(name)
        report.count_checked(have)
        if crc != int(want[CHECKSUM], 16):
            report.mismatches.append(
                Mismatch(
                    name,
                    f"{CHECKSUM} {crc:08x}, the manifest recorded {want[CHECKSUM]} "
                    + ("(the file changed after the merge)" if where is None else f"in {where}"),
                )
            )
    if manifest.get("checksum") != CHECKSUM:
        report.notes.append(
            "the manifest has no checksums (merged without the native extension); "
            f"only names, places, dtypes and shapes were checked; use {option('against', meta='CKPT_DIR')}"
        )


def _crc(view: memoryview) -> int:
    crc = 0
    for start in range(0, len(view), SLICE_BYTES):
        crc = _ops.crc32c(view[start : start + SLICE_BYTES], crc)
        if crc is None:
            raise BadInput(
                f"checking checksums needs fsdpfast's native extension (not built); use {option('against', meta='CKPT_DIR')}"
            )
    return crc
