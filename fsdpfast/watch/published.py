"""What the watcher published before, read from the outputs themselves, so a restarted watcher
(or one killed at any moment) knows it: an output folder whose manifest names the checkpoint
folder and the identity of its files as they are now (path, size, mtime_ns: manifest.sources) is
that checkpoint published (an object-store OUT_ROOT alike: watch.remote_outputs; a checkpoint in
an object store is named by its URL, its objects by size and ETag). A merge killed before its rename left no output (io.local_target),
so it is simply redone; its staging folder is removed by the next merge into the same folder.
"""

from __future__ import annotations

import os

from ..errors import BadInput
from ..io.earlier_output import remove_written
from ..io.output_guard import OutputLock
from ..manifest import changed_sources, read_manifest
from ..remote.changed_objects import changed_objects
from ..remote.urls import is_remote
from .remote_outputs import remote_manifest, remote_output_names, remove_remote_output


def manifest_of(out_dir: str) -> dict | None:
    """The manifest of an output folder (or object-store prefix); None when there is none or it cannot be read."""
    if is_remote(out_dir):
        return remote_manifest(out_dir)
    if os.path.islink(out_dir) or not os.path.isdir(out_dir):
        return None
    try:
        return read_manifest(out_dir)
    except BadInput:
        return None


def published(out_dir: str, checkpoint: str, dtype: str | None, fp8_skip: tuple[str, ...] | None = None) -> bool:
    """`out_dir` holds `checkpoint` merged as asked (its dtype, and FP8 or not with the same --fp8-skip:
    an FP8 merge records bfloat16 for what it leaves unquantized), its source files unchanged since."""
    manifest = manifest_of(out_dir)
    if manifest is None or manifest.get("checkpoint") != _source(checkpoint):
        return False
    sources = manifest.get("sources") or []
    fp8 = (manifest.get("layout_options") or {}).get("fp8")
    as_asked = manifest.get("dtype") == dtype and fp8 == (None if fp8_skip is None else list(fp8_skip))
    if not (sources and as_asked):
        return False
    # in a store, each source object still of the size and ETag it had (remote.changed_objects)
    return not (changed_objects if is_remote(checkpoint) else changed_sources)(checkpoint, sources)


def outputs_of_run(out_root: str, run_dir: str) -> list[str]:
    """The folders in `out_root` the watcher published: named as the checkpoint folder directly in
    `run_dir` their manifest says fsdpfast merged them from (by its absolute path, or URL). The only ones
    --keep-last may remove: a merge of the same run into another name (`out/best`) is the user's."""
    run = _source(run_dir)
    try:
        entries = (
            remote_output_names(out_root)
            if is_remote(out_root)
            else sorted(e for e in os.listdir(out_root) if not e.startswith("."))
        )
    except FileNotFoundError:
        return []
    found = []
    for name in entries:
        manifest = manifest_of(os.path.join(out_root, name))
        source = manifest.get("checkpoint") if manifest else None
        if not isinstance(source, str):
            continue
        parent, _, last = source.rpartition("/" if is_remote(source) else os.sep)
        if (parent, last) == (run, name):
            found.append(name)
    return found


def _source(checkpoint: str) -> str:
    """A checkpoint folder as a manifest names it: its absolute path, or its URL (no trailing "/")."""
    return checkpoint.rstrip("/") if is_remote(checkpoint) else os.path.abspath(checkpoint)


def remove_output(out_dir: str) -> list[str]:
    """Remove what the merge into `out_dir` wrote, its manifest listing it (io.earlier_output), under
    the folder's lock (no merge into it is running); what is left, fsdpfast not having written it.
    On an object store (no lock there): the objects its manifest lists (watch.remote_outputs)."""
    if is_remote(out_dir):
        return remove_remote_output(out_dir)
    lock = OutputLock(out_dir)
    try:
        return remove_written(out_dir)
    finally:
        lock.release()
