"""A merged folder in an object store as `verify` reads it: the tensors its headers list (read from
the metadata stand-in, remote.metadata_mirror), each tensor's bytes fetched by ranged GETs a slice at
a time as the checksum walks it, pinned to the ETag the object was listed with.

Memory stays flat whatever the model: the slice being checksummed and the next one, fetched while the
first is checked (two GETs of at most the slice the reader asks for, 16 MB in verify), nothing on disk.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ..errors import FsdpfastError
from .stores import get_pinned, store_for


class OutputChanged(FsdpfastError):
    """An object of the folder being verified was replaced or deleted while it was read."""


class StreamedTensors:
    """`tensor(name)`: a sliceable view of the tensor's bytes in the store; `done(name)`: nothing is kept."""

    def __init__(self, stored: dict, mirror):
        self.stored, self.mirror = stored, mirror
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="fsdpfast-verify-get")

    def tensor(self, name: str) -> _StreamedView:
        tensor = self.stored[name]
        url = self.mirror.said(tensor.path)
        return _StreamedView(self._pool, url, self.mirror.etags.get(url), tensor.byte_offset, tensor.nbytes)

    def done(self, name: str) -> None:
        pass

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _StreamedView:
    """Bytes [offset, offset + nbytes) of one object; `view[a:b]` is a GET, the next range of that
    length already on its way."""

    def __init__(self, pool, url: str, etag: str | None, offset: int, nbytes: int):
        self.pool, self.url, self.etag, self.offset, self.nbytes = pool, url, etag, offset, nbytes
        self._ahead = None  # (start, end, future) of the range fetched ahead

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, cut: slice) -> bytes:
        start, end, _ = cut.indices(self.nbytes)
        if end <= start:
            return b""
        ahead, self._ahead = self._ahead, None
        data = ahead[2].result() if ahead is not None and ahead[:2] == (start, end) else self._get(start, end)
        following = (end, min(self.nbytes, end + (end - start)))
        if following[1] > following[0]:
            self._ahead = (*following, self.pool.submit(self._get, *following))
        return data

    def release(self) -> None:
        if self._ahead is not None:
            self._ahead[2].cancel()
            self._ahead = None

    def _get(self, start: int, end: int) -> bytes:
        from obstore.exceptions import NotFoundError, PreconditionError

        store, key = store_for(self.url)
        try:
            return bytes(get_pinned(store, key, self.offset + start, self.offset + end, self.etag).bytes())
        except (PreconditionError, NotFoundError, FileNotFoundError):
            raise OutputChanged(
                f"{self.url}: the object was replaced or deleted while it was verified; verify again"
            ) from None
