"""Read a `torch.save` zip archive without loading its tensors.

torch.save writes an uncompressed zip: `<archive>/data.pkl` (the pickled object, tensors
as persistent ids naming storage records), `<archive>/data/<key>` (each storage's raw
bytes, aligned) and `<archive>/byteorder`. We read the pickle and the byte position of every
storage record, and leave the bulk bytes for the engine to map.

Everything is read when the archive is opened, in two or three reads, and the file is closed
again at once: a planner reading a thousand rank files never holds more than one of them open.
* The zip directory (end record and central directory) comes from the file's tail, in one read.
* The central directory gives each record's local header offset and size but not where its
  data starts: that depends on the local header's extra field, which torch.save fills with
  padding so that the data starts at the archive's storage alignment (64 bytes unless
  `.storage_alignment` says otherwise). Records follow each other with no gap: local header,
  data, a data descriptor. So each record's data start is computed twice, from the alignment
  rule and from where the next record (or the central directory) begins, and taken only when
  the two agree; a record where they do not (another writer) has its local header read, as zip
  readers do. The local headers of data.pkl and the small records after it are read with it,
  and checked, in one read.
"""

from __future__ import annotations

import os
import struct
from array import array

from ..dtypes import DTYPES, itemsize
from ..errors import BadInput, out_of_files
from ..plan.model import SourceBuffer

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")  # a central directory entry, before its name
_LOCAL = struct.Struct("<4s2B4HL2L2H")  # a local file header, before its name
_EOCD_MAGIC, _ZIP64_LOCATOR_MAGIC, _ZIP64_EOCD_MAGIC = b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06"
_CENTRAL_MAGIC, _LOCAL_MAGIC = b"PK\x01\x02", b"PK\x03\x04"
_MAX32 = 0xFFFFFFFF
_TAIL = 1 << 16  # read from the end at once: the end records and, for most files, the central directory
_WINDOW_TAIL = 4096  # the same in a window of a file (a DCP chunk's archive: a few records)
_HEAD_SLACK = 4096  # read past data.pkl, to take the small records after it (byteorder, ...) in the same read
_DEFAULT_ALIGNMENT = 64


class _Record:
    """A zip record as the central directory lists it (offsets relative to the archive)."""

    __slots__ = ("name", "header", "size", "flags", "method", "name_len", "start", "bound")

    def __init__(self, name: str, header: int, size: int, flags: int, method: int, name_len: int):
        self.name, self.header, self.size, self.flags, self.method, self.name_len = (
            name,
            header,
            size,
            flags,
            method,
            name_len,
        )
        self.start = -1  # where its data starts, once known
        self.bound = 0  # where the next record (or the zip directory) starts


class TorchZip:
    """A torch.save archive: a whole file, or the window [base, base + length) of one.

    `fd`: the file, already open, to read from (DCP reads many archives from one .distcp file; the
    caller closes it), and `file_size` its size. Else the file is opened and closed before the constructor returns. Either
    way `pickle_bytes` and every storage record's span stay available (`close()` drops the pickle)."""

    def __init__(
        self, path: str, base: int = 0, length: int | None = None, fd: int | None = None, file_size: int | None = None
    ):
        self.path = path
        self.base = base
        self.where = path if length is None else f"{path} (bytes {base}..{base + length})"
        self._fd = fd
        self._own = fd is None
        self._tail, self._tail_start = b"", 1 << 62
        self.pickle_bytes: bytes | None = None
        try:
            if self._own:
                self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            self.file_size = os.fstat(self._fd).st_size if file_size is None else file_size
            self.size = self.file_size - base if length is None else length
            if base < 0 or self.size < 0 or base + self.size > self.file_size:
                raise BadInput(f"{self.where}: runs past the end of the file; the file is truncated")
            self._open()
        except OSError as exc:
            raise out_of_files(exc, path) or BadInput(f"{self.where}: unreadable ({exc.strerror or exc})") from None
        except (struct.error, ValueError, OverflowError, IndexError) as exc:
            raise BadInput(
                f"{self.where}: not a readable torch.save archive ({type(exc).__name__}: {exc}; "
                "the file is truncated or corrupt)"
            ) from None
        finally:
            self._close_file()

    # --- reading ---------------------------------------------------------------------------

    def _read(self, offset: int, size: int) -> bytes:
        """Bytes [offset, offset + size) of the archive (fewer at its end)."""
        size = max(0, min(size, self.size - offset))
        if offset < 0 or size == 0:
            return b""
        if self._tail_start <= offset:  # small files: everything is in the tail read first
            return self._tail[offset - self._tail_start : offset - self._tail_start + size]
        return os.pread(self._fd, size, self.base + offset)

    def _open(self) -> None:
        tail_start = max(0, self.size - (_TAIL if self._own else _WINDOW_TAIL))
        tail = self._read(tail_start, self.size - tail_start)
        self._tail, self._tail_start = tail, tail_start
        if len(tail) < _EOCD.size:
            raise BadInput(f"{self.where}: not a readable torch.save archive ({self._not_zip()})")
        count, cd_size, cd_offset, end = self._end_record(tail, tail_start)
        if cd_offset + cd_size > end:
            raise BadInput(
                f"{self.where}: not a readable torch.save archive (the zip directory lies past its end "
                "record; the file is truncated or corrupt)"
            )
        if cd_offset >= tail_start:
            directory = tail[cd_offset - tail_start : cd_offset - tail_start + cd_size]
        else:
            directory = self._read(cd_offset, cd_size)
        self._records = self._central_directory(directory, count, cd_offset)
        pickles = [r for r in self._records.values() if r.name.endswith("/data.pkl") or r.name == "data.pkl"]
        if len(pickles) != 1:
            raise BadInput(f"{self.where}: a zip file but not a torch.save archive (no single data.pkl inside)")
        self.prefix = pickles[0].name[: -len("data.pkl")]
        self._place_records(pickles[0], cd_offset)
        self._keep_storages()
        self._records = None

    def _keep_storages(self) -> None:
        """What is kept once read: where each storage record's data lies. torch.save numbers its
        storages 0, 1, 2, ...: then two arrays indexed by the number (16 bytes a record; a planner
        holds a thousand files' worth); otherwise (start, size, method) by key."""
        prefix = self.prefix + "data/"
        cut = len(prefix)
        found = {name[cut:]: record for name, record in self._records.items() if name.startswith(prefix)}
        numbered = [found.get(str(i)) for i in range(len(found))]  # all of them, if their keys are 0, 1, 2, ...
        if all(record is not None and record.method == 0 for record in numbered):
            self._starts = array("q", [record.start for record in numbered])
            self._sizes = array("q", [record.size for record in numbered])
            self._storages = None
        else:
            self._storages = {key: (record.start, record.size, record.method) for key, record in found.items()}

    def _end_record(self, tail: bytes, tail_start: int) -> tuple[int, int, int, int]:
        return end_record(tail, tail_start, self.where, self._not_zip)

    def _central_directory(self, directory: bytes, count: int, cd_offset: int) -> dict[str, _Record]:
        records: dict[str, _Record] = {}
        at = 0
        for _ in range(count):
            fields = _CENTRAL.unpack_from(directory, at)
            if fields[0] != _CENTRAL_MAGIC:
                raise BadInput(
                    f"{self.where}: not a readable torch.save archive (damaged zip directory; the file is "
                    "truncated or corrupt)"
                )
            flags, method, csize, size = fields[5], fields[6], fields[10], fields[11]
            name_len, extra_len, comment_len, header = fields[12], fields[13], fields[14], fields[18]
            name_at = at + _CENTRAL.size
            raw = directory[name_at : name_at + name_len]
            at = name_at + name_len + extra_len + comment_len
            if len(raw) != name_len or at > len(directory):
                raise BadInput(
                    f"{self.where}: not a readable torch.save archive (the zip directory is cut short; the "
                    "file is truncated or corrupt)"
                )
            if csize == _MAX32 or size == _MAX32 or header == _MAX32:
                extra = directory[name_at + name_len : name_at + name_len + extra_len]
                size, csize, header = _zip64_values(extra, size, csize, header)
            try:
                name = raw.decode("utf-8" if flags & 0x800 else "cp437")
            except UnicodeDecodeError:
                raise BadInput(
                    f"{self.where}: a record name in the zip directory is not UTF-8; the file is corrupt"
                ) from None
            if name in records:
                raise BadInput(f"{self.where}: two records named {name!r}; the file is corrupt")
            if flags & 0x1 or (method == 0 and csize != size):
                method = -1  # encrypted, or sizes that disagree: refused if the record is used
            if header + _LOCAL.size + name_len > cd_offset:
                raise BadInput(f"{self.where}: record {name!r} starts past the zip directory; the file is corrupt")
            records[name] = _Record(name, header, csize, flags, method, name_len)
        return records

    def _place_records(self, pickle: _Record, cd_offset: int) -> None:
        """Find where every record's data starts (see the module doc), and read data.pkl."""
        ordered = sorted(self._records.values(), key=lambda r: r.header)
        for record, after in zip(ordered, ordered[1:]):
            record.bound = after.header
        ordered[-1].bound = cd_offset
        # data.pkl and the small records after it (.format_version, .storage_alignment, byteorder): one read
        head_end = min(pickle.bound + _HEAD_SLACK, cd_offset)
        head = self._read(pickle.header, head_end - pickle.header)
        for record in ordered:
            if pickle.header <= record.header and record.header + _LOCAL.size <= head_end:
                local = head[record.header - pickle.header : record.header - pickle.header + _LOCAL.size]
                self._from_local_header(record, local, record.bound)
        self._check_stored(pickle)
        if pickle.start < 0:
            self._from_local_header(pickle, self._read(pickle.header, _LOCAL.size), pickle.bound)
        if pickle.start + pickle.size > head_end:  # a long local extra field: not torch's
            head_end = pickle.start + pickle.size
            head = self._read(pickle.header, head_end - pickle.header)
        self.pickle_bytes = head[pickle.start - pickle.header : pickle.start - pickle.header + pickle.size]
        small = {}
        for key in ("byteorder", ".storage_alignment"):
            record = self._records.get(self.prefix + key)
            if record is not None and record.size <= 64:  # a few bytes in any torch.save archive
                if record.start >= 0 and record.start + record.size <= head_end:
                    small[key] = head[record.start - pickle.header : record.start - pickle.header + record.size]
                else:
                    self._locate(record)
                    small[key] = self._read(record.start, record.size)
        byteorder = small.get("byteorder")
        if byteorder is not None and byteorder.strip() != b"little":
            raise BadInput(
                f"{self.where}: stored big-endian ({byteorder!r}); only little-endian checkpoints are supported"
            )
        alignment = small.get(".storage_alignment", b"").strip()
        alignment = int(alignment) if alignment.isdigit() and 0 < int(alignment) <= 1 << 20 else _DEFAULT_ALIGNMENT
        for record in ordered:
            if record.start < 0:
                self._locate(record, alignment)

    def _locate(self, record: _Record, alignment: int = _DEFAULT_ALIGNMENT) -> None:
        """Where the record's data starts: torch's alignment rule, if the next record begins right
        after the data and its descriptor (16 or 24 bytes where the flags announce one); else from
        its local header."""
        start = _aligned_start(record, alignment)
        gap = record.bound - start - record.size
        if gap == 16 or gap == 24 if record.flags & 0x8 else gap == 0:
            record.start = start
            return
        self._from_local_header(record, self._read(record.header, _LOCAL.size), record.bound)

    def _from_local_header(self, record: _Record, local: bytes, bound: int) -> None:
        if len(local) != _LOCAL.size or local[:4] != _LOCAL_MAGIC:
            raise BadInput(f"{self.where}: zip header of {record.name!r} is damaged; the file is corrupt")
        fields = _LOCAL.unpack(local)
        if fields[10] != record.name_len:
            raise BadInput(
                f"{self.where}: zip header of {record.name!r} disagrees with the zip directory; the file is corrupt"
            )
        start = record.header + _LOCAL.size + fields[10] + fields[11]
        if start + record.size > bound:
            raise BadInput(f"{self.where}: record {record.name!r} runs past the end of the file; the file is truncated")
        record.start = start

    def _check_stored(self, record: _Record) -> None:
        if record.method != 0:  # torch.save never compresses (and no zip bombs)
            raise BadInput(
                f"{self.where}: record {record.name!r} is compressed, encrypted or damaged; torch.save never "
                "writes that"
            )

    def _close_file(self) -> None:
        if self._fd is not None and self._own:
            os.close(self._fd)
        self._fd = None
        self._tail = b""

    def _not_zip(self) -> str:
        head = self._read(0, 2)
        if not head:
            return "the file is empty"
        if head[:1] == b"\x80":
            return "a legacy torch.save pickle; re-save it with a torch of 1.6 or newer"
        return "no zip end record; the file is truncated or corrupt"

    # --- what the readers ask ----------------------------------------------------------------

    def close(self) -> None:
        """Drop the pickle's bytes (the file itself was closed when the archive was read)."""
        self.pickle_bytes = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def storage_span(self, key: str) -> tuple[int, int]:
        """(byte offset in the file, byte length) of storage record `key`."""
        if self._storages is None:  # numbered 0, 1, 2, ... (see _keep_storages)
            i = int(key) if key.isascii() and key.isdigit() and (key == "0" or key[0] != "0") else -1
            record = (self._starts[i], self._sizes[i], 0) if 0 <= i < len(self._starts) else None
        else:
            record = self._storages.get(key)
        if record is None or record[2] != 0:
            name = f"{self.prefix}data/{key}"
            if record is None:
                raise BadInput(
                    f"{self.where}: storage record {name!r} named by the pickle is missing; the file is corrupt"
                )
            raise BadInput(f"{self.where}: storage record {name!r} is compressed; torch.save never does that")
        return self.base + record[0], record[1]

    def storage_buffer(self, storage) -> SourceBuffer:
        """The bytes of `storage` (a safe_load.StorageRef), in place in this file, for the engine to map."""
        return SourceBuffer(self.path, *self.storage_bytes(storage), storage.dtype)

    def storage_bytes(self, storage) -> tuple[int, int]:
        """(byte offset in the file, byte length) of the bytes `storage` holds, checked against its record
        as torch.load checks it: the record holds exactly the storage's elements, no byte more or less."""
        if storage.dtype not in DTYPES:
            raise BadInput(f"{self.where}: dtype {storage.dtype} is not supported")
        offset, length = self.storage_span(storage.key)
        nbytes = storage.numel * itemsize(storage.dtype)
        if length != nbytes:
            raise BadInput(
                f"{self.where}: storage record {self.prefix}data/{storage.key} holds {length} bytes, the pickle "
                f"says {storage.numel} {storage.dtype} elements ({nbytes} bytes); the file is corrupt"
            )
        return offset, nbytes


def _aligned_start(record: _Record, alignment: int) -> int:
    """Where torch.save puts a record's data: after the local header, its name and an extra field of
    at least 4 bytes (its zip64 sizes first where they overflow 32 bits), at the next multiple of
    the alignment."""
    start = record.header + _LOCAL.size + record.name_len + 4
    if record.size >= _MAX32 or record.header >= _MAX32:
        start += 4 + (16 if record.size >= _MAX32 else 0) + (8 if record.header >= _MAX32 else 0)
    return -(-start // alignment) * alignment


def _zip64_values(extra: bytes, size: int, csize: int, header: int) -> tuple[int, int, int]:
    """The 64-bit sizes and offset a zip64 extra field holds for the fields set to 0xFFFFFFFF."""
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, at)
        if tag == 1:
            values = list(struct.unpack_from(f"<{length // 8}Q", extra, at + 4))
            if size == _MAX32:
                size = values.pop(0)
            if csize == _MAX32:
                csize = values.pop(0)
            if header == _MAX32:
                header = values.pop(0)
            return size, csize, header
        at += 4 + length
    raise ValueError("zip64 sizes without their extra field")


def end_record(
    tail: bytes, tail_start: int, where: str, not_zip=lambda: "no zip end record"
) -> tuple[int, int, int, int]:
    """(entries, directory size, directory offset, where the end records begin)."""
    at = len(tail) - _EOCD.size
    if tail[at : at + 4] != _EOCD_MAGIC:  # torch writes no archive comment; others may
        at = tail.rfind(_EOCD_MAGIC, max(0, len(tail) - _EOCD.size - 0xFFFF))
        if at < 0:
            raise BadInput(f"{where}: not a readable torch.save archive ({not_zip()})")
    fields = _EOCD.unpack_from(tail, at)
    count, cd_size, cd_offset = fields[4], fields[5], fields[6]
    end = tail_start + at
    locator = at - _ZIP64_LOCATOR.size
    if locator >= 0 and tail[locator : locator + 4] == _ZIP64_LOCATOR_MAGIC:
        record = locator - _ZIP64_EOCD.size  # the zip64 end record sits right before its locator
        if record < 0 or tail[record : record + 4] != _ZIP64_EOCD_MAGIC:
            raise BadInput(
                f"{where}: not a readable torch.save archive (damaged zip64 end record; "
                "the file is truncated or corrupt)"
            )
        zip64 = _ZIP64_EOCD.unpack_from(tail, record)
        count, cd_size, cd_offset = zip64[7], zip64[8], zip64[9]
        end = tail_start + record
    elif _MAX32 in (cd_size, cd_offset) or count == 0xFFFF:
        raise BadInput(
            f"{where}: not a readable torch.save archive (zip64 sizes without a zip64 end record; "
            "the file is truncated or corrupt)"
        )
    return count, cd_size, cd_offset, end


def record_checksums(fd: int, file_size: int, where: str) -> list[tuple[bytes, int, int]]:
    """(name, CRC-32, size) of every record of the torch.save archives that make up the open file
    `fd`: one (torch.save) or several end to end (DCP's .distcp: one a tensor), from the last to
    the first. Each archive's zip directory, read from its tail, says what its records' bytes are,
    as torch.save recorded them, and where the archive begins: the end of the one before. Reads
    nothing else. BadInput if the file is not such archives, first byte to last."""
    records: list[tuple[bytes, int, int]] = []
    end = file_size
    while end > 0:
        tail_start = max(0, end - (_TAIL if end == file_size else _WINDOW_TAIL))
        tail = os.pread(fd, end - tail_start, tail_start)
        if len(tail) < _EOCD.size or tail[-_EOCD.size : -_EOCD.size + 4] != _EOCD_MAGIC:
            raise BadInput(f"{where}: no zip end record at byte {end}")
        count, cd_size, cd_offset, directory_end = end_record(tail, tail_start, where)
        start = directory_end - cd_size - cd_offset  # the archive's first byte: its offsets count from there
        if start < 0 or cd_offset < 0:
            raise BadInput(f"{where}: a zip directory that points before the file")
        at_file = start + cd_offset
        if at_file >= tail_start:
            directory = tail[at_file - tail_start : at_file - tail_start + cd_size]
        else:
            directory = os.pread(fd, cd_size, at_file)
        records += _directory_checksums(directory, count, where)
        end = start
    return records


def _directory_checksums(directory: bytes, count: int, where: str) -> list[tuple[bytes, int, int]]:
    records, at = [], 0
    for _ in range(count):
        if at + _CENTRAL.size > len(directory):
            raise BadInput(f"{where}: the zip directory is cut short")
        fields = _CENTRAL.unpack_from(directory, at)
        if fields[0] != _CENTRAL_MAGIC:
            raise BadInput(f"{where}: damaged zip directory")
        crc, csize, size, name_len, extra_len, comment_len = fields[9], fields[10], fields[11], *fields[12:15]
        name_at = at + _CENTRAL.size
        if size == _MAX32 or csize == _MAX32:
            try:
                extra = directory[name_at + name_len : name_at + name_len + extra_len]
                size, _, _ = _zip64_values(extra, size, csize, 0)
            except (ValueError, struct.error):
                raise BadInput(f"{where}: damaged zip64 sizes") from None
        records.append((directory[name_at : name_at + name_len], crc, size))
        at = name_at + name_len + extra_len + comment_len
    if at != len(directory):
        raise BadInput(f"{where}: the zip directory holds more than its entries")
    return records
