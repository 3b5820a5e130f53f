"""Write this rank's pieces of a live model's tensors at their final offsets in the shared output files.

A piece is one or more runs of the tensor's bytes (live.plan.LocalPiece): one for rows, many for
a column block (one per row). A CPU piece goes to the native kernel as it is: it casts (rounding
as an offline merge does), writes each run with pwrite and checksums it, many threads at once. A
CUDA piece is cast on its GPU (by the extension's CUDA op where built, else torch's `.to()`: the
same rounding), copied without blocking into one of two pinned host buffers used in turn, and
written by the kernel once its copy's CUDA event has fired. A CPU piece the kernel has no cast
for (float64), or any when the native module is missing, is cast by torch's `.to()` first. A
writer thread writes one piece while the next is prepared (cast and copied, on a GPU): two pieces
in flight at most, so host memory stays at two tensors' shards, never the model.

Checksums: a tensor's CRC-32C is its pieces' combined in order (execute.parts.tensor_checksums)
where each rank's bytes are a few ranges (Piece). Column blocks interleave the ranks' bytes row
by row; a rank then sends instead the CRC of the tensor's bytes with its own in place and zeros
elsewhere (a Spread: its runs' CRCs joined over the zero gaps by the native crc32c_spread), and
`settle` joins the ranks' Spreads: CRC-32C is affine in the data, so for images A and B of one
length n, crc(A xor B) = crc(A) xor crc(B) xor crc(n zero bytes).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import lru_cache

from .. import _ops
from ..dtypes import itemsize, torch_dtype
from ..errors import FsdpfastError
from ..execute.kernel_rows import native_pair
from ..execute.parts import Piece
from ..io.target import TargetFile
from ..plan.layout import OutputFile
from .fp8 import quantized_piece
from .plan import LiveTensor, LocalPiece, dtype_name, extent_runs, hub_piece, local_piece

IN_FLIGHT = 2  # pieces in flight: one being written while the next is prepared
CHUNK_BYTES = 1 << 20  # the kernel's unit of work per thread
MAX_PIECES = 16  # a rank's runs of one tensor sent as Pieces up to this many; more as one Spread


@dataclass(frozen=True)
class WriteWays:
    """How a rank writes its pieces. The defaults are the ways save_pretrained writes; the others are
    kept to measure them side by side (benchmarks/live_save.py, benchmarks/live_cast.py)."""

    redistribute: bool = False  # pieces that are not whole rows redistributed to Shard(0) first (live.plan)
    torch_cast: bool = False  # pieces cast by torch's .to() instead of the extension's kernels


@dataclass(frozen=True)
class Spread:
    """The CRC-32C of a tensor's bytes with this rank's `nbytes` of them in place and zeros elsewhere."""

    file: str
    tensor: str
    nbytes: int
    crc: int | None


def write_runs(
    files: list[OutputFile],
    tensors: list[LiveTensor],
    open_file: Callable[[str, int], TargetFile],
    rank: int,
    ways: WriteWays = WriteWays(),
    held: list[tuple[LiveTensor, LocalPiece]] | None = None,
) -> list[Piece | Spread]:
    """Write what this rank holds of `tensors` (every rank calls this with the same list: a
    redistribution is collective); `open_file(name, size)` opens an output file of the Target (Target.open).
    `held`: the pieces already copied to host memory (`snapshot`), written instead of the live ones."""

    where = {p.tensor.name: (f, p) for f in files for p in f.tensors}
    opened: dict[str, TargetFile] = {}
    pieces: list[Piece | Spread] = []
    pending: list[Future] = []
    threads = _threads()
    staging = None  # pinned host buffers, made at the first CUDA piece (a CPU-only run never makes any)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdpfast-write") as writer:
        try:
            for tensor, local in held if held is not None else _live_pieces(tensors, rank, ways):
                file, placed = where[tensor.name]
                if local is None or not local.data.numel():
                    continue
                if file.name not in opened:
                    opened[file.name] = open_file(file.name, file.size)
                out = opened[file.name]
                data, target, ready = local.data.contiguous(), placed.tensor.target_dtype, None
                if data.is_cuda:
                    staging = staging or _PinnedSlots(IN_FLIGHT, kernel_cast=not ways.torch_cast)
                    data, ready = staging.stage(data, target)
                elif ways.torch_cast or not _kernel_casts(data, target, out):
                    data = data.to(torch_dtype(target)).to("cpu").contiguous()
                job = (out, data, local.extents, target, placed, file.name, threads, ready)
                pending.append(writer.submit(_write, *job))
                while len(pending) >= IN_FLIGHT:
                    pieces += pending.pop(0).result()
            for future in pending:
                pieces += future.result()
            pending = []
            for out in opened.values():
                out.sync()
        finally:
            # a write already running cannot be cancelled: wait for it before its file is closed
            # (else it could write into whatever file reuses the descriptor's number)
            writer.shutdown(wait=True, cancel_futures=True)
            for out in opened.values():
                out.close()
    return pieces


def _live_pieces(tensors: list[LiveTensor], rank: int, ways: WriteWays):
    for tensor in tensors:
        if tensor.fp8_scale_of is not None:  # a scale_inv: computed, rank 0 writes it
            yield tensor, local_piece(tensor.value, rank)
            continue
        piece = hub_piece(tensor, local_piece(tensor.value, rank, tensor.key, ways.redistribute))
        if tensor.fp8 is not None and piece is not None and piece.data.numel():
            piece = quantized_piece(tensor, piece)
        yield tensor, piece


def snapshot(
    tensors: list[LiveTensor], rank: int, ways: WriteWays = WriteWays()
) -> list[tuple[LiveTensor, LocalPiece]]:
    """This rank's pieces copied to host memory (pinned for CUDA pieces, all copies awaited), as they
    are stored: the model may change once this returns. Host memory: the rank's pieces, once."""
    import torch

    held, on_cuda = [], False
    for tensor, local in _live_pieces(tensors, rank, ways):
        if local is None or not local.data.numel():
            continue
        data = local.data.contiguous()
        if data.is_cuda:
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            host.copy_(data, non_blocking=True)
            on_cuda = True
        else:
            host = data.clone()
        held.append((tensor, replace(local, data=host)))
    if on_cuda:
        torch.cuda.synchronize()
    return held


def held_bytes(held: list[tuple[LiveTensor, LocalPiece]]) -> int:
    return sum(local.data.numel() * local.data.element_size() for _, local in held)


def settle(files: list[OutputFile], pieces: list[Piece | Spread]) -> list[Piece]:
    """All ranks' Pieces, with every tensor that has Spreads given one Piece of its whole bytes:
    the ranks' Spreads (and any Pieces of it, padded with zeros) joined."""
    sizes = {(f.name, p.tensor.name): p.nbytes for f in files for p in f.tensors}
    spread = {(s.file, s.tensor) for s in pieces if isinstance(s, Spread)}
    images: dict[tuple[str, str], list[tuple[int, int | None]]] = {}
    settled = []
    for p in pieces:
        key = (p.file, p.tensor)
        if key not in spread:
            settled.append(p)
        elif isinstance(p, Spread):
            images.setdefault(key, []).append((p.nbytes, p.crc))
        else:
            images.setdefault(key, []).append((p.nbytes, _image_crc([p.start], [p.nbytes], [p.crc], sizes[key])))
    for (file, tensor), parts in images.items():
        n, crc = sizes[(file, tensor)], 0
        if sum(nbytes for nbytes, _ in parts) != n:  # the pieces must cover the tensor once (ranks write disjoint ones)
            raise FsdpfastError(
                f"save_pretrained: the ranks' pieces of {tensor} cover {sum(b for b, _ in parts)} of its {n} bytes; "
                "nothing was published: this is a bug in fsdpfast, please report it with the model's sharding"
            )
        for _, part in parts:
            crc = None if crc is None or part is None else crc ^ part
        if crc is not None and len(parts) % 2 == 0:
            crc ^= _zeros_crc(n)
        settled.append(Piece(file, tensor, 0, n, crc))
    return settled


def _kernel_casts(data, target: str, out: TargetFile) -> bool:
    return _kernel_writes(out) and data.device.type == "cpu" and native_pair(dtype_name(data.dtype), target)


def _kernel_writes(out: TargetFile) -> bool:
    """The native kernel writes (and checksums) pieces of a local file, through its descriptor."""
    return _ops.native_cpu() and out.local_descriptor() is not None


class _PinnedSlots:
    """`count` pinned host buffers used in turn for CUDA pieces: a piece is cast on its GPU, then
    copied into the next buffer without blocking, and the writer thread waits on the copy's event.
    A buffer comes round again only after the piece before it in that buffer was written (write_runs
    keeps count - 1 pieces in flight while it prepares the next), so the GPU's cast and copy of one
    piece overlap the write of the one before, and host memory stays at `count` pieces' bytes."""

    def __init__(self, count: int, kernel_cast: bool = True):
        self.buffers: list = [None] * count
        self.turn = 0
        self.kernel_cast = kernel_cast

    def stage(self, data, target: str):
        """(a pinned CPU tensor of `data`'s elements as `target`, flat; the CUDA event its copy fires)."""
        import torch

        with torch.cuda.device(data.device):
            cast = _cast_on_device(data.reshape(-1), target, self.kernel_cast)
            nbytes = cast.numel() * cast.element_size()
            k, self.turn = self.turn, (self.turn + 1) % len(self.buffers)
            if self.buffers[k] is None or self.buffers[k].numel() < nbytes:
                self.buffers[k] = None  # the smaller one goes back to torch's pinned cache first
                self.buffers[k] = torch.empty(_grown(nbytes), dtype=torch.uint8, pin_memory=True)
            host = self.buffers[k][:nbytes].view(cast.dtype)
            host.copy_(cast, non_blocking=True)
            ready = torch.cuda.Event(blocking=True)  # the writer thread sleeps on it, not spins
            ready.record(torch.cuda.current_stream(data.device))
        return host, ready


def _cast_on_device(data, target: str, kernel: bool = True):
    """`data` (flat, contiguous, on a GPU) as `target`, on the same GPU: by the extension's CUDA op
    where it is built and has the pair, else by torch's `.to()` (both round to nearest even)."""
    import torch

    source = dtype_name(data.dtype)
    if source == target:
        return data
    if kernel and _ops.code(source) and _ops.code(target) and _ops.native_cuda_built():
        out = torch.empty(data.numel() * itemsize(target), dtype=torch.uint8, device=data.device)
        row = [0, 0, _ops.code(source), _ops.code(target), data.element_size(), itemsize(target)]
        plan = torch.tensor([[*row, 0, data.numel(), 0, 1, 0, 0]], dtype=torch.int64)  # csrc/plan_rows.h
        _ops.gather_convert([data.view(torch.uint8)], [out], plan)
        return out.view(torch_dtype(target))
    return data.to(torch_dtype(target))


def _grown(nbytes: int) -> int:
    """A pinned buffer's size for `nbytes`: rounded up to a power of two, so it is remade in few steps."""
    return 1 << max(20, (nbytes - 1).bit_length())


def _threads() -> int:
    import torch

    return torch.get_num_threads()  # what the job gave this process (torchrun: cores / local ranks)


def _write(
    out: TargetFile, data, extents, target: str, placed, file: str, threads: int, ready=None
) -> list[Piece | Spread]:
    """Write `data`'s runs into the tensor's place in the file (once `ready`, the CUDA event of its
    copy to host, has fired); what its checksums are sent as."""
    if ready is not None:
        ready.synchronize()
    size = itemsize(target)
    runs = extent_runs(extents)  # (source element, count, tensor element) per run
    if _kernel_writes(out):
        crcs = _kernel_write(out.local_descriptor(), data, runs, target, placed.offset, threads)
    else:  # through the Target (no checksums without the native module: the manifest records none)
        view, step = _bytes_of(data), data.element_size()
        crcs = []
        for src, count, dst in runs.tolist():
            run = view[src * step : (src + count) * step]
            out.write_at(run, placed.offset + dst * size)
            crcs.append(_ops.crc32c(run))
    starts, lengths = runs[:, 2] * size, runs[:, 1] * size
    if len(starts) <= MAX_PIECES:
        return [Piece(file, placed.tensor.name, *run) for run in zip(starts.tolist(), lengths.tolist(), crcs)]
    return [Spread(file, placed.tensor.name, int(lengths.sum()), _image_crc(starts, lengths, crcs, placed.nbytes))]


def _kernel_write(fd: int, data, runs, target: str, offset: int, threads: int) -> list[int]:
    """One kernel call: run i is destination i (its bytes in the file), cast from `data` on the way."""
    import torch

    source = dtype_name(data.dtype)
    same = source == target
    rows = torch.zeros((len(runs), _ops.COLUMNS), dtype=torch.int64)  # csrc/plan_rows.h
    rows[:, 1] = torch.arange(len(runs))
    rows[:, 2], rows[:, 3] = (0, 0) if same else (_ops.code(source), _ops.code(target))
    rows[:, 4], rows[:, 5] = data.element_size(), itemsize(target)
    rows[:, 6], rows[:, 7], rows[:, 9] = runs[:, 0], runs[:, 1], 1
    offsets = offset + runs[:, 2] * itemsize(target)
    sizes = runs[:, 1] * itemsize(target)
    try:
        return _ops.native().gather_convert_to_file(
            [_bytes_of(data)], _int64s(rows), _int64s(offsets), _int64s(sizes), fd, CHUNK_BYTES, threads
        )
    except RuntimeError as exc:  # the kernel's I/O errors, e.g. "writing the output file: File too large"
        raise FsdpfastError(str(exc)) from None


def _image_crc(starts, lengths, crcs, nbytes: int) -> int | None:
    """CRC-32C of `nbytes` bytes that hold runs (at `starts`, `lengths` long, of CRC-32C `crcs`; in
    order) and zeros elsewhere: in the native module (a few ns per run), else two combines per run."""
    crcs = list(crcs)
    if any(crc is None for crc in crcs):
        return None
    spread = getattr(_ops.native(), "crc32c_spread", None)
    if spread is not None:
        import torch

        held = [torch.as_tensor(v, dtype=torch.int64).contiguous() for v in (starts, lengths, crcs)]
        return spread(*map(_int64s, held), nbytes)
    crc, at = 0, 0  # a build from before crc32c_spread was bound
    for start, length, part in zip(list(map(int, starts)), list(map(int, lengths)), crcs):
        if start > at:
            crc = _ops.crc32c_combine(crc, _zeros_crc(start - at), start - at)
        crc, at = _ops.crc32c_combine(crc, part, length), start + length
    if nbytes > at:
        crc = _ops.crc32c_combine(crc, _zeros_crc(nbytes - at), nbytes - at)
    return crc


@lru_cache(maxsize=256)
def _zeros_crc(n: int) -> int | None:
    """CRC-32C of n zero bytes, by doubling (log n combines)."""
    crc, power, length = 0, _ops.crc32c(b"\0"), 1
    if power is None:
        return None
    while n:
        if n & 1:
            crc = _ops.crc32c_combine(crc, power, length)
        power, length, n = _ops.crc32c_combine(power, power, length), length * 2, n >> 1
    return crc


def _bytes_of(tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the caller keeps the tensor alive)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _int64s(tensor) -> memoryview:
    """A contiguous int64 CPU tensor as the int64 buffer the native module takes (no numpy needed)."""
    return _bytes_of(tensor).cast("q")
