"""The manifest a merge leaves beside its output, and the identity of the source files.

`fsdpfast-manifest.json` records every tensor's place (file, offset, bytes, dtype, shape) and its
CRC-32C, taken while the engine wrote it (no second read), plus the identity of the source files
(path, size, modification time; for objects in a store, size and ETag). `verify` checks the output against it without the sources, and
tells whether the sources changed since the merge.
"""

from __future__ import annotations

import json
import os
import re

from ._parsing.safe_load import is_count
from ._version import __version__
from .dtypes import TARGET_ALIASES
from .errors import BadInput, FsdpfastError
from .plan.layout import OutputFile
from .plan.model import MergePlan

MANIFEST_NAME = "fsdpfast-manifest.json"
WRITTEN = "written"  # each file of the folder but the manifest -> its size and mtime_ns: what --overwrite may remove
CHECKSUM = "crc32c"
_MERGE_DTYPES = set(TARGET_ALIASES.values())  # what build_manifest records as "dtype" (None: kept)


class DamagedManifest(BadInput):
    """A manifest that is not JSON or lacks the fields, or their types, that a merge writes."""


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
        except (OSError, ValueError):  # ValueError: a path with a NUL byte
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
        raise SourceChanged(
            f"{checkpoint}: source files changed during the merge ({changes[0]}"
            f"{f' and {len(changes) - 1} more' if len(changes) > 1 else ''}); nothing was published; "
            "merge again once the checkpoint is complete"
        )


def check_same_sources(checkpoint: str, identity: list[dict]) -> None:
    """Another process of the merge sees the source files rank 0 planned from (a shared filesystem)."""
    if not os.path.isdir(checkpoint):
        raise BadInput(
            f"{checkpoint}: no such folder on this rank; every rank of a merge must see the checkpoint "
            "(the same folder on a filesystem they share)"
        )
    changes = changed_sources(checkpoint, identity)
    if changes:
        raise BadInput(
            f"{checkpoint}: this rank does not see the source files rank 0 planned from ({changes[0]}"
            f"{f' and {len(changes) - 1} more' if len(changes) > 1 else ''}); every rank of a merge must "
            "see the same checkpoint folder"
        )


def build_manifest(
    checkpoint: str,
    plan: MergePlan,
    files: list[OutputFile],
    checksums: dict,
    identity: list[dict],
    engine: str,
    dtype: str | None,
) -> dict:
    have_checksums = all(checksums.get(p.tensor.name) is not None for f in files for p in f.tensors)
    return {
        "fsdpfast_version": __version__,
        "checksum": CHECKSUM if have_checksums else None,
        "engine": engine,
        "dtype": dtype,
        "layout": plan.layout,
        "layout_options": plan.options,  # what verify --against needs to read the same plan again
        "world_size": plan.world_size,
        "checkpoint": checkpoint if "://" in checkpoint else os.path.abspath(checkpoint),  # a store's URL as it is
        "sources": identity,
        "files": {f.name: {"size": f.size} for f in files},
        "tensors": {
            p.tensor.name: {
                "file": f.name,
                "offset": p.offset,
                "nbytes": p.nbytes,
                "dtype": p.tensor.target_dtype,
                "shape": list(p.tensor.shape),
                CHECKSUM: f"{checksums[p.tensor.name]:08x}" if have_checksums else None,
            }
            for f in files
            for p in f.tensors
        },
    }


def read_manifest(out_dir: str) -> dict | None:
    """The manifest beside a merged folder's files, checked; None when there is none."""
    path = os.path.join(out_dir, MANIFEST_NAME)
    return load_manifest(path) if os.path.isfile(path) else None


def load_manifest(path: str) -> dict:
    """A manifest file, with every field verify reads checked for presence and type (DamagedManifest if not)."""
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except OSError as exc:
        raise BadInput(f"{path}: unreadable ({exc.strerror})") from None
    except ValueError as exc:  # includes text that is not UTF-8
        _damaged(path, f"not JSON ({str(exc)[:100]})")
    except RecursionError:
        _damaged(path, "nested too deeply")
    _check_fields(path, manifest)
    return manifest


_HEX32 = re.compile(r"[0-9a-f]{8}")
_OPTIONAL = (str, type(None))
# top-level field -> (required, accepted types); older manifests may lack the optional ones
_FIELDS = {
    "checksum": (True, _OPTIONAL),
    "tensors": (True, dict),
    "sources": (False, list),
    "checkpoint": (False, _OPTIONAL),
    "layout": (False, _OPTIONAL),
    "layout_options": (False, (dict, type(None))),
    "dtype": (False, _OPTIONAL),
    "files": (False, dict),  # read by --overwrite (io.earlier_output) against `written`
    WRITTEN: (False, dict),
}


def _check_fields(path: str, manifest) -> None:
    if not isinstance(manifest, dict):
        _damaged(path, "not a JSON object")
    for key, (required, kinds) in _FIELDS.items():
        if required and key not in manifest:
            _damaged(path, f"no {key!r} field")
        if key in manifest and not isinstance(manifest[key], kinds):
            _damaged(path, f"{key!r} is a {type(manifest[key]).__name__}")
    if manifest.get("dtype") not in _MERGE_DTYPES:
        _damaged(path, f"'dtype' is {str(manifest['dtype'])[:20]!r}, not one a merge writes")
    for key, value in (manifest.get("layout_options") or {}).items():
        if not (
            isinstance(value, (str, bool, int, float, type(None)))  # numbers: --lora-alpha, --lora-r
            or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        ):
            _damaged(path, f"layout option {key[:40]!r} is a {type(value).__name__}")
    if manifest["checksum"] not in (CHECKSUM, None):
        _damaged(path, f"'checksum' is {manifest['checksum'][:20]!r}, not {CHECKSUM!r} or null")
    with_checksums = manifest["checksum"] == CHECKSUM
    for name, entry in manifest["tensors"].items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("file"), str)
            and isinstance(entry.get("dtype"), str)
            and is_count(entry.get("offset"))
            and is_count(entry.get("nbytes"))
            and isinstance(entry.get("shape"), list)
            and all(is_count(d) for d in entry["shape"])
        ):
            _damaged(path, f"the entry of {name} has no valid file, offset, nbytes, dtype and shape")
        crc = entry.get(CHECKSUM)
        if with_checksums and not (isinstance(crc, str) and _HEX32.fullmatch(crc)):
            _damaged(path, f"the {CHECKSUM} of {name} is {str(crc)[:20]!r}, not 8 hex digits")
        if not with_checksums and crc is not None:
            _damaged(path, f"{name} has a {CHECKSUM} but the manifest says it has no checksums")
    for name, entry in manifest.get(WRITTEN, {}).items():
        if not (isinstance(entry, dict) and is_count(entry.get("size")) and is_count(entry.get("mtime_ns"))):
            _damaged(path, f"the entry of {name[:80]} in {WRITTEN!r} is {str(entry)[:40]!r}, not a size and mtime_ns")
    for source in manifest.get("sources", []):
        if not (
            isinstance(source, dict)
            and isinstance(source.get("path"), str)
            and is_count(source.get("size"))
            and is_count(source.get("mtime_ns"))
            and isinstance(source.get("etag", ""), (str, type(None)))
        ):
            _damaged(path, f"a source entry is {str(source)[:80]!r}, not a path, size and mtime_ns")


def _damaged(path: str, what: str):
    raise DamagedManifest(f"{path}: {what}; the manifest is damaged")


def _relative(checkpoint: str, path: str) -> str:
    relative = os.path.relpath(os.path.abspath(path), os.path.abspath(checkpoint))
    return os.path.abspath(path) if relative.startswith(os.pardir) else relative
