"""The run folder as the watcher reads it, one pass at a time: a local folder (os calls), or a prefix
in an object store (s3://, gs://, az://: listings and small GETs), behind the same few questions,
so that watch.discover's rules are one set for both.

- `folders()`: the checkpoint candidates, the sub-folders directly in the run folder;
- `entries(relative)`: the names directly in a sub-folder ("checkpoint-3", "checkpoint_3/pytorch_model_fsdp_0");
- `read_small(name)`: a marker file's text (the tracker, DeepSpeed's `latest`), None when absent;
- `signature(name)`: every file below a checkpoint with what says it changed, for the watcher to
  try a refused checkpoint again only once it does: size and modification time on disk, size and
  ETag in a store;
- `path(name)`: the checkpoint's path, or its URL, as the merge is given it.

A store has no folders: a "folder" is a prefix some object's key continues with "/". The top of the
run is listed once a pass with a delimiter; a checkpoint's objects only when a rule asks about it,
once a pass.
"""

from __future__ import annotations

import os

from ..remote.stores import store_for
from ..remote.urls import is_remote

MARKER_BYTES = 256  # the tracker and `latest` hold a step or a tag: a larger object is not one


def run_listing(run_dir: str) -> LocalRun | StoreRun:
    return StoreRun(run_dir) if is_remote(run_dir) else LocalRun(run_dir)


class LocalRun:
    def __init__(self, root: str):
        self.root = root

    def folders(self) -> list[str]:
        try:
            names = sorted(e for e in os.listdir(self.root) if not e.startswith("."))
        except FileNotFoundError:
            return []
        return [n for n in names if os.path.isdir(self.path(n)) and not os.path.islink(self.path(n))]

    def entries(self, relative: str) -> set[str]:
        try:
            return set(os.listdir(os.path.join(self.root, *relative.split("/"))))
        except OSError:
            return set()

    def read_small(self, name: str) -> str | None:
        try:
            with open(self.path(name), encoding="utf-8", errors="replace") as f:
                return f.read(MARKER_BYTES).strip()
        except OSError:
            return None

    def signature(self, name: str) -> tuple:
        found, folder = [], self.path(name)
        for root, dirs, files in os.walk(folder):
            dirs.sort()
            for file in sorted(files):
                try:
                    st = os.lstat(os.path.join(root, file))
                except OSError:
                    continue
                found.append((os.path.relpath(os.path.join(root, file), folder), st.st_size, st.st_mtime_ns))
        return tuple(found)

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)


class StoreRun:
    def __init__(self, url: str):
        self.root = url.rstrip("/")
        self._store, prefix = store_for(self.root)  # refused in one line without the client
        self._prefix = f"{prefix}/" if prefix else ""
        self._top: tuple[list[str], dict[str, int]] | None = None  # (folders, {file: size}) at the top
        self._objects: dict[str, dict[str, tuple[int, str]]] = {}  # a folder's {key below it: (size, ETag)}

    def folders(self) -> list[str]:
        return self._listed_top()[0]

    def entries(self, relative: str) -> set[str]:
        name, _, below = relative.partition("/")
        inner = f"{below}/" if below else ""
        return {key[len(inner) :].split("/", 1)[0] for key in self._below(name) if key.startswith(inner)}

    def read_small(self, name: str) -> str | None:
        import obstore

        size = self._listed_top()[1].get(name)
        if size is None or size > MARKER_BYTES:
            return None
        try:
            data = bytes(obstore.get(self._store, self._prefix + name).bytes())
        except FileNotFoundError:  # deleted since the listing
            return None
        return data.decode("utf-8", errors="replace").strip()

    def signature(self, name: str) -> tuple:
        return tuple((key, size, etag) for key, (size, etag) in sorted(self._below(name).items()))

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _listed_top(self) -> tuple[list[str], dict[str, int]]:
        import obstore

        if self._top is None:
            listed = obstore.list_with_delimiter(self._store, prefix=self._prefix or None)
            folders = [p[len(self._prefix) :].rstrip("/") for p in listed["common_prefixes"]]
            files = {m["path"][len(self._prefix) :]: m["size"] for m in listed["objects"]}
            self._top = (sorted(f for f in folders if f and not f.startswith(".")), files)
        return self._top

    def _below(self, name: str) -> dict[str, tuple[int, str]]:
        import obstore

        if name not in self._objects:
            prefix = f"{self._prefix}{name}/"
            self._objects[name] = {
                meta["path"][len(prefix) :]: (meta["size"], meta["e_tag"])
                for batch in obstore.list(self._store, prefix=prefix)
                for meta in batch
            }
        return self._objects[name]
