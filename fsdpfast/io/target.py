"""Where output files go: a Target receives a merge's files and publishes them all at once, or nothing.

The merge writes through these calls only, so another kind of output (an object store: parts
uploaded, then committed) is one new class. LocalTarget (io.staging) is the local one: a hidden
staging folder beside OUT_DIR, renamed into place by `publish`.

Several processes may write one target (a merge under torchrun): rank 0 makes it, the others
`join` it by its `token` and only `open` files in it; each writes its own byte ranges, and only
rank 0 writes the small files and publishes.
"""

from __future__ import annotations

from typing import Protocol


class Target(Protocol):
    published: bool

    @property
    def token(self) -> str:
        """What another process passes to join this target (the staging folder's name)."""

    def open(self, name: str, size: int) -> int:
        """A file descriptor for writing byte ranges of file `name` (made `size` bytes long if new);
        several writers may hold it at once. The caller closes it (after fsync)."""

    def write_bytes(self, name: str, data: bytes) -> None:
        """A small file written whole (config, index, manifest), durable when this returns."""

    def write_json(self, name: str, value: dict) -> None: ...

    def write_manifest(self, manifest: dict) -> None:
        """The output's manifest, after every other file: it adds the list of them (`written`),
        which is all a later --overwrite may remove."""

    def publish(self) -> None:
        """Make every file written visible at once, at the output's name."""

    def discard(self) -> None:
        """Remove what was written unless published; release what the target holds. Always called."""
