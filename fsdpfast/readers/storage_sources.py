"""The plan's source buffers for tensors read from torch.save archives: one per (file, storage record)."""

from __future__ import annotations

from .._parsing.safe_load import TensorRef
from .._parsing.torch_zip import TorchZip
from ..plan.columns import Records, RecordsBuilder
from ..plan.model import SourceBuffer


class StorageSources:
    """Source buffers by (file, storage record); archives not given are opened here, once each, until close()."""

    def __init__(self):
        self._buffers = RecordsBuilder(SourceBuffer)  # a million at 1,024 ranks: in columns
        self._count = 0
        self._index: dict[str, dict[str, int]] = {}  # path -> storage key -> buffer
        self._opened: dict[str, TorchZip] = {}

    def index(self, path: str, tensor: TensorRef, archive: TorchZip | None = None) -> int:
        """The index of the buffer holding `tensor`'s storage in `path` (an archive already open may be given)."""
        known = self._index.get(path)
        if known is None:
            known = self._index[path] = {}
        key = tensor.storage.key
        found = known.get(key)
        if found is None:
            if archive is None:
                if path not in self._opened:
                    self._opened[path] = TorchZip(path)
                archive = self._opened[path]
            found = known[key] = self._count
            self._count += 1
            offset, nbytes = archive.storage_bytes(tensor.storage)
            self._buffers.append_values(archive.path, offset, nbytes, tensor.storage.dtype)
        return found

    @property
    def buffers(self) -> Records:
        """The buffers so far, for the plan."""
        return self._buffers.done()

    def forget(self, path: str) -> None:
        """Let go of which storages of `path` have buffers (a million entries at 1,024 ranks); a
        storage asked for again gets a second buffer, which reads the same bytes."""
        self._index.pop(path, None)

    def close(self) -> None:
        for archive in self._opened.values():
            archive.close()
