"""The watcher's view of an object-store OUT_ROOT (s3://, gs://, az://): the outputs under it, each
one's manifest, and --keep-last's removal. A store has no folders and no rename: an output is the
objects under OUT_ROOT/<name>/, published once its manifest is there (remote.object_target puts
the manifest last, after every object it lists). Removing one deletes the objects its manifest
lists (`written`) still of their listed size, the manifest last; anything else under the prefix
(an eval result a pipeline put there) stays.
"""

from __future__ import annotations

import json

from ..manifest import MANIFEST_NAME, WRITTEN
from ..remote.stores import store_for, without_folder_markers


def remote_manifest(out_url: str) -> dict | None:
    """The manifest of the output under `out_url`; None when there is none or it cannot be read."""
    import obstore

    store, prefix = store_for(out_url)
    try:
        manifest = json.loads(bytes(obstore.get(store, _key(prefix, MANIFEST_NAME)).bytes()))
    except FileNotFoundError:
        return None
    except ValueError:  # not JSON: not an output the watcher can call published
        return None
    return manifest if isinstance(manifest, dict) else None


def remote_output_names(out_root: str) -> list[str]:
    """The names directly under `out_root` (its "folders"), sorted."""
    import obstore

    store, prefix = store_for(out_root)
    listed = obstore.list_with_delimiter(store, prefix=f"{prefix}/" if prefix else None)
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in listed["common_prefixes"]]
    return sorted(n for n in names if not n.startswith("."))


def remove_remote_output(out_url: str) -> list[str]:
    """Delete the objects the output's manifest lists, still of their listed size, then the manifest;
    the names left under the prefix (fsdpfast did not write them)."""
    import obstore

    store, prefix = store_for(out_url)
    listed = obstore.list(store, prefix=f"{prefix}/")
    sizes = {
        m["path"][len(prefix) + 1 :]: m["size"] for m in without_folder_markers((m for b in listed for m in b), prefix)
    }
    manifest = remote_manifest(out_url)
    listed = (manifest or {}).get(WRITTEN) or {}
    ours = [n for n, entry in listed.items() if n != MANIFEST_NAME and sizes.get(n) == (entry or {}).get("size")]
    if manifest is None:
        return sorted(sizes)
    if ours:
        obstore.delete(store, [_key(prefix, n) for n in ours])
    obstore.delete(store, _key(prefix, MANIFEST_NAME))
    return sorted(n for n in sizes if n not in ours and n != MANIFEST_NAME)


def _key(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name
