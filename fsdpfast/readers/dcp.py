"""PyTorch Distributed Checkpoint folders: `.metadata` plus `__{rank}_{i}.distcp` files.

`.metadata` (read with the restricted unpickler, metadata classes only) lists every tensor's
global shape, dtype and chunks (offsets and sizes in the global tensor), and which .distcp
file holds each chunk. A .distcp file comes in one of two serialisations:
- torch.save (the default): the chunk's byte range is a complete torch.save archive, whose
  storage record is located in place;
- safetensors (FileSystemWriter(serialization_format=SAFETENSORS)): a safetensors file whose
  header names each chunk by its flattened name.
Either way the engine maps the chunk's bytes straight from the .distcp file.

A nested state dict ({"model": ..., "optim": ...}) is flattened by DCP with "." and recorded
in planner_data; the model part is picked automatically, or by `prefix`.

The model's config.json (and tokenizer, processor files) is taken from huggingface/ in the
folder, else from the folder itself, beside .metadata.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import re
import reprlib
from dataclasses import dataclass
from math import prod

from .._parsing.safe_load import Record, TensorRef, as_dims, is_count, safe_unpickle
from .._parsing.safetensors_header import SafetensorsHeader, looks_like_safetensors, read_header, stored_tensor
from .._parsing.torch_zip import TorchZip
from ..dtypes import DTYPES, itemsize
from ..errors import BadInput, UnsafeCheckpoint, option, out_of_files
from ..geometry.boxes import box_extents
from ..plan.model import MergePlan, SourceBuffer, TensorPlan
from .discover import check_not_broken_link
from .framework_folders import in_or_beside
from .megatron_folder import is_torch_dist
from .reader import Reader, ReaderOption

NAME = "dcp"
DESCRIPTION = ".metadata + __{r}_{i}.distcp: torch.distributed.checkpoint folders"
_METADATA_CLASSES = frozenset(
    {
        *(
            f"torch.distributed.checkpoint.metadata.{name}"
            for name in (
                "Metadata",
                "TensorStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "BytesStorageMetadata",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        # Megatron-Core's planner keeps every rank's save plan in .metadata (all_local_plans); not read
        *(
            f"torch.distributed.checkpoint.planner.{name}"
            for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
        ),
        "pathlib.PosixPath",
        "pathlib.WindowsPath",
        "pathlib.PurePosixPath",
    }
)
_MODEL_PREFIXES = ("model", "module", "state_dict")
_RANK_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")


def matches(folder: str) -> bool:
    # a Megatron-Core torch_dist folder is a DCP folder too; readers.megatron reads it under its own names
    return (
        os.path.isfile(os.path.join(folder, ".metadata"))
        and bool(glob.glob(os.path.join(folder, "*.distcp")))
        and not is_torch_dist(folder)
    )


@dataclass(frozen=True)
class _Entry:
    """A tensor's entry in .metadata, its structure checked: global shape, dtype, and each chunk's box."""

    shape: tuple[int, ...]
    dtype: str
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]  # (offsets, sizes) in the global tensor


@dataclass(frozen=True)
class _Metadata:
    tensors: dict[str, _Entry]  # by flat name
    entries: list[str]  # flat names of every entry, tensors or not (bytes, objects), in order
    storage: dict[tuple[str, tuple[int, ...]], Record]  # (flat name, chunk offsets) -> its file range (_StorageInfo)
    paths: dict[str, tuple]  # flat name of a tensor -> its path in the nested state dict (planner_data)
    referenced: frozenset[str]  # the files the storage entries name (relative paths)
    tops: dict[str, str]  # flat name of every entry -> its top-level key in the state dict


def read(folder: str, prefix: str | None = None) -> MergePlan:
    metadata = _parse(_read_metadata(os.path.join(folder, ".metadata")), folder)
    names = _model_names(metadata.paths, prefix, folder)
    sources: list[SourceBuffer] = []
    headers: dict[str, SafetensorsHeader | None] = {}
    archives = _archives(folder, metadata, names, headers)  # where every chunk is, checked, before any file is read
    tensors = []
    for flat_name, name in names.items():
        tensors.append(
            _plan_tensor(
                folder, flat_name, name, metadata.tensors[flat_name], metadata.storage, sources, headers, archives
            )
        )
    skipped = [k for k in metadata.entries if k not in names]
    plan = MergePlan(NAME, len(_ranks(metadata.referenced)) or 1, sources, tensors)
    nested = any(len(path) > 1 for path in metadata.paths.values())
    if prefix is None and nested and all(len(metadata.paths[k]) == 1 for k in names):
        parts = list(dict.fromkeys(metadata.tops[k] for k in skipped))
        plan = plan.noted(
            f"the model: the {len(names)} tensors at the top level of the state dict (as torchtitan saves "
            f"it); not merged: {', '.join(parts)} (--prefix picks a nested part instead)"
        )
    if skipped:
        plan = plan.noted(
            f"not merged: {len(skipped)} other entries ({', '.join(skipped[:3])}{', ...' if len(skipped) > 3 else ''})"
        )
    stale = sorted(f for f in os.listdir(folder) if f.endswith(".distcp") and f not in metadata.referenced)
    if stale:  # a leftover of an earlier save into the folder: not part of this checkpoint
        plan = plan.noted(
            f"not read: {len(stale)} .distcp files that .metadata does not reference "
            f"({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}); the world size counts only the referenced ones"
        )
    plan = plan.but(config_dir=in_or_beside(folder))
    return plan


def archive_windows(folder: str) -> dict[str, list[tuple[int, int]]]:
    """Each data file's byte windows (offset, length) that .metadata places a chunk in, by path: what
    a planner must see of the data files besides their names (remote.metadata_mirror)."""
    path = os.path.join(folder, ".metadata")
    if not os.path.isfile(path):
        return {}
    windows: dict[str, list[tuple[int, int]]] = {}
    for (fqn, _), info in _storage_index(_read_metadata(path), path).items():
        file, offset, length = _file_range(folder, fqn, info)
        windows.setdefault(file, []).append((offset, length))
    return windows


def _ranks(files: frozenset[str]) -> set[int]:
    """The ranks that wrote these files (`__{rank}_{i}.distcp`), or one per file if named otherwise."""
    found = {_RANK_FILE.fullmatch(os.path.basename(f)) for f in files}
    return {int(m.group(1)) for m in found if m} if all(found) else set(files)


def _read_metadata(path: str) -> Record:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise BadInput(f"{path}: unreadable ({exc.strerror})") from None
    metadata = safe_unpickle(data, path, _METADATA_CLASSES)
    if not isinstance(metadata, Record) or not metadata.qualname.endswith(".Metadata"):
        raise BadInput(f"{path}: not a torch.distributed.checkpoint Metadata object")
    return metadata


def _parse(metadata: Record, folder: str) -> _Metadata:
    """The structure of .metadata as plain, checked values; any other structure is refused in one line."""
    try:
        return _parse_structure(metadata, f"{folder}/.metadata")
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError) as exc:
        # .metadata is a pickle: any object can sit where torch writes a list of ints or a record.
        # The parser checks what torch always writes; this catches what slips past it, and only here.
        raise BadInput(
            f"{folder}/.metadata: does not have the structure torch.distributed.checkpoint writes "
            f"({type(exc).__name__}: {str(exc)[:200]}); the file is damaged"
        ) from None


def _parse_structure(metadata: Record, where: str) -> _Metadata:
    entries = _mapping(metadata.get("state_dict_metadata"), "state_dict_metadata", where)
    planner_data = _mapping(metadata.get("planner_data"), "planner_data", where)
    tensors = {}
    for flat_name, entry in entries.items():
        if not isinstance(flat_name, str):
            raise BadInput(f"{where}: an entry is named {reprlib.repr(flat_name)}, not a string; the file is damaged")
        if isinstance(entry, Record) and entry.qualname.endswith("TensorStorageMetadata"):
            tensors[flat_name] = _tensor_entry(flat_name, entry, where)
    paths = {}
    for flat_name in tensors:
        path = planner_data.get(flat_name, (flat_name,))
        if not isinstance(path, (tuple, list)) or not all(isinstance(part, (str, int)) for part in path):
            raise BadInput(
                f"{where}: the planner_data path of {flat_name} is {reprlib.repr(path)}, not a list of keys; the file is damaged"
            )
        paths[flat_name] = tuple(path)
    storage = _storage_index(metadata, where)
    referenced = frozenset(str(info.args[0] if info.args else info.get("relative_path")) for info in storage.values())
    tops = {}
    for flat_name in entries:
        path = planner_data.get(flat_name)
        tops[flat_name] = str(path[0]) if isinstance(path, (tuple, list)) and path else str(flat_name)
    return _Metadata(tensors, list(entries), storage, paths, referenced, tops)


def _mapping(value, field: str, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadInput(f"{where}: {field} is a {type(value).__name__}, not a mapping; the file is damaged")
    return value


def _tensor_entry(flat_name: str, entry: Record, where: str) -> _Entry:
    size = entry.get("size")
    shape = as_dims(size if size is not None else ())
    if shape is None:
        raise BadInput(f"{where}: {flat_name} has shape {reprlib.repr(size)}, not a list of whole numbers")
    chunks = entry.get("chunks") or ()
    if not isinstance(chunks, (list, tuple)):
        raise BadInput(
            f"{where}: the chunks of {flat_name} are a {type(chunks).__name__}, not a list; the file is damaged"
        )
    boxes = []
    for chunk in chunks:
        raw = (chunk.get("offsets"), chunk.get("sizes")) if isinstance(chunk, Record) else (None, None)
        offsets, sizes = as_dims(raw[0]), as_dims(raw[1])
        if offsets is None or sizes is None or not len(offsets) == len(sizes) == len(shape):
            raise BadInput(
                f"{where}: a chunk of {flat_name} has offsets {reprlib.repr(raw[0])} and sizes "
                f"{reprlib.repr(raw[1])}, which do not fit its shape {list(shape)}"
            )
        boxes.append((offsets, sizes))
    return _Entry(shape, _dtype(entry.get("properties")), boxes)


def _storage_index(metadata: Record, where: str) -> dict[tuple[str, tuple[int, ...]], Record]:
    """(flat name, chunk offsets) -> where that chunk's bytes are (_StorageInfo)."""
    index = {}
    for key, info in _mapping(metadata.get("storage_data"), "storage_data", where).items():
        if not isinstance(key, Record):
            raise BadInput(f"{where}: a storage key is {reprlib.repr(key)}, not a MetadataIndex; the file is damaged")
        fqn, offset = key.args[:2] if len(key.args) >= 2 else (key.get("fqn"), key.get("offset"))
        offsets = as_dims(offset if offset is not None else ())
        if not isinstance(fqn, str) or offsets is None:
            raise BadInput(
                f"{where}: a storage key names {reprlib.repr(fqn)} at {reprlib.repr(offset)}; the file is damaged"
            )
        if not isinstance(info, Record):
            raise BadInput(f"{where}: storage entry of {fqn} is not a file range")
        index[(fqn, offsets)] = info
    return index


def _model_names(paths: dict[str, tuple], prefix: str | None, folder: str) -> dict[str, str]:
    """Flat DCP names of the model's tensors -> their names in the model's state dict."""
    tops = {path[0] for path in paths.values() if len(path) > 1}
    if prefix is None and not tops:
        return {k: k for k in paths}  # a flat model state dict
    if prefix is None:
        candidates = [p for p in _MODEL_PREFIXES if p in tops]
        top_level = {k: str(path[0]) for k, path in paths.items() if len(path) == 1}
        if not candidates and top_level:
            # torchtitan's resumable checkpoints: the model's tensors at the top level, beside
            # `optimizer`, `lr_scheduler`, `dataloader` and `train_state`
            return top_level
        if len(candidates) != 1:
            raise BadInput(
                f"{folder}: the checkpoint nests {sorted(map(str, tops))}; choose the model part with {option('prefix')}"
            )
        prefix = candidates[0]
    chosen = {
        k: ".".join(str(part) for part in path[1:]) for k, path in paths.items() if len(path) > 1 and path[0] == prefix
    }
    if not chosen:
        raise BadInput(
            f"{folder}: no tensors under {option('prefix', prefix)} (the checkpoint holds {sorted(map(str, tops)) or 'a flat state dict'})"
        )
    return chosen


@dataclass(frozen=True)
class Chunk:
    """One saved chunk of a tensor: the box it fills in the global tensor, and where its
    row-major elements are (a source buffer and the element offset of its first element)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    source: int
    element_offset: int


@dataclass(frozen=True)
class ChunkedTensor:
    """A tensor of a DCP folder as its chunks, for readers that place it differently (readers.megatron)."""

    name: str  # flat name
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class ChunkedFolder:
    tensors: dict[str, ChunkedTensor]  # by flat name
    others: list[str]  # flat names of the entries that are not tensors (bytes, objects)
    sources: list[SourceBuffer]
    world_size: int  # ranks that wrote the files .metadata references


def read_chunks(folder: str) -> ChunkedFolder:
    """Every tensor of a flat DCP state dict as its chunks, located in place; no placement done."""
    metadata = _parse(_read_metadata(os.path.join(folder, ".metadata")), folder)
    sources: list[SourceBuffer] = []
    headers: dict[str, SafetensorsHeader | None] = {}
    archives = _archives(folder, metadata, metadata.tensors, headers)
    tensors = {
        name: ChunkedTensor(
            name,
            entry.shape,
            entry.dtype,
            tuple(_chunks(folder, name, entry, metadata.storage, sources, headers, archives)),
        )
        for name, entry in metadata.tensors.items()
    }
    others = [k for k in metadata.entries if k not in metadata.tensors]
    return ChunkedFolder(tensors, others, sources, len(_ranks(metadata.referenced)) or 1)


def _archives(folder: str, metadata, names, headers) -> _Chunks:
    """Where every chunk of `names` is, checked, then the torch.save archives among them read (each once)."""
    archives = _Chunks(folder)
    for flat_name in names:
        for offsets, _ in metadata.tensors[flat_name].chunks:
            info = metadata.storage.get((flat_name, offsets))
            if info is not None:
                archives.place(flat_name, info, headers)
    archives.read_archives(headers)
    return archives


def _chunks(
    folder, flat_name: str, entry: _Entry, storage, sources: list[SourceBuffer], headers, archives: _Chunks
) -> list[Chunk]:
    if entry.dtype not in DTYPES:
        raise BadInput(f"{folder}/.metadata: {flat_name} has dtype {entry.dtype}, which is not supported")
    chunks = []
    for offsets, sizes in entry.chunks:
        info = storage.get((flat_name, offsets))
        if info is None:
            raise BadInput(f"{folder}/.metadata: no file holds the chunk of {flat_name} at {list(offsets)}")
        source, element_offset = _chunk_source(folder, flat_name, info, entry.dtype, sizes, sources, headers, archives)
        chunks.append(Chunk(offsets, sizes, source, element_offset))
    return chunks


def _plan_tensor(
    folder, flat_name: str, name: str, entry: _Entry, storage, sources: list[SourceBuffer], headers, archives: _Chunks
) -> TensorPlan:
    shape, dtype = entry.shape, entry.dtype
    extents = []
    for chunk in _chunks(folder, flat_name, entry, storage, sources, headers, archives):
        extents += box_extents(chunk.source, chunk.element_offset, shape, chunk.offsets, chunk.sizes)
    if sum(e.numel for e in extents) != prod(shape):
        raise BadInput(
            f"{folder}: the chunks of {flat_name} cover {sum(e.numel for e in extents)} of its {prod(shape)} elements"
        )
    return TensorPlan(name, shape, dtype, dtype, extents)


def _dtype(properties) -> str:
    """TensorProperties pickles its fields as a tuple (dtype first) in current torch, as a dict before."""
    if not isinstance(properties, Record):
        return "None"
    if properties.get("dtype") is not None:
        return str(properties.get("dtype"))
    value = properties.state_value
    return str(value[0]) if isinstance(value, tuple) and value else "None"


def _file_range(folder, flat_name, info: Record) -> tuple[str, int, int]:
    """(path, offset, length) of one chunk's bytes, as .metadata places them, checked."""
    relative, offset, length = (
        info.args[:3] if len(info.args) >= 3 else (info.get("relative_path"), info.get("offset"), info.get("length"))
    )
    if info.get("transform_descriptors"):
        raise BadInput(
            f"{folder}: {flat_name} was saved with transforms {reprlib.repr(info.get('transform_descriptors'))}; "
            "not supported yet"
        )
    if not isinstance(relative, str) or not is_count(offset) or not is_count(length):
        # (reprlib: a pickle can nest a value deeper than repr can walk)
        raise BadInput(
            f"{folder}/.metadata: the file range of {flat_name} is {', '.join(map(reprlib.repr, (relative, offset, length)))}"
        )
    path = _inside(folder, relative)
    if path is None:
        # else a crafted .metadata could copy any readable file (a key, a password file) into the output
        raise UnsafeCheckpoint(
            f"{folder}/.metadata: places {flat_name} in {relative!r}, outside the checkpoint folder; refused"
        )
    return path, int(offset), int(length)


@functools.lru_cache(maxsize=4096)  # every chunk of a file names it: checked once
def _inside(folder: str, relative: str) -> str | None:
    """folder/relative, or None if `relative` leads outside the folder."""
    if os.path.isabs(relative) or os.path.normpath(relative).split(os.sep)[0] == "..":
        return None
    return os.path.join(folder, relative)


class _Chunks:
    """The torch.save archives of a folder's chunks, each read once: the chunks of one .distcp file
    together, through one descriptor (one file open at a time, whatever the world size), and each
    distinct pickle unpickled once (a chunk's pickle says only its shape, dtype and storage, so the
    chunks of one shape share theirs)."""

    def __init__(self, folder: str):
        self.folder = folder
        self.files: dict[str, dict[tuple[int, int], str]] = {}  # path -> {(offset, length): a tensor it holds}
        self.read: dict[
            tuple[str, int, int], tuple
        ] = {}  # (path, offset, length) -> (TensorRef, byte offset, byte length, where)

    def place(self, flat_name: str, info: Record, headers) -> None:
        path, offset, length = _file_range(self.folder, flat_name, info)
        if path not in headers:
            check_not_broken_link(path)
            if not os.path.isfile(path):
                raise BadInput(f"{path} is missing: .metadata places {flat_name} in it")
            headers[path] = read_header(path) if looks_like_safetensors(path) else None
        if headers[path] is None:
            self.files.setdefault(path, {}).setdefault((offset, length), flat_name)

    def read_archives(self, headers) -> None:
        pickles: dict[bytes, object] = {}
        for path, ranges in self.files.items():
            with _opened(path) as fd:
                size = os.fstat(fd).st_size
                for (offset, length), flat_name in sorted(ranges.items()):
                    archive = TorchZip(path, offset, length, fd=fd, file_size=size)
                    data = archive.pickle_bytes
                    tensor = pickles.get(data)
                    if tensor is None:
                        tensor = pickles[data] = safe_unpickle(data, archive.where)
                    if not isinstance(tensor, TensorRef):
                        raise BadInput(
                            f"{archive.where}: holds {type(tensor).__name__}, not the tensor chunk of {flat_name}"
                        )
                    byte_offset, byte_length = archive.storage_bytes(tensor.storage)
                    self.read[(path, offset, length)] = (tensor, byte_offset, byte_length, archive.where)


@contextlib.contextmanager
def _opened(path: str):
    """The file's descriptor while its chunks are read (small reads: a mapping would map and fault in
    the 64 KB around every chunk's header)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise out_of_files(exc, path) or BadInput(f"{path}: unreadable ({exc.strerror or exc})") from None
    try:
        yield fd
    finally:
        os.close(fd)


def _chunk_source(
    folder, flat_name, info: Record, dtype: str, sizes, sources: list[SourceBuffer], headers, chunks: _Chunks
) -> tuple[int, int]:
    """The source buffer holding one chunk's elements (in place in the .distcp file) and its element offset."""
    path, offset, length = _file_range(folder, flat_name, info)
    if headers[path] is not None:  # every chunk was placed (and its file read) before the tensors are planned
        return _safetensors_chunk(headers[path], flat_name, dtype, sizes, sources), 0
    tensor, byte_offset, byte_length, where = chunks.read[(path, offset, length)]
    if tensor.dtype != dtype or tuple(tensor.shape) != tuple(sizes) or not tensor.is_contiguous():
        raise BadInput(
            f"{where}: chunk of {flat_name} is {tensor.dtype}{list(tensor.shape)}, .metadata says {dtype}{list(sizes)}"
        )
    if (tensor.offset + prod(sizes)) * itemsize(dtype) > byte_length:
        raise BadInput(f"{path}: the chunk of {flat_name} runs past its storage; the file is corrupt")
    sources.append(SourceBuffer(path, byte_offset, byte_length, dtype))
    return len(sources) - 1, tensor.offset


def _safetensors_chunk(
    header: SafetensorsHeader, flat_name: str, dtype: str, sizes, sources: list[SourceBuffer]
) -> int:
    if flat_name not in header.entries:
        raise BadInput(f"{header.path}: holds no tensor {flat_name}, which .metadata places there")
    stored = stored_tensor(header, flat_name)
    if stored.dtype != dtype or stored.shape != tuple(sizes):
        raise BadInput(
            f"{header.path}: {flat_name} is {stored.dtype}{list(stored.shape)}, .metadata says {dtype}{list(sizes)}"
        )
    sources.append(SourceBuffer(header.path, stored.byte_offset, stored.nbytes, dtype))
    return len(sources) - 1


READER = Reader(
    NAME,
    DESCRIPTION,
    sniff=matches,
    read=read,
    options=(ReaderOption("prefix", "the part of a nested state dict that is the model (default: found)"),),
)
