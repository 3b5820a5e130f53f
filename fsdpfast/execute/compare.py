"""The sink that compares (verify --against): each piece recomputed from the shards and compared,
byte for byte, with what a merged folder holds under the tensor's name.

The native kernels recompute and compare a chunk at a time, never holding a tensor whole; other
pieces (float64 casts, --merge-lora weights, no native module) are filled one at a time in memory.
"""

from __future__ import annotations

from .. import _ops
from ..io.safetensors_folder import MappedFiles
from ..io.sources import Source
from ..plan.layout import PlacedTensor
from .fallback import fill
from .kernel_rows import build_rows, native_pair

CHUNK_BYTES = 1 << 20  # recomputed per thread at once, as in the native engine
SLICE_BYTES = 16 << 20  # bytes compared at once in Python


class CompareSink:
    """`first[name]`: the first byte at which the output differs from the recomputed tensor, or -1."""

    def __init__(self, files: MappedFiles, device: str = "cpu"):
        self.files, self.device = files, device
        self.first: dict[str, int] = {}

    def write(self, pieces: list[PlacedTensor], sources: Source) -> list[int | None]:
        results: dict[int, tuple[int, int | None]] = {}
        native = [
            i
            for i, p in enumerate(pieces)
            if _ops.native_cpu()
            and p.nbytes
            and p.tensor.compute is None
            and native_pair(p.tensor.source_dtype, p.tensor.target_dtype)
        ]
        if native:
            views, rows = build_rows([pieces[i].tensor for i in native], sources)
            expected = [self.files.tensor(pieces[i].tensor.name) for i in native]
            try:
                crcs, firsts = _ops.native().gather_convert_compare(
                    views, rows, expected, CHUNK_BYTES, _ops.cpu_threads(), release_sources=True
                )
            finally:
                for view in views + expected:
                    view.release()
            results.update(zip(native, zip(firsts, crcs)))
        for i, p in enumerate(pieces):
            if i not in results:  # rare dtype pairs, empty tensors, computed weights, or no native module
                buffer = bytearray(p.nbytes)
                fill(p.tensor, memoryview(buffer), sources, self.device)
                view = self.files.tensor(p.tensor.name)
                results[i] = (first_difference(memoryview(buffer), view), _ops.crc32c(buffer))
                view.release()
        for i, p in enumerate(pieces):
            self.first[p.tensor.name] = results[i][0]
            self.files.done(p.tensor.name)
        return [results[i][1] for i in range(len(pieces))]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def first_difference(a: memoryview, b: memoryview) -> int:
    """The first byte offset where a and b differ, or -1 (compared a slice at a time)."""
    for start in range(0, max(len(a), len(b)), SLICE_BYTES):
        x, y = bytes(a[start : start + SLICE_BYTES]), bytes(b[start : start + SLICE_BYTES])
        if x != y:
            step = 4096
            while step:
                while x[:step] == y[:step]:
                    x, y, start = x[step:], y[step:], start + step
                step //= 64
            return start
    return -1
