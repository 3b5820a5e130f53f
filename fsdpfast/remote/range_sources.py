"""A Source over object-store files: the announced byte ranges fetched by concurrent ranged GETs.

The batching, read-ahead and memory release are io.pread_sources'; what differs is the read:
- Few, large GETs. A store's cost is per request (a round trip of tens of milliseconds to S3; moto,
  the tests' server, reads the whole object for every ranged GET: 0.3 s for 1 MB of a 170 MB object
  as for 32 MB, docs/performance.md), so the ranges a batch needs are gathered by object: ranges of
  one object less than GAP_BYTES (1 MB) apart are fetched by one GET (the gap's bytes fetched and
  dropped), up to GET_BYTES (32 MB) a GET, which is also the size at which a GET's own transfer
  outweighs its round trip. An object of at most GET_BYTES is thus read in one GET as soon as a
  batch needs it. A rank file's storages are not in the output's order, so a batch's ranges of it
  are often apart, about one tensor's shard a GET; joining them up to 32 MB apart fetched 41% more
  bytes for 20% fewer GETs (measured, not adopted).
- Memory: batches of BATCH_BYTES (32 MB, so a batch's range of one object is one GET, not four)
  with AHEAD_BYTES (64 MB) announced ahead: at most about 96 MB of source bytes held, and THREADS
  (8) GETs in flight. A GET's response is copied into the buffers' memory as it arrives (CHUNK_BYTES,
  1 MB, at a time), never held whole.
- Each GET is conditioned on the ETag the object had when first read (If-Match, and the response's
  ETag compared: stores.get_pinned), so an object replaced during the merge fails it (SourceChanged),
  as a file that changed on local disk does. Nothing is staged on local disk.
"""

from __future__ import annotations

import threading

from ..io.pread_sources import PreadSources
from ..manifest import SourceChanged
from .stores import get_pinned, store_for

GET_BYTES = 32 << 20  # the most one ranged GET asks for
GAP_BYTES = 1 << 20  # ranges of one object closer than this share a GET
BATCH_BYTES = 32 << 20
AHEAD_BYTES = 64 << 20
THREADS = 8
CHUNK_BYTES = 1 << 20  # a GET's response copied into the buffers as it arrives, about this much at a time


class RangeSources(PreadSources):
    """The plan's source buffers whose paths are s3:// (gs://, az://) URLs."""

    batch_bytes = BATCH_BYTES
    ahead_bytes = AHEAD_BYTES

    def __init__(self, buffers, etags: dict[str, str] | None = None, threads: int | None = None, **kwargs):
        super().__init__(buffers, threads=threads or THREADS, read_bytes=GET_BYTES, **kwargs)
        self._etags: dict[str, str] = dict(etags or {})  # URL -> ETag the plan was read from
        self._lock = threading.Lock()

    def read_ahead(self, ranges: dict[int, list[tuple[int, int]]]) -> None:
        """Start the GETs for a batch's ranges: grouped by object, near ones joined (GAP_BYTES), GET_BYTES at most."""
        wanted = []  # (object URL, first byte in it, last byte, buffer index, start in the buffer)
        for index, asked in ranges.items():
            buffer = self.buffers[index]
            batch = self.announce(index, asked)
            for start, end in batch.ranges:
                for at in range(start, end, GET_BYTES):
                    first = buffer.byte_offset + at
                    wanted.append((buffer.path, first, first + min(end - at, GET_BYTES), index, at, batch))
        wanted.sort(key=lambda w: (w[0], w[1]))
        spans: list[list] = []  # [url, first, last, members]
        for url, first, last, index, at, batch in wanted:
            span = spans[-1] if spans else None
            if span and span[0] == url and first - span[2] < GAP_BYTES and max(last, span[2]) - span[1] <= GET_BYTES:
                span[2] = max(span[2], last)
                span[3].append((index, at, first, last, batch))
            else:
                spans.append([url, first, last, [(index, at, first, last, batch)]])
        for url, first, last, members in spans:
            read = self._pool.submit(self._read_span, url, first, last, [m[:4] for m in members])
            for batch in {id(m[4]): m[4] for m in members}.values():
                batch.reads.append(read)

    def _read_span(self, url: str, first: int, last: int, members: list[tuple[int, int, int, int]]) -> None:
        """Bytes [first, last) of the object at `url` by one GET, copied to the members (buffer index, start in
        the buffer, first and last byte of the object)."""
        from obstore.exceptions import NotFoundError, PreconditionError

        store, key = store_for(url)
        at = first  # the object's next byte to arrive
        try:
            got = get_pinned(store, key, first, last, self.etag(url))
            for chunk in got.stream(min_chunk_size=CHUNK_BYTES):  # copied as it arrives: a chunk held, not the GET
                chunk = memoryview(chunk)
                end = min(last, at + chunk.nbytes)
                for index, start, lo, hi in members:
                    a, b = max(lo, at), min(hi, end)
                    if a < b:
                        with memoryview(self._memory[index]) as memory:  # released at once: it may be closed after
                            memory[start + a - lo : start + b - lo] = chunk[a - at : b - at]
                at += chunk.nbytes
        except (PreconditionError, NotFoundError, FileNotFoundError):  # obstore raises either for a 404
            raise SourceChanged(
                f"{url}: the object was replaced or deleted during the merge; nothing was published; "
                "merge again once the checkpoint is complete"
            ) from None
        if at != last:
            raise SourceChanged(
                f"{url}: {at - first} bytes at {first} where the merge planned {last - first}: it changed "
                "during the merge; nothing was published; merge again once the checkpoint is complete"
            )

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
