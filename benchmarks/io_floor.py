"""The I/O floor of a merge: what any merger must pay, with no merging logic at all.

Starts Python with torch imported, reads every byte of the given input files and writes an
output file of the given size, with one thread per core, then fsyncs it (the merge fsyncs
too). Each thread takes an equal share of the input and of the output and interleaves them
chunk by chunk, as a streaming merge does.

    python benchmarks/io_floor.py OUT_FILE OUT_BYTES INPUT [INPUT ...] [--write pwrite|mmap]

--write pwrite: output chunks written with pwrite from a buffer.
--write mmap:   the output file mapped and filled through the mapping (torch copy_).
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading

import torch

CHUNK = 8 << 20


def shares(total: int, parts: int) -> list[tuple[int, int]]:
    """(start, end) of `parts` nearly equal pieces of `total` bytes, cut at chunk multiples."""
    step = -(-total // parts)
    step += -step % CHUNK
    return [(min(total, i * step), min(total, (i + 1) * step)) for i in range(parts)]


def input_spans(paths: list[str]) -> list[tuple[int, int, int]]:
    """(fd, offset, length) of every input chunk, in order."""
    spans = []
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        size = os.fstat(fd).st_size
        spans += [(fd, offset, min(CHUNK, size - offset)) for offset in range(0, size, CHUNK)]
    return spans


def worker(reads, writes, write_chunk) -> None:
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    steps = max(len(reads), len(writes))
    for i in range(steps):
        if i < len(reads):
            fd, offset, length = reads[i]
            os.preadv(fd, [view[:length]], offset)
        if i < len(writes):
            write_chunk(view, *writes[i])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("out_bytes", type=int)
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("--write", choices=("pwrite", "mmap"), default="pwrite")
    args = parser.parse_args()
    threads = os.cpu_count() or 1
    reads = input_spans(args.inputs)
    fd = os.open(args.out, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, args.out_bytes)
    if args.write == "mmap":
        mapping = mmap.mmap(fd, args.out_bytes)
        target = torch.frombuffer(mapping, dtype=torch.uint8)

        def write_chunk(view, start, end):  # copy_ releases the GIL, so threads overlap
            target[start:end].copy_(torch.frombuffer(view, dtype=torch.uint8)[: end - start])
    else:

        def write_chunk(view, start, end):
            os.pwrite(fd, view[: end - start], start)

    writes_by_thread = [
        [(s, min(b, s + CHUNK)) for s in range(a, b, CHUNK)] for a, b in shares(args.out_bytes, threads)
    ]
    reads_by_thread = [reads[i::threads] for i in range(threads)]
    pool = [
        threading.Thread(target=worker, args=(r, w, write_chunk)) for r, w in zip(reads_by_thread, writes_by_thread)
    ]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if args.write == "mmap":
        del target
        mapping.flush()
        mapping.close()
    os.fsync(fd)
    os.close(fd)


if __name__ == "__main__":
    main()
