"""Rank files of one checkpoint pickle the same program: read the first fully, the others as changes.

Every rank of an FSDP2 checkpoint saves the same state dict built the same way, so their data.pkl
files are the same sequence of opcodes, memo slots and class names; they differ in a few numbers
and strings: the rank and mesh coordinate, hashes, the local shapes of the last ranks. Unpickling
a thousand of them costs more than planning everything else. So `Twins.load` compares each pickle
with one already read (natively, opcode by opcode: fsdpfast._native.pickle_value_changes) and,
where only such values differ, makes the new file's object from the one read, with the new values
in their places, instead of unpickling it.

Where each value lands is learned by reading the first pickle twice more with other values in
those opcodes (a probe): every object field the probe changes is that value's place, and a second
probe with other values, rebuilt the same way, must give exactly what unpickling it gives. Values
that land nowhere (a device name) are left out. A value that is computed on rather than kept, a
change of structure, a rebuilt field that fails the unpickler's own checks, a pickle that is not
plain: the file is unpickled in full, as always (safe_load.safe_unpickle); so the result is always
what unpickling the file gives, tests/stages/test_pickle_twins.py checks it for every rank of real
checkpoints, and fuzz_parsers' twins target on mutated ones.
"""

from __future__ import annotations

import struct
from typing import Any

from ..errors import FsdpfastError
from .safe_load import (
    DTensorRef,
    Record,
    StorageRef,
    TensorRef,
    _plain,
    _tensor_ref,
    as_dims,
    check_fits_storage,
    is_count,
    safe_unpickle,
)

_KEPT = 4  # references kept: rank numbers past 255 (and 65535) pickle wider, a hash may pickle a byte shorter
_LEAF = (int, float, str, bytes, bool, type(None))
_DIRTY_SETS_KEPT = 64  # per reference; rank files usually change one set of objects
# The fields of the records a tensor becomes, in their constructors' order.
_REF_FIELDS = {kind: tuple(kind.__dataclass_fields__) for kind in (StorageRef, TensorRef, DTensorRef)}


class Twins:
    """Reads the pickles of one checkpoint's rank files (see the module doc)."""

    def __init__(self, extra_records: frozenset[str] = frozenset()):
        self.extra_records = extra_records
        self._references: list[_Reference] = []
        # opcodes whose value could not be carried over, by pickle length (one program): a later
        # reference of the same program would learn the same again, an unpickling per file more
        self._unusable: dict[int, set[int]] = {}

    def load(self, data: bytes, where: str) -> Any:
        changes_of = _native_changes()
        if changes_of is not None:
            for reference in self._references:
                changes = changes_of(reference.data, data)
                if changes is not None:
                    value = reference.variant(data, changes, where)
                    if value is not None:
                        reference.uses += 1
                        self._references.sort(key=_most_used)  # stable: the older of two as used first
                        return value
        value = safe_unpickle(data, where, self.extra_records)
        if changes_of is not None and _plain(data):
            if len(self._references) >= _KEPT:
                # The least used goes, the oldest of those: never the one most files are read from
                # for a run of files of other structures (each with one of its DTensors' hashes a
                # byte shorter, as one hash in 256 is), each kept in case more are like it.
                self._references.remove(min(self._references, key=_uses))
            self._references.append(
                _Reference(data, value, self.extra_records, where, self._unusable.setdefault(len(data), set()))
            )
        return value


def _most_used(reference: _Reference) -> int:
    return -reference.uses


def _uses(reference: _Reference) -> int:
    return reference.uses


def _native_changes():
    from .. import _ops

    return getattr(_ops.native(), "pickle_value_changes", None) if _ops.native_cpu() else None


class _Unusable(Exception):
    """This change cannot be carried over: unpickle the file instead."""


class _Reference:
    """A pickle read in full, what it gave, and where its values land in it."""

    def __init__(self, data: bytes, value: Any, extra_records: frozenset[str], where: str, unusable: set[int]):
        self.data, self.value, self.extra_records, self.where = data, value, extra_records, where
        # opcode offset -> where its value is kept: [(object, field, index in the field's tuple or None)]
        self.places: dict[int, list[tuple[Any, tuple, int | None]]] = {}
        self.unusable = unusable  # shared by the references of one program (see Twins)
        self._parents: dict[int, list[tuple[Any, tuple]]] | None = None
        self._dirty_sets: dict[frozenset[int], frozenset[int]] = {}  # see _dirty
        self._storages: dict[str, tuple[int, str, int]] | None = None  # see _storages_agree
        self.uses = 0  # files read as its variants

    def variant(self, data: bytes, changes: list[int], where: str) -> Any | None:
        """What unpickling `data` gives, made from this reference; None where it cannot be."""
        try:
            new = [t for t in changes if t not in self.places and t not in self.unusable]
            if new:
                self._learn(new)
            if any(t in self.unusable for t in changes):
                return None
            updates = []
            for t in changes:
                value = _decode(data, t)
                updates += [(*place, value) for place in self.places[t]]
            return self._rebuilt(updates)
        except (_Unusable, FsdpfastError, ValueError, TypeError, RecursionError):
            return None

    # --- learning where values land ----------------------------------------------------------

    def _learn(self, tokens: list[int]) -> None:
        try:
            first = self._probe(tokens, 0)
            places: dict[int, list[tuple[Any, tuple, int | None]]] = {t: [] for t in tokens}
            for holder, field, index, value in first.changed:
                token = first.token_of.get((type(value), value))
                if token is None:  # computed from a value, not kept: cannot be carried over
                    raise _Unusable
                places[token].append((holder, field, index))
            second = self._probe(tokens, 1)
            updates = [(*place, second.values[t]) for t, found in places.items() for place in found]
            if not _same(self._rebuilt(updates, checked=False), second.result):
                raise _Unusable
        except (_Unusable, FsdpfastError, ValueError, TypeError, RecursionError):
            self.unusable.update(tokens)
            return
        self.places.update(places)

    def _probe(self, tokens: list[int], round_: int) -> _Probe:
        """The reference's pickle with new values in `tokens`, unpickled, and what changed."""
        probe = bytearray(self.data)
        values, token_of = {}, {}
        counters: dict[int, int] = {}
        for t in tokens:
            value = _probe_value(self.data, t, counters, round_)
            _encode_into(probe, t, value)
            values[t] = value
            token_of[(type(value), value)] = t
        if len(token_of) != len(tokens):
            raise _Unusable
        # made-up numbers need not make sense together (a shape past its storage): unchecked
        result = safe_unpickle(bytes(probe), self.where, self.extra_records, check_records=False)
        changed: list[tuple[Any, tuple, int | None, Any]] = []
        _differences(self.value, result, changed, set())
        return _Probe(values, token_of, result, changed)

    def _parents_of(self) -> dict[int, list[tuple[Any, tuple]]]:
        if self._parents is None:
            self._parents = _parents(self.value)
        return self._parents

    # --- making a variant ----------------------------------------------------------------------

    def _rebuilt(self, updates: list[tuple[Any, tuple, int | None, Any]], checked: bool = True) -> Any:
        """The reference's value with each (object, field, index, value) update made: new objects
        for the updated ones and every object holding them, the rest shared. `checked`: each new
        record checked as the unpickler checks it (safe_load's check_records), else _Unusable."""
        parents = self._parents_of()
        changed: dict[int, dict[tuple, Any]] = {}
        for holder, field, index, value in updates:
            own = changed.setdefault(id(holder), {})
            if index is None:
                own[field] = value
            else:  # an element of a tuple of numbers or strings (a shape, a mesh coordinate)
                old = own.get(field, _field(holder, field))
                own[field] = old[:index] + (value,) + old[index + 1 :]
        remake = _Remake(changed, self._dirty(frozenset(changed), parents), checked)
        value = remake.of(self.value)
        if checked and remake.storages and not self._storages_agree(remake.storages):
            raise _Unusable  # unpickled in full, the file is refused in the unpickler's words
        return value

    def _storages_agree(self, made: list[StorageRef]) -> bool:
        """Whether the storage records a variant remade agree with every other reference to their
        storage in it (safe_load.check_same_storage): the reference's own agree, so a storage named
        by more references than were remade keeps the reference's dtype and size."""
        if self._storages is None:
            self._storages = _storages_by_key(self.value)
        seen: dict[str, list] = {}
        for storage in made:
            seen.setdefault(storage.key, []).append(storage)
        for key, remade in seen.items():
            count, dtype, numel = self._storages[key]
            if len({(s.dtype, s.numel) for s in remade} | ({(dtype, numel)} if len(remade) < count else set())) > 1:
                return False
        return True

    def _dirty(self, changed: frozenset[int], parents) -> frozenset[int]:
        """The objects changed and every object holding one (ids): the same for each variant that
        changes the same objects (a checkpoint's rank files change the same mesh record), so kept."""
        dirty = self._dirty_sets.get(changed)
        if dirty is None:
            found, stack = set(changed), list(changed)
            while stack:
                for parent, _ in parents.get(stack.pop(), ()):
                    if id(parent) not in found:
                        found.add(id(parent))
                        stack.append(id(parent))
            dirty = frozenset(found)
            if len(self._dirty_sets) < _DIRTY_SETS_KEPT:
                self._dirty_sets[changed] = dirty
        return dirty


class _Remake:
    """One variant's new objects: each dirty object (an updated one, or one holding a dirty one)
    copied once, with its `changed` fields set; the rest shared with the reference. (A class, not a
    closure naming itself: that is a cycle, which would keep every variant until the garbage
    collector runs, and it is paused while planning.)"""

    __slots__ = ("changed", "checked", "dirty", "made", "storages")

    def __init__(self, changed: dict[int, dict[tuple, Any]], dirty: frozenset[int], checked: bool):
        self.changed, self.dirty, self.made, self.checked = changed, dirty, {}, checked
        self.storages: list[StorageRef] = []  # the storage records remade

    def of(self, obj):
        """`obj` in the variant."""
        if id(obj) not in self.dirty:
            return obj
        new = self.made.get(id(obj))
        if new is None:
            new = self.made[id(obj)] = _copy_with(obj, self.changed.get(id(obj)), self)
        return new


class _Probe:
    def __init__(self, values, token_of, result, changed):
        self.values, self.token_of, self.result, self.changed = values, token_of, result, changed


# --- the opcodes whose values differ between rank files --------------------------------------


def _decode(data: bytes, at: int):
    op = data[at]
    if op == 0x4B:  # BININT1
        return data[at + 1]
    if op == 0x4D:  # BININT2
        return int.from_bytes(data[at + 1 : at + 3], "little")
    if op == 0x4A:  # BININT
        return int.from_bytes(data[at + 1 : at + 5], "little", signed=True)
    if op == 0x8A:  # LONG1
        return int.from_bytes(data[at + 2 : at + 2 + data[at + 1]], "little", signed=True)
    if op == 0x58:  # BINUNICODE
        size = struct.unpack_from("<I", data, at + 1)[0]
        return data[at + 5 : at + 5 + size].decode("utf-8", "surrogatepass")
    if op == 0x8C:  # SHORT_BINUNICODE
        return data[at + 2 : at + 2 + data[at + 1]].decode("utf-8", "surrogatepass")
    raise _Unusable


def _encode_into(data: bytearray, at: int, value) -> None:
    """Write `value` into the opcode at `at` (same opcode, same argument length)."""
    op = data[at]
    if op == 0x4B:
        data[at + 1] = value
    elif op == 0x4D:
        data[at + 1 : at + 3] = value.to_bytes(2, "little")
    elif op == 0x4A:
        data[at + 1 : at + 5] = value.to_bytes(4, "little", signed=True)
    elif op == 0x8A:
        size = data[at + 1]
        data[at + 2 : at + 2 + size] = value.to_bytes(size, "little", signed=True)
    elif op == 0x58:
        encoded = value.encode()
        data[at + 5 : at + 5 + len(encoded)] = encoded
    elif op == 0x8C:
        encoded = value.encode()
        data[at + 2 : at + 2 + len(encoded)] = encoded
    else:
        raise _Unusable


_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _probe_value(data: bytes, at: int, counters: dict[int, int], round_: int):
    """A probe value for the opcode at `at`: of its width, unlike the reference's, and unlike every
    other value of this probe (each width counts through a range of its own, apart from the
    others; the two rounds count from different ends)."""
    old = _decode(data, at)
    op = data[at]
    kind = 0x58 if isinstance(old, str) else op
    limit = {0x4B: 1 << 8, 0x4D: 1 << 16, 0x4A: 1 << 31}.get(op, 1 << max(0, 8 * data[at + 1] - 1) if op == 0x8A else 0)
    while True:
        k = counters[kind] = counters.get(kind, 0) + 1
        if isinstance(old, str):
            width, code, value = len(old.encode()), k if round_ == 0 else k * 7 + 3, ""
            while code or len(value) < width:
                code, digit = divmod(code, len(_DIGITS))
                value += _DIGITS[digit]
            if len(value) > width:
                raise _Unusable
        elif op == 0x4B:  # one byte: 1, 2, ... or 255, 254, ...
            value = k if round_ == 0 else 256 - k
            if not 0 < value < limit:
                raise _Unusable
        else:  # wider numbers: above 255, far apart
            value = {0x4D: 256, 0x4A: 1 << 20}.get(op, 1 << 33) + (257 if op == 0x4D else 7919) * (2 * k + round_)
            if value >= limit:
                raise _Unusable
        if value != old:
            return value


# --- walking what a pickle gave ---------------------------------------------------------------


def _children(obj):
    """(field, child) of every object a container holds, fields naming how to put it back."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield ("item", key), value
        for name, value in getattr(obj, "__dict__", {}).items():
            yield ("attr", name), value
    elif type(obj) in (list, tuple):
        for i, value in enumerate(obj):
            yield ("index", i), value
    elif isinstance(obj, Record):
        for i, value in enumerate(obj.args):
            yield ("args", i), value
        for key, value in obj.state.items():
            yield ("state", key), value
        yield ("state_value",), obj.state_value
    elif isinstance(obj, (TensorRef, StorageRef, DTensorRef)):
        for name in _REF_FIELDS[type(obj)]:
            yield ("field", name), getattr(obj, name)


def _is_container(obj) -> bool:
    """Objects walked into. A tuple of numbers and strings is a value (a shape, a coordinate):
    equal shapes are one tuple (safe_load.as_dims), which must not tie their tensors together."""
    if isinstance(obj, (dict, Record, TensorRef, StorageRef, DTensorRef)) or type(obj) is list:
        return True
    return type(obj) is tuple and not all(isinstance(item, _LEAF) for item in obj)


def _field(holder, field):
    """The child `field` names in `holder` (see _children)."""
    kind = field[0]
    if kind == "item":
        return holder[field[1]]
    if kind == "attr":
        return holder.__dict__[field[1]]
    if kind == "index":
        return holder[field[1]]
    if kind == "args":
        return holder.args[field[1]]
    if kind == "state":
        return holder.state[field[1]]
    if kind == "state_value":
        return holder.state_value
    return getattr(holder, field[1])


def _parents(value) -> dict[int, list[tuple[Any, tuple]]]:
    """id(object) -> [(container, field)] over the whole value; a cycle cannot be rebuilt."""
    parents: dict[int, list[tuple[Any, tuple]]] = {}
    state: dict[int, int] = {}  # 1: being walked, 2: done
    stack = [(value, False)]
    while stack:
        obj, leaving = stack.pop()
        if leaving:
            state[id(obj)] = 2
            continue
        if state.get(id(obj)) == 2:
            continue
        state[id(obj)] = 1
        stack.append((obj, True))
        for field, child in _children(obj):
            if _is_container(child):
                parents.setdefault(id(child), []).append((obj, field))
                if state.get(id(child)) == 1:
                    raise _Unusable  # a cycle
                if id(child) not in state:
                    stack.append((child, False))
    return parents


def _storages_by_key(value) -> dict[str, tuple[int, str, int]]:
    """Storage key -> (how many storage records name it, their dtype, their size) in `value`."""
    found: dict[str, tuple[int, str, int]] = {}
    seen: set[int] = set()
    stack = [value]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if type(obj) is StorageRef:
            count = found.get(obj.key, (0,))[0]
            found[obj.key] = (count + 1, obj.dtype, obj.numel)
        stack.extend(child for _, child in _children(obj) if _is_container(child))
    return found


def _differences(a, b, out: list, seen: set) -> None:
    """Into `out`, (container in a, field, index in the field's tuple or None, value in b) of every
    number or string that differs; _Unusable where the two differ in structure."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if (id(x), id(y)) in seen:
            continue
        seen.add((id(x), id(y)))
        if type(x) is not type(y):
            raise _Unusable
        if not _is_container(x):
            if x != y and not (x != x and y != y):
                raise _Unusable  # a leaf outside any container changed
            continue
        if isinstance(x, Record) and x.qualname != y.qualname:
            raise _Unusable
        fields_x, fields_y = list(_children(x)), list(_children(y))
        if [f for f, _ in fields_x] != [f for f, _ in fields_y]:
            raise _Unusable  # other keys: a value became a key, or the structure differs
        for (field, cx), (_, cy) in zip(fields_x, fields_y):
            if _is_container(cx):
                stack.append((cx, cy))
            elif type(cx) is not type(cy):
                raise _Unusable
            elif type(cx) is tuple:
                if len(cx) != len(cy):
                    raise _Unusable
                for index, (ex, ey) in enumerate(zip(cx, cy)):
                    if type(ex) is not type(ey):
                        raise _Unusable
                    if ex != ey and not (ex != ex and ey != ey):
                        out.append((x, field, index, ey))
            elif cx != cy and not (cx != cx and cy != cy):
                out.append((x, field, None, cy))


def _copy_with(obj, own: dict[tuple, Any] | None, remake: _Remake):
    """A copy of container `obj` with the fields in `own` set to their new values and every other
    child as it is in the variant (remake.of), checked as the unpickler checks what it makes.
    (Written out per kind: a variant copies a few hundred objects, a thousand variants a plan.)"""
    dirty, of = remake.dirty, remake.of
    if type(obj) is DTensorRef and not own:  # most of a variant (its spec's mesh changed): the refs' branch, unrolled
        local, spec = obj.local, obj.spec
        local = of(local) if id(local) in dirty else local
        spec = of(spec) if id(spec) in dirty else spec
        if not isinstance(local, TensorRef) or not isinstance(spec, Record):
            raise _Unusable
        return DTensorRef(local, spec, obj.shape, obj.stride)
    if isinstance(obj, dict):
        new = type(obj)()
        for key, value in obj.items():
            new[key] = of(value) if id(value) in dirty else value
        for name, value in getattr(obj, "__dict__", {}).items():
            new.__dict__[name] = of(value) if id(value) in dirty else value
        for (kind, name), value in (own or {}).items():
            (new if kind == "item" else new.__dict__)[name] = value
        return new
    if type(obj) is list or type(obj) is tuple:
        items = [of(value) if id(value) in dirty else value for value in obj]
        for (_, i), value in (own or {}).items():
            items[i] = value
        return items if type(obj) is list else tuple(items)
    if isinstance(obj, Record):
        new = object.__new__(type(obj))
        args = [of(value) if id(value) in dirty else value for value in obj.args]
        state = {key: of(value) if id(value) in dirty else value for key, value in obj.state.items()}
        state_value = of(obj.state_value) if id(obj.state_value) in dirty else obj.state_value
        for field, value in (own or {}).items():
            if field[0] == "args":
                args[field[1]] = value
            elif field[0] == "state":
                state[field[1]] = value
            else:
                state_value = value
        new.args, new.state, new.state_value = tuple(args), state, state_value
        return new
    if isinstance(obj, (StorageRef, TensorRef, DTensorRef)):
        names = _REF_FIELDS[type(obj)]
        values = {name: getattr(obj, name) for name in names}
        for name, value in values.items():
            if id(value) in dirty:
                values[name] = of(value)
        for (_, name), value in (own or {}).items():
            values[name] = value
        if isinstance(obj, StorageRef):
            # a storage named otherwise would be another record: no rank file of one program does that
            if values["key"] != obj.key or not is_count(values["numel"]):
                raise _Unusable
            storage = StorageRef(values["key"], values["dtype"], values["numel"])
            remake.storages.append(storage)
            return storage
        if isinstance(obj, TensorRef):
            tensor = _tensor_ref(*values.values())
            if remake.checked:
                check_fits_storage(tensor)
            return tensor
        if not isinstance(values["local"], TensorRef) or not isinstance(values["spec"], Record):
            raise _Unusable
        shape, stride = as_dims(values["shape"]), as_dims(values["stride"])
        if shape is None or stride is None:
            raise _Unusable
        return DTensorRef(values["local"], values["spec"], shape, stride)
    raise _Unusable


def _same(a, b) -> bool:
    try:
        out: list = []
        _differences(a, b, out, set())
        return not out
    except _Unusable:
        return False
