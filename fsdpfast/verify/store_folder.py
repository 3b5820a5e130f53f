"""`verify` of a merged folder in an object store (s3://, gs://, az://): against its manifest (or another
merge's), or recomputed from the shards (`--against`, local or in a store).

The folder's headers and manifest are fetched into a metadata stand-in (remote.metadata_mirror); each
tensor's bytes come by ranged GETs a slice at a time as its CRC-32C is computed (remote.streamed_tensors):
memory flat, nothing on disk. What a check says of a path in the stand-in is said of the store's.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import BadInput, option
from ..io.safetensors_folder import DamagedFile, read_folder
from ..remote.metadata_mirror import mirrored_metadata
from ..remote.streamed_tensors import StreamedTensors
from .manifest_check import check_manifest, check_other_manifest, note_source_changes, own_manifest
from .report import Mismatch, VerifyReport


def verify_in_store(
    url: str, *, against: str | None, other: dict | None, manifest_of: str | None, refuse_nothing
) -> VerifyReport:
    """`other`: another merge's manifest, read already; `refuse_nothing(report)`: verify's answer when the
    folder has no manifest and nothing else was asked."""
    if against is not None:
        raise BadInput(
            f"{url}: {option('against', meta='CKPT_DIR')} reads the output whole and needs it on local disk; "
            "verify the folder in the store against its manifest, or download it first"
        )
    with mirrored_metadata(url) as mirror:
        try:
            stored = read_folder(mirror.root)
        except BadInput as exc:  # DamagedFile, or a prefix with no .safetensors
            if not isinstance(exc, DamagedFile):
                raise BadInput(mirror.said(str(exc))) from None
            return VerifyReport(mirror.url, checks=["headers"], mismatches=[Mismatch("(file)", mirror.said(str(exc)))])
        report = VerifyReport(mirror.root, tensors=len(stored))
        manifest = own_manifest(report)
        report.out_dir = mirror.url
        report.mismatches = [replace(m, what=mirror.said(m.what)) for m in report.mismatches]
        if manifest is None and other is None:
            return refuse_nothing(report)
        with StreamedTensors(stored, mirror) as files:
            if manifest is not None:
                note_source_changes(report, manifest, None)
                check_manifest(report, stored, files, manifest)
            if other is not None:
                check_other_manifest(report, stored, files, manifest_of, other, manifest)
        return report
