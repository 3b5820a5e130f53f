"""What a checkpoint's files hold, told from a few small reads: how the processes of one merge
(torchrun, or a process group) know that they read the same copy of the checkpoint, where size and
modification time agree for another node's disk or a stale sync as well.

Each kind of file gives what it already records about its own bytes:
* a torch.save archive (rank files, DeepSpeed and FSDP1 states, accelerate's .bin, Megatron's
  common.pt): the name, size and CRC-32 of every record, which torch.save computed over every
  byte and keeps in the zip directory (one read of the file's tail);
* DCP's `.metadata`, JSON files (configs, indexes, metadata.json), `latest`, and any file of at
  most 192 KiB: all its bytes;
* a safetensors file: its JSON header (every tensor's name, dtype, shape and offsets) and a sample;
* anything else (DCP's .distcp, whose archives only .metadata can find; a torch.save archive
  written without CRC-32s): a sample, the first and last 64 KiB and 16 blocks of 4 KiB evenly
  between them.
A sample misses a change that lies wholly outside it (bytes of a tensor smaller than a 17th of
its file); a different copy of a checkpoint (another step, another run) differs throughout.
"""

from __future__ import annotations

import hashlib
import os
import struct

from .._parsing.torch_zip import record_checksums
from ..errors import BadInput

_EDGE = 64 << 10  # sampled at each end of a file
_BLOCK, _BLOCKS = 4 << 10, 16  # sampled between the ends
_WHOLE = 3 * _EDGE  # files up to this size are read whole
_READ_WHOLE = (".metadata", "latest")  # small files the readers plan from, read whole whatever their size
_PLANNED_FROM = _READ_WHOLE + (".json",)  # beside the tensor files: what the planner read them with

WHAT = {  # what a fingerprint of each kind covers, for messages
    "bytes": "its bytes",
    "zip-crc32": "the CRC-32 values its zip directory records",
    "safetensors": "its header or a sample of its bytes",
    "sample": "a sample of its bytes",
}


def fingerprint(path: str) -> str:
    """`kind:digest` of the file at `path` (module doc); kind is a key of WHAT."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        name = os.path.basename(path)
        if size <= _WHOLE or name in _READ_WHOLE or name.endswith(".json"):
            return "bytes:" + _digest(_read(fd, 0, size))
        head = _read(fd, 0, 8)
        if head.startswith(b"PK\x03\x04"):
            records = _zip_records(fd, size, path)
            if records is not None:
                return "zip-crc32:" + _digest(records)
        if name.endswith(".safetensors"):
            (header_len,) = struct.unpack("<Q", head)
            if 8 + header_len <= size:
                return "safetensors:" + _digest(_read(fd, 8, header_len), _sample(fd, size))
        return "sample:" + _digest(_sample(fd, size))
    finally:
        os.close(fd)


def fingerprints(checkpoint: str, paths) -> dict[str, str]:
    """The fingerprint of each file, by its path as given (relative to `checkpoint`, or absolute)."""
    return {path: fingerprint(os.path.join(checkpoint, path)) for path in sorted(set(paths))}


def planned_from(checkpoint: str, paths) -> list[str]:
    """`paths` (the tensor files, as in the manifest) and the small files beside them, or in the
    checkpoint folder, that the readers plan from: .metadata, latest, JSON files."""
    found = set(paths)
    for folder in {os.path.dirname(path) for path in found} | {""}:
        where = os.path.join(checkpoint, folder)
        try:
            names = os.listdir(where)
        except OSError:
            continue
        found.update(
            os.path.join(folder, name)
            for name in names
            if name.endswith(_PLANNED_FROM) and os.path.isfile(os.path.join(where, name))
        )
    return sorted(found)


def first_difference(checkpoint: str, expected: dict[str, str]) -> tuple[str, str] | None:
    """(path, how it differs) of the first file under `checkpoint` whose fingerprint is not the one
    `expected` gives; None when all agree."""
    for path, wanted in expected.items():
        try:
            found = fingerprint(os.path.join(checkpoint, path))
        except (OSError, ValueError):  # ValueError: a path with a NUL byte
            return path, "it is not readable on this rank"
        if found != wanted:
            kind = wanted.split(":", 1)[0]
            return path, f"{WHAT.get(kind, 'its bytes')} differ from rank 0's copy"
    return None


def _zip_records(fd: int, size: int, path: str) -> bytes | None:
    """Every record's name, size and CRC-32; None if the directory cannot be read, or if the writer
    left the CRC-32s out (then they tell nothing)."""
    try:
        records = record_checksums(fd, size, path)
    except BadInput:
        return None
    if not any(crc for _, crc, record_size in records if record_size):
        return None
    return b"".join(name + b"\0" + struct.pack("<IQ", crc, record_size) for name, crc, record_size in records)


def _sample(fd: int, size: int) -> bytes:
    if size <= _WHOLE:
        return _read(fd, 0, size)
    between = size - 2 * _EDGE - _BLOCK
    blocks = [_read(fd, _EDGE + between * (i + 1) // (_BLOCKS + 1), _BLOCK) for i in range(_BLOCKS)]
    return b"".join([_read(fd, 0, _EDGE), *blocks, _read(fd, size - _EDGE, _EDGE)])


def _read(fd: int, offset: int, size: int) -> bytes:
    return os.pread(fd, size, offset) if size > 0 else b""


def _digest(*parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    return h.hexdigest()
