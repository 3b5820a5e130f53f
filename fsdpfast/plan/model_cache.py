"""The expected models built before (plan.model_check), kept on disk: one JSON file per config and transformers.

Building the class config.json names costs an import of torch and transformers (seconds of CPU);
what the check keeps of it (names, shapes, ties, prefix, ignore patterns) is a few kB. So each
model built is kept in the user's cache folder ($FSDPFAST_CACHE_DIR, else
$XDG_CACHE_HOME/fsdpfast, else ~/.cache/fsdpfast; safe to delete at any time) under a key of the
exact config.json bytes, the transformers version and the format below: a config that changes by
one byte, another transformers or another fsdpfast check is built again, never read from here. An
entry that cannot be read, or does not hold what its key says, is ignored (and built again).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

FORMAT = 2  # what an entry holds; raised when the check keeps anything more or else of a model
FOLDER = "model-check"
CACHE_ENV = "FSDPFAST_CACHE_DIR"


def cache_folder() -> str:
    root = os.environ.get(CACHE_ENV)
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "fsdpfast")
    return os.path.join(root, FOLDER)


def entry_key(config_bytes: bytes, transformers_version: str) -> str:
    digest = hashlib.sha256(f"fsdpfast-model-check/{FORMAT}\0{transformers_version}\0".encode())
    digest.update(config_bytes)
    return digest.hexdigest()


def entry_path(key: str) -> str:
    return os.path.join(cache_folder(), f"{key}.json")


def read_entry(key: str) -> dict | None:
    """The entry stored under `key`, or None: missing, unreadable, not JSON, or not of this key and format."""
    try:
        with open(entry_path(key), "rb") as f:
            entry = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
        return None
    return entry


def write_entry(key: str, entry: dict) -> bool:
    """Store `entry` under `key` in one rename (a reader sees the whole file or none); False if the
    folder cannot be written (a read-only home): the check then simply builds again next time."""
    folder = cache_folder()
    try:
        os.makedirs(folder, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({**entry, "format": FORMAT, "key": key}, f)
            os.replace(temporary, entry_path(key))
        except BaseException:
            try:
                os.unlink(temporary)
            except OSError:
                pass
            raise
    except OSError:
        return False
    return True
