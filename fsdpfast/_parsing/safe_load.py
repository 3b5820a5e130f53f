"""The restricted unpickler: checkpoint pickles become inert records, never live objects.

Like torch.load(weights_only=True), only an allow-list of globals is accepted: tensor
rebuild functions, dtypes, torch.Size, the DTensor / DeviceMesh / placement classes and a
few plain containers. Unlike it, nothing is imported or constructed: each allowed global
maps to a stand-in here that records its arguments, tensors become `TensorRef`s that name
a storage record, and any other global (os.system, builtins.exec, a model class, ...) is
refused before anything runs. That is why reading a checkpoint's metadata needs neither
torch.distributed nor the bulk bytes.
"""

from __future__ import annotations

import collections
import io
import pickle
import reprlib
from dataclasses import dataclass, fields
from typing import Any

from ..dtypes import DTYPES
from ..errors import BadInput, UnsafeCheckpoint


def _refuse_state(self, state):
    """pickle's BUILD opcode writes pickled state into the object below it. Nothing fsdpfast hands
    the unpickler, and nothing it makes of what it reads, takes any: the Python unpickler refuses
    BUILD onto them before it gets here (_RestrictedUnpickler._load_build); the C unpickler, which
    reads plain pickles (see safe_unpickle), calls this and is refused the same way."""
    raise UnsafeCheckpoint(
        f"refusing to set the state of {getattr(self, 'qualname', type(self).__name__)!s}: only "
        "records and dicts take pickled state; fsdpfast does not let a checkpoint change its own objects"
    )


def _takes_no_state(cls):
    """A dataclass whose instances refuse pickled state (_refuse_state), and still copy and pickle
    (by their fields, never through __setstate__)."""
    cls.__setstate__ = _refuse_state
    cls.__reduce__ = lambda self: (type(self), tuple(getattr(self, f.name) for f in fields(self)))
    return cls


# The records a checkpoint's tensors become have slots: a planner holds one per tensor per rank.
@_takes_no_state
@dataclass(frozen=True, slots=True)
class StorageRef:
    key: str  # the zip record name under data/
    dtype: str
    numel: int


@_takes_no_state
@dataclass(frozen=True, slots=True)
class TensorRef:
    storage: StorageRef
    offset: int  # in elements of `dtype`
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


@_takes_no_state
@dataclass(frozen=True, slots=True)
class DTensorRef:
    local: TensorRef
    spec: Record  # DTensorSpec stand-in; geometry.placements interprets it
    # the size and stride the DTensor itself was pickled with (torch's wrapper subclass), which
    # its spec's tensor_meta must repeat (rank_files checks); None where no such size was read
    shape: tuple[int, ...] | None = None
    stride: tuple[int, ...] | None = None


@_takes_no_state
@dataclass(frozen=True)
class ShardedTensorRef:
    """A ShardedTensor (FSDP1 state dicts): global shape, dtype and its pickled state.

    `state` is ShardedTensor.__getstate__'s tuple: (local shards, ShardedTensorMetadata,
    ProcessGroupState, sharding spec, init_rrefs), as records; readers.fsdp1_flat reads it.
    """

    shape: tuple[int, ...]
    dtype: str
    state: tuple


class Record:
    """Stand-in for an allowed class: keeps constructor arguments and pickled state."""

    qualname = "Record"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args = args
        obj.state = {}
        obj.state_value = None
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.state.update(state)
        elif isinstance(state, tuple) and len(state) == 2 and any(isinstance(p, dict) for p in state):
            for part in state:  # (dict, slots) of slotted classes
                if isinstance(part, dict):
                    self.state.update(part)
        else:  # a class with its own __getstate__, e.g. a tuple of fields
            self.state_value = state

    def get(self, key: str, default: Any = None) -> Any:
        return self.state.get(key, default)

    @reprlib.recursive_repr()
    def __repr__(self) -> str:  # a crafted pickle can make a record contain itself
        return f"<{self.qualname} {self.args or ''}{self.state or ''}>"


class _DType(str):
    """A dtype global such as torch.float32, kept as its name."""

    __setstate__ = _refuse_state


class _StorageKind:
    __setstate__ = _refuse_state

    def __init__(self, dtype: str):
        self.dtype = dtype


class _TensorClass:
    __setstate__ = _refuse_state

    def __init__(self, qualname: str):
        self.qualname = qualname


class _Allowed:
    """An allowed function, as the unpickler gets it: an instance of a class of its own that calls
    it (no extra frame) and has no __dict__ or settable slots, so no pickled state can be written
    into it (a plain function has a __dict__ that BUILD would fill)."""

    __slots__ = ()
    __setstate__ = _refuse_state


def _allowed(function) -> _Allowed:
    name = getattr(function, "__qualname__", "function")
    cls = type(f"Allowed[{name}]", (_Allowed,), {"__slots__": (), "__call__": staticmethod(function), "qualname": name})
    return cls()


_DTENSOR = _TensorClass("DTensor")
_SHARDED_TENSOR = _TensorClass("ShardedTensor")
_PLAIN_TENSOR = _TensorClass("Tensor")

# DTensor and ShardedTensor metadata classes: any module under torch.distributed (they moved
# between releases).
_DISTRIBUTED_RECORDS = {
    "DTensorSpec",
    "TensorMeta",
    "ShardOrderEntry",
    "DeviceMesh",
    "_MeshLayout",
    "_FlatLayout",
    "Shard",
    "Replicate",
    "Partial",
    "_StridedShard",
    "_NormPartial",
    "_Partial",
    "_MaskPartial",
    "ShardMetadata",
    "ShardedTensorMetadata",
    "TensorProperties",
    "MEM_FORMAT_ENCODING",
    "_remote_device",
    "EnumerableShardingSpec",
    "ChunkShardingSpec",
}


@_takes_no_state
@dataclass
class _WrapperShell:
    cls: Any
    dtype: str
    shape: tuple[int, ...]
    stride: Any = None


def _tensor_ref(storage, storage_offset, size, stride, dtype: str) -> TensorRef:
    """A TensorRef whose fields are what the readers may assume: whole numbers, a storage record."""
    if not isinstance(storage, StorageRef):
        raise BadInput(f"a tensor's storage is {type(storage).__name__}, not a storage record")
    size, stride = as_dims(size), as_dims(stride)
    if size is None or stride is None or len(size) != len(stride) or not is_count(storage_offset):
        raise BadInput("a tensor's shape, strides or offset are not lists of whole numbers")
    return TensorRef(storage, storage_offset, size, stride, dtype)


def is_count(value) -> bool:
    """A whole number >= 0 (what sizes and offsets in checkpoint metadata must be)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def as_dims(value) -> tuple[int, ...] | None:
    """`value` as a tuple of whole numbers, or None if it is anything else. Equal results are one
    tuple (shapes and strides repeat across a checkpoint's tensors and ranks)."""
    if not isinstance(value, (tuple, list)):
        return None
    dims = tuple(value)
    if not _INT.issuperset(map(type, dims)) or (dims and min(dims) < 0):  # exact ints (no bools), none negative
        return None
    known = _DIMS.get(dims)
    if known is None:
        if len(_DIMS) >= _DIMS_KEPT:
            _DIMS.clear()
        known = _DIMS[dims] = dims
    return known


_INT = frozenset({int})
_DIMS: dict[tuple[int, ...], tuple[int, ...]] = {}
_DIMS_KEPT = 1 << 16


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    return _tensor_ref(storage, storage_offset, size, stride, getattr(storage, "dtype", None))


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    if isinstance(storage, StorageRef) and storage.dtype == "uint8" and dtype != "uint8":
        if dtype not in DTYPES:
            raise BadInput(f"tensor of dtype {dtype} is not supported")
        numel, spare = divmod(storage.numel, DTYPES[dtype][0])
        if spare:  # torch.save never writes it: a storage of whole elements
            raise _RecordError(
                f"storage record data/{storage.key} holds {storage.numel} bytes, not a whole number of "
                f"{dtype} elements ({DTYPES[dtype][0]} bytes each); the file is corrupt"
            )
        storage = StorageRef(storage.key, str(dtype), numel)
    return _tensor_ref(storage, storage_offset, size, stride, str(dtype))


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    return data


def _rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device, requires_grad):
    return _WrapperShell(cls, str(dtype), tuple(size), stride)


def _rebuild_from_type_v2(func, new_type, args, state):
    obj = func(*args)
    if isinstance(obj, _WrapperShell) and obj.cls is _SHARDED_TENSOR:
        if not isinstance(state, tuple) or len(state) < 2:
            raise BadInput("a ShardedTensor in this checkpoint lacks its local shards or metadata")
        return ShardedTensorRef(obj.shape, obj.dtype, state)
    if isinstance(state, tuple):  # (dict, slots) when the class has __slots__
        state = {k: v for part in state if isinstance(part, dict) for k, v in part.items()}
    if isinstance(obj, _WrapperShell) and obj.cls is _DTENSOR:
        local, spec = state.get("_local_tensor"), state.get("_spec")
        if not isinstance(local, TensorRef) or not isinstance(spec, Record):
            raise BadInput("a DTensor in this checkpoint lacks its local tensor or its spec")
        shape, stride = as_dims(obj.shape), as_dims(obj.stride)
        if shape is None or stride is None:
            raise BadInput(f"a DTensor in this checkpoint has size {obj.shape!r:.80} and stride {obj.stride!r:.80}")
        return DTensorRef(local, spec, shape, stride)
    if isinstance(obj, TensorRef) and new_type in (_PLAIN_TENSOR, _PARAMETER):
        return obj
    name = getattr(new_type, "qualname", new_type)
    raise BadInput(f"tensor subclass {name} is not supported; only plain tensors and DTensors are")


def _getattr(owner, name):
    # ShardedTensor pickles its ProcessGroupState as getattr(ShardedTensor, "ProcessGroupState");
    # getattr on anything else could reach live objects, so nothing else is allowed.
    if owner is _SHARDED_TENSOR and name == "ProcessGroupState":
        return _record_class("torch.distributed._shard.sharded_tensor.api.ShardedTensor.ProcessGroupState")
    raise UnsafeCheckpoint(f"getattr({getattr(owner, 'qualname', type(owner).__name__)}, {name!r}) is not allowed")


def _encode(text, encoding="latin1"):
    # pickle protocol 2 stores bytes as _codecs.encode(str, "latin1")
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise UnsafeCheckpoint("_codecs.encode called with unexpected arguments")
    return text.encode(encoding)


def _bytearray(data=b"", encoding=None):
    # pickle stores bytearrays as bytearray(bytes) or, below protocol 3, bytearray(str, "latin-1");
    # bytearray(10**10) would allocate whatever size the file asks for.
    if isinstance(data, str) and encoding in ("latin1", "latin-1"):
        return bytearray(data, encoding)
    if isinstance(data, (bytes, bytearray)) and encoding is None:
        return bytearray(data)
    raise UnsafeCheckpoint("builtins.bytearray called with unexpected arguments")


_PARAMETER = _TensorClass("Parameter")

_STORAGE_CLASSES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}

# What each allowed global is to the unpickler: types, stand-ins, and functions wrapped (_allowed).
_ALLOWED: dict[str, Any] = {
    "collections.OrderedDict": collections.OrderedDict,
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "builtins.complex": complex,
    "builtins.bytearray": _allowed(_bytearray),
    "_codecs.encode": _allowed(_encode),
    "torch.Size": _allowed(lambda dims=(): tuple(dims)),
    "torch.device": _allowed(lambda *args: str(args[0]) if args else "cpu"),
    "torch.serialization._get_layout": _allowed(lambda name: str(name)),
    "torch.Tensor": _PLAIN_TENSOR,
    "torch.nn.parameter.Parameter": _PARAMETER,
    "torch._utils._rebuild_tensor_v2": _allowed(_rebuild_tensor_v2),
    "torch._utils._rebuild_tensor_v3": _allowed(_rebuild_tensor_v3),
    "torch._utils._rebuild_parameter": _allowed(_rebuild_parameter),
    "torch._utils._rebuild_parameter_with_state": _allowed(_rebuild_parameter),
    "torch._utils._rebuild_wrapper_subclass": _allowed(_rebuild_wrapper_subclass),
    "torch._tensor._rebuild_from_type_v2": _allowed(_rebuild_from_type_v2),
    "torch.storage.UntypedStorage": _StorageKind("uint8"),
    "torch.distributed.tensor.DTensor": _DTENSOR,
    "torch.distributed.tensor._api.DTensor": _DTENSOR,
    "torch.distributed._tensor.api.DTensor": _DTENSOR,
    "torch.distributed._shard.sharded_tensor.api.ShardedTensor": _SHARDED_TENSOR,
    "builtins.getattr": _allowed(_getattr),
    "__builtin__.getattr": _allowed(_getattr),  # protocol 2 names builtins this way
}
_ALLOWED.update({f"torch.{name}": _StorageKind(dtype) for name, dtype in _STORAGE_CLASSES.items()})
_ALLOWED.update(
    {f"torch.{name}": _DType(name) for name in [*DTYPES, "complex128", "float8_e4m3fnuz", "float8_e5m2fnuz"]}
)

_RECORD_CLASSES: dict[str, type] = {}


def _record_class(qualname: str) -> type:
    if qualname not in _RECORD_CLASSES:
        _RECORD_CLASSES[qualname] = type(qualname.rsplit(".", 1)[-1], (Record,), {"qualname": qualname})
    return _RECORD_CLASSES[qualname]


class _RestrictedUnpickler(pickle._Unpickler):
    """pickle's Python implementation, on purpose: its memo is a dict. The C unpickler grows its
    memo array to twice the largest index a PUT opcode names, so five bytes of a crafted file
    make it allocate and clear tens of GB. Checkpoint pickles are small; the cost is a few ms."""

    def __init__(self, data: bytes, where: str, extra_records: frozenset[str], check_records: bool = True):
        super().__init__(io.BytesIO(data))
        self.where = where
        self.extra_records = extra_records
        self.storages: dict[str, StorageRef] | None = {} if check_records else None

    def find_class(self, module: str, name: str):
        qualname = f"{module}.{name}"
        if qualname in _ALLOWED:
            return _ALLOWED[qualname]
        if module.startswith("torch.distributed.") and name in _DISTRIBUTED_RECORDS:
            return _record_class(qualname)
        if qualname in self.extra_records:
            return _record_class(qualname)
        raise UnsafeCheckpoint(
            f"{self.where}: refusing to unpickle '{qualname}': a checkpoint of tensors never needs it "
            "and it could run code; fsdpfast does not execute code from checkpoints"
        )

    def _load_build(self):
        # BUILD writes pickled state into the object below it (its __dict__, or setattr). That
        # object may be a module-level stand-in shared by every later read (a storage kind, a
        # record class): a crafted pickle could make every bfloat16 storage read as float16.
        # Only fresh records and the state dict (torch pickles `_metadata` onto it) take state.
        if len(self.stack) >= 2 and not isinstance(self.stack[-2], (Record, dict)):
            target = self.stack[-2]
            raise UnsafeCheckpoint(
                f"{self.where}: refusing to set the state of "
                f"{getattr(target, 'qualname', type(target).__name__)!s}: only records and dicts "
                "take pickled state; fsdpfast does not let a checkpoint change its own objects"
            )
        pickle._Unpickler.load_build(self)

    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: _load_build}

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")):
            raise UnsafeCheckpoint(f"{self.where}: unexpected persistent id {pid!r}")
        _, kind, key, _location, numel = pid
        if not isinstance(kind, _StorageKind):
            raise UnsafeCheckpoint(f"{self.where}: persistent id names {kind!r}, not a storage class")
        key = key.decode() if isinstance(key, bytes) else str(key)
        if not is_count(numel):
            raise BadInput(f"{self.where}: storage {key!r} has size {numel!r}, not a whole number")
        storage = StorageRef(key, kind.dtype, numel)
        if self.storages is not None:
            check_same_storage(self.storages.setdefault(key, storage), storage, self.where)
        return storage


class _PlainUnpickler(pickle.Unpickler):
    """CPython's C unpickler, for pickles the native scan finds plain (see safe_unpickle): the same
    allow-list and persistent ids as _RestrictedUnpickler; BUILD onto anything but a record or a
    dict is refused by the objects themselves (_refuse_state)."""

    def __init__(self, data: bytes, where: str, extra_records: frozenset[str], check_records: bool = True):
        super().__init__(io.BytesIO(data))
        self.where = where
        self.extra_records = extra_records
        self.storages: dict[str, StorageRef] | None = {} if check_records else None

    find_class = _RestrictedUnpickler.find_class
    persistent_load = _RestrictedUnpickler.persistent_load


def _plain(data: bytes) -> bool:
    """Whether the C unpickler may read `data`: fsdpfast._native scans it (csrc/pickle_scan.h) for
    opcodes CPython's pickler writes and memo slots written in order, so its memo cannot be made to
    outgrow the pickle. Without the native module, never."""
    from .. import _ops

    native = _ops.native() if _ops.native_cpu() else None
    scan = getattr(native, "pickle_not_plain", None)
    return scan is not None and scan(data) is None


def safe_unpickle(
    data: bytes, where: str, extra_records: frozenset[str] = frozenset(), check_records: bool = True
) -> Any:
    """Unpickle `data` (a checkpoint's data.pkl) into plain containers and inert records.

    `extra_records`: further fully qualified class names a reader accepts as inert records.
    `check_records`: refuse records that disagree with themselves, as torch.load does: one storage
    record named with two dtypes or sizes, a tensor reaching past its storage (check_records). Only
    pickle_twins' probes, pickles it rewrites with made-up numbers to see where they land, skip it.
    A plain pickle (every one torch writes) is read by the C unpickler, four times faster; any
    other, and any pickle the C unpickler fails on, by the Python one, whose answer (or message)
    is the one given: the two read plain pickles alike (tests/trust/test_fuzz.py compares them).
    """
    if _plain(data):
        try:
            return _load(_PlainUnpickler, data, where, extra_records, check_records)
        except Exception:  # noqa: S110  (the Python unpickler says what is wrong, in its words)
            pass
    return _load(_RestrictedUnpickler, data, where, extra_records, check_records)


def _load(unpickler, data: bytes, where: str, extra_records: frozenset[str], check_records: bool = True) -> Any:
    try:
        value = unpickler(data, where, extra_records, check_records).load()
    except _RecordError as exc:  # raised by a stand-in, which does not know the file
        raise BadInput(f"{where}: {exc}") from None
    except (UnsafeCheckpoint, BadInput):
        raise
    except RecursionError:
        raise BadInput(f"{where}: the pickle nests too deeply to be a checkpoint") from None
    except Exception as exc:  # malformed pickles raise many kinds of errors
        raise BadInput(f"{where}: the pickle is damaged ({type(exc).__name__}: {exc}); the file is corrupt") from None
    try:
        _check_value(value, check_records)  # readers and messages walk what they read recursively
    except _RecordError as exc:
        raise BadInput(f"{where}: {exc}") from None
    return value


_MAX_DEPTH = 100  # a DTensor in an optimizer state in a dict nests about 10 levels


class _RecordError(BadInput):
    """A record that disagrees with itself, found where the file's name is not known."""


def check_same_storage(first: StorageRef, again: StorageRef, where: str) -> None:
    """Two references to one storage record must agree: torch.load reads the record once, with the
    first one's dtype and size, and gives every later tensor on it that dtype, whatever it names."""
    # torch.save skips its one-dtype-per-storage check for a storage of no bytes (a null data pointer)
    if (again.dtype, again.numel) != (first.dtype, first.numel) and (first.numel, again.numel) != (0, 0):
        raise BadInput(
            f"{where}: storage record data/{first.key} is named as {first.numel} {first.dtype} elements "
            f"and as {again.numel} {again.dtype} elements; torch.save names a storage one way; the file is corrupt"
        )


def check_fits_storage(tensor: TensorRef) -> None:
    """torch.load's check (Tensor.set_): the last element a tensor's offset, shape and strides reach
    lies in its storage. A tensor of no elements reaches none, wherever its offset is."""
    if 0 in tensor.shape:
        return
    end = tensor.offset + 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride))
    if end > tensor.storage.numel:
        raise _RecordError(
            f"a {tensor.dtype} tensor of shape {list(tensor.shape)}, strides {list(tensor.stride)} and offset "
            f"{tensor.offset} reaches element {end} of storage record data/{tensor.storage.key}, which holds "
            f"{tensor.storage.numel}; the file is corrupt"
        )


def each_object(value: Any):
    """Every object under `value` (through dict values, lists, tuples and records), each once:
    a pickle may share containers, so walking them as a tree could never end."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, Record):
            stack.extend([*item.args, *item.state.values(), item.state_value])


def _check_value(value: Any, check_records: bool) -> None:
    """Nesting deeper than _MAX_DEPTH through any path (a dict's attributes too: torch pickles the
    state dict's `_metadata` onto it), and (check_records) every tensor against its storage.
    Iteratively, each container once (pickles can share and even cycle through containers)."""
    seen: set[int] = set()
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Record):
            children = [*item.args, *item.state.keys(), *item.state.values(), item.state_value]
        elif isinstance(item, dict):
            children = [*item.keys(), *item.values(), *getattr(item, "__dict__", {}).values()]
        elif isinstance(item, (list, tuple, set, frozenset)):
            children = item
        elif isinstance(item, DTensorRef):
            children = [item.local, item.spec]
        elif isinstance(item, ShardedTensorRef):
            children = [item.shape, item.state]
        elif isinstance(item, _WrapperShell):
            children = list(vars(item).values())
        else:
            continue
        if id(item) in seen:
            continue
        seen.add(id(item))
        if depth >= _MAX_DEPTH:
            raise _RecordError(f"the pickle nests more than {_MAX_DEPTH} levels deep; not a checkpoint")
        depth += 1
        for child in children:
            if type(child) is TensorRef:
                if check_records:
                    check_fits_storage(child)
            elif not isinstance(child, _LEAVES):
                stack.append((child, depth))


_LEAVES = (int, float, str, bytes, type(None), StorageRef)  # nothing below them to walk
