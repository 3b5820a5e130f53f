"""A Source over object-store files: the announced byte ranges fetched by concurrent ranged GETs.

The batching, read-ahead and memory release are io.pread_sources' (the plan's bytes in flight are
two batches, BATCH_BYTES each, fetched READ_BYTES per request on THREADS threads: at most 32 GETs
and 256 MB requested at once, about 32 MB of source bytes held). Only the read differs: a GET of
bytes [start, end) conditioned on the ETag the object had when first read, so an object replaced
during the merge fails it (SourceChanged), as a file that changed on local disk does. Nothing is
staged on local disk.
"""

from __future__ import annotations

import mmap
import threading

from ..io.pread_sources import PreadSources
from ..manifest import SourceChanged
from .stores import store_for


class RangeSources(PreadSources):
    """The plan's source buffers whose paths are s3:// (gs://, az://) URLs."""

    def __init__(self, buffers, etags: dict[str, str] | None = None, **kwargs):
        super().__init__(buffers, **kwargs)
        self._etags: dict[str, str] = dict(etags or {})  # URL -> ETag the plan was read from
        self._lock = threading.Lock()

    def _read(self, index: int, memory: mmap.mmap, start: int, end: int) -> None:
        import obstore
        from obstore.exceptions import NotFoundError, PreconditionError

        buffer = self.buffers[index]
        store, key = store_for(buffer.path)
        first, last = buffer.byte_offset + start, buffer.byte_offset + end
        try:
            got = obstore.get(store, key, options={"range": (first, last), "if_match": self.etag(buffer.path)})
            data = got.bytes()
        except (PreconditionError, NotFoundError, FileNotFoundError):  # obstore raises either for a 404
            raise SourceChanged(
                f"{buffer.path}: the object was replaced or deleted during the merge; nothing was published; "
                "merge again once the checkpoint is complete"
            ) from None
        if len(data) != last - first:
            raise SourceChanged(
                f"{buffer.path}: {len(data)} bytes at {first} where the merge planned {last - first}: it changed "
                "during the merge; nothing was published; merge again once the checkpoint is complete"
            )
        memoryview(memory)[start:end] = memoryview(data)

    def etag(self, url: str) -> str:
        """The object's ETag when the merge first read it: every later GET must find the same."""
        with self._lock:
            known = self._etags.get(url)
        if known is None:
            import obstore

            store, key = store_for(url)
            known = obstore.head(store, key)["e_tag"]
            with self._lock:
                known = self._etags.setdefault(url, known)
        return known
