"""Where output files go: a Target receives a merge's bytes and publishes its files all at once, or nothing.

Engines, the live writer and the folder writers reach the output through these calls only, so
another kind of output (an object store: each file a multipart upload, committed at `publish`) is
one new class. LocalTarget (io.local_target) is the local one: a hidden staging folder beside
OUT_DIR, renamed into place by `publish`.

Who calls what, in this order (rank 0 alone in a one-process merge):
  0) (rank 0) makes the target (`LocalTarget(out_dir, overwrite)`): the output place is checked
     and held, nothing is visible at OUT_DIR yet.
  1) (other ranks) `LocalTarget.join(out_dir, token)` (`ObjectTarget.join`), with rank 0's `token`.
  2) (every rank) `open(name, size)` for each file it has bytes of, then `write_at` or `window`
     over its own byte ranges (ranks write disjoint ones, headers included), `sync()` once they
     are written, `close()` always.
  3) (rank 0, once every rank's writes succeeded) `write_bytes` / `write_json` for the small
     files (index, config, generation config); `local_folder` for what a third-party writer makes
     (a tokenizer's save_pretrained).
  4) (rank 0) `write_manifest(manifest)`, after every other file.
  5) (rank 0) `publish()`.
  6) (every rank that made or joined a target) `discard()`, always, last.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

Bytes = bytes | bytearray | memoryview


class Window(Protocol):
    """Writable bytes of one output file, addressed by file offset; what was written there is in
    the file once closed (locally a shared mapping of the file; an object store's: a part buffer)."""

    def at(self, offset: int, nbytes: int) -> memoryview:
        """The window's bytes [offset, offset + nbytes) of the file, to fill; the caller releases the view."""

    def close(self) -> None: ...


class TargetFile(Protocol):
    """One output file of a Target, open for writing byte ranges. Several writers (processes) may
    hold the same file at once, each writing its own ranges."""

    def write_at(self, data: Bytes, offset: int) -> None:
        """All of `data` at `offset`."""

    def window(self, start: int, end: int) -> Window:
        """Bytes [start, end) to fill in memory (torch and cuda engines); their room is reserved first,
        so a full disk fails here, cleanly, not as a fault while they are filled."""

    def local_descriptor(self) -> int | None:
        """The OS descriptor of a local file, for in-process kernels that write at offsets
        themselves (the native engine); None where the bytes go elsewhere (use `write_at` or `window`)."""

    def sync(self) -> None:
        """What was written is durable when this returns."""

    def close(self) -> None: ...

    def __enter__(self) -> TargetFile: ...

    def __exit__(self, *exc: object) -> None: ...


class Target(Protocol):
    published: bool
    whole_files: bool  # each file written by one process (an object store's upload); else shared by byte ranges
    warnings: list[str] | tuple[str, ...]  # what was kept of an earlier OUT_DIR because fsdpfast did not write it

    @property
    def token(self) -> str:
        """What another process passes to join this target (the staging folder's name)."""

    def open(self, name: str, size: int) -> TargetFile:
        """File `name` (made `size` bytes long if new), open for writing byte ranges; the caller closes it."""

    def write_bytes(self, name: str, data: bytes) -> None:
        """A small file written whole (config, index, manifest), durable when this returns."""

    def write_json(self, name: str, value: dict) -> None: ...

    def local_folder(self, name: str = "") -> AbstractContextManager[str]:
        """A local folder for a writer that takes only a path (a tokenizer's save_pretrained): what it
        holds when the block ends is part of the output at `name` ("": its top level)."""

    def write_manifest(self, manifest: dict) -> None:
        """The output's manifest, after every other file: it adds the list of them (`written`),
        which is all a later --overwrite may remove."""

    def publish(self) -> None:
        """Make every file written visible at once, at the output's name."""

    def discard(self) -> None:
        """Remove what was written unless published; release what the target holds. Always called."""
