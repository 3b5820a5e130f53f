"""Which source objects of a merge changed since: the manifest's sources (path, size, ETag) against a listing."""

from __future__ import annotations

from .stores import store_for


def changed_objects(url: str, identity: list[dict]) -> list[str]:
    """One line per recorded object that is gone or whose size or ETag is no longer what `identity` says."""
    import obstore

    url = url.rstrip("/")
    store, prefix = store_for(url)
    listed = {}
    for batch in obstore.list(store, prefix=f"{prefix}/" if prefix else None):
        for meta in batch:
            listed[meta["path"][len(prefix) + 1 if prefix else 0 :]] = meta
    changes = []
    for entry in identity:
        meta = listed.get(entry["path"])
        if meta is None:
            changes.append(f"{entry['path']}: no longer in the store")
        elif meta["size"] != entry["size"]:
            changes.append(f"{entry['path']}: size {entry['size']} -> {meta['size']}")
        elif entry.get("etag") is not None and meta["e_tag"] != entry["etag"]:
            changes.append(f"{entry['path']}: replaced since (ETag {entry['etag']} -> {meta['e_tag']})")
    return changes
