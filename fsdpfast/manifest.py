"""The manifest a merge leaves beside its output, and the identity of the source files.

`fsdpfast-manifest.json` records every tensor's place (file, offset, bytes, dtype, shape) and its
CRC-32C, taken while the engine wrote it (no second read), plus the identity of the source files
(path, size, modification time). `verify` checks the output against it without the sources, and
tells whether the sources changed since the merge.
"""
from __future__ import annotations

import json
import os

from . import __version__
from .errors import FsdpfastError
from .layout import OutputFile
from .plan import MergePlan

MANIFEST_NAME = "fsdpfast-manifest.json"
CHECKSUM = "crc32c"


class SourceChanged(FsdpfastError):
    """A source file changed size or modification time while it was being merged."""


def source_identity(checkpoint: str, paths) -> list[dict]:
    """Path (relative to the checkpoint folder when inside it), size and mtime_ns of each file."""
    found = []
    for path in sorted(set(paths)):
        st = os.stat(path)
        found.append({"path": _relative(checkpoint, path), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return found


def changed_sources(checkpoint: str, identity: list[dict]) -> list[str]:
    """One line per source file whose size or modification time is no longer what `identity` says."""
    changes = []
    for entry in identity:
        path = os.path.join(checkpoint, entry["path"])
        try:
            st = os.stat(path)
        except OSError:
            changes.append(f"{entry['path']}: no longer readable")
            continue
        if st.st_size != entry["size"]:
            changes.append(f"{entry['path']}: size {entry['size']} -> {st.st_size}")
        elif st.st_mtime_ns != entry["mtime_ns"]:
            changes.append(f"{entry['path']}: modified since (mtime_ns {entry['mtime_ns']} -> {st.st_mtime_ns})")
    return changes


def check_unchanged(checkpoint: str, identity: list[dict]) -> None:
    """Abort the merge if a source changed under it: its bytes may be half old, half new."""
    changes = changed_sources(checkpoint, identity)
    if changes:
        raise SourceChanged(f"{checkpoint}: source files changed during the merge ({changes[0]}"
                            f"{f' and {len(changes) - 1} more' if len(changes) > 1 else ''}); nothing was published; "
                            "merge again once the checkpoint is complete")


def build_manifest(checkpoint: str, plan: MergePlan, files: list[OutputFile], checksums: dict,
                   identity: list[dict], engine: str, dtype: str | None) -> dict:
    have_checksums = all(checksums.get(p.tensor.name) is not None for f in files for p in f.tensors)
    return {
        "fsdpfast_version": __version__,
        "checksum": CHECKSUM if have_checksums else None,
        "engine": engine,
        "dtype": dtype,
        "layout": plan.layout,
        "layout_options": plan.options,  # what verify --against needs to read the same plan again
        "world_size": plan.world_size,
        "checkpoint": os.path.abspath(checkpoint),
        "sources": identity,
        "files": {f.name: {"size": f.size} for f in files},
        "tensors": {
            p.tensor.name: {
                "file": f.name, "offset": p.offset, "nbytes": p.nbytes, "dtype": p.tensor.target_dtype,
                "shape": list(p.tensor.shape),
                CHECKSUM: f"{checksums[p.tensor.name]:08x}" if have_checksums else None,
            }
            for f in files for p in f.tensors
        },
    }


def read_manifest(out_dir: str) -> dict | None:
    path = os.path.join(out_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _relative(checkpoint: str, path: str) -> str:
    relative = os.path.relpath(os.path.abspath(path), os.path.abspath(checkpoint))
    return os.path.abspath(path) if relative.startswith(os.pardir) else relative
