"""The native CPU engine: gather, convert and write in one multithreaded pass per batch.

Each thread assembles chunks of the output in a buffer of its own and writes them at their
final offset, so output pages are written once and never zero-filled first. The kernels come
from fsdpfast._native, which needs no torch: a merge with this engine never imports it.
"""

from __future__ import annotations

from array import array

from .. import _ops
from ..errors import FsdpfastError
from ..io.sources import Source
from ..io.target import TargetFile
from ..plan.layout import PlacedTensor
from .fallback import write_through_buffer
from .kernel_rows import build_rows, native_pair
from .sinks import WindowOutput

CHUNK_BYTES = 1 << 20  # per thread: small chunks keep the input pages mapped at once few (flat RSS)


class NativeCpuEngine:
    name = "cpu"

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, threads: int | None = None):
        self.chunk_bytes = chunk_bytes
        self.threads = threads or _ops.cpu_threads()

    def output(self, file: TargetFile, end: int, start: int = 0) -> FileOutput | WindowOutput:
        fd = file.local_descriptor()
        if fd is None:  # the kernels write only to a local descriptor: a window filled by torch, the same bytes
            from .torch_engine import TorchEngine

            return TorchEngine().output(file, end, start)
        return FileOutput(self, file, fd)


class FileOutput:
    """The native engine's sink (execute.sinks.Sink): each piece written at its own offset of a
    local file, by the kernels through its descriptor."""

    def __init__(self, engine: NativeCpuEngine, file: TargetFile, fd: int):
        self.engine, self.file, self.fd = engine, file, fd

    def write(self, placed: list[PlacedTensor], sources: Source) -> list[int]:
        """Write the pieces; their CRC-32Cs, combined from the chunks the threads wrote."""
        crcs: dict[int, int] = {}
        native = [
            p for p in placed if native_pair(p.tensor.source_dtype, p.tensor.target_dtype) and p.tensor.compute is None
        ]
        if native:
            views, rows = build_rows([p.tensor for p in native], sources)
            offsets = array("q", (p.offset for p in native))
            sizes = array("q", (p.nbytes for p in native))
            try:
                # Mapped input files (SourceFiles): private, never-written mappings, so their pages can
                # be dropped as soon as they are read. Read buffers (PreadSources) are released per batch.
                written = _ops.native().gather_convert_to_file(
                    views,
                    rows,
                    offsets,
                    sizes,
                    self.fd,
                    self.engine.chunk_bytes,
                    self.engine.threads,
                    release_sources=getattr(sources, "drops_pages_as_read", True),
                )
            except (
                RuntimeError
            ) as exc:  # the kernels' I/O errors, e.g. "writing the output file: No space left on device"
                raise FsdpfastError(str(exc)) from None
            finally:
                for view in views:
                    view.release()
            crcs.update(zip(map(id, native), written))
        for p in placed:
            if id(p) not in crcs:  # float64 casts (through torch), weights computed by --merge-lora
                crcs[id(p)] = write_through_buffer(self.file, p, sources)
        return [crcs[id(p)] for p in placed]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass
