"""Records kept in columns: a plan of 1,024 ranks holds a million extents and source buffers.

`Records` is an immutable sequence of one frozen dataclass (plan.model's Extent, SourceBuffer)
whose fields are whole numbers or strings. It keeps them in one array of 64-bit integers, a row
of `len(fields)` numbers a record, a string as its index in a small table of the distinct
strings (paths, dtype names): 56 bytes an Extent and 32 a SourceBuffer, against 150-250 as
Python objects with their ints. A record is made when it is asked for (indexing, iteration) and
not kept, so every consumer reads the plan as before. A Records equals, and hashes as, the tuple
of its records.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import fields
from itertools import chain


class Records(Sequence):
    __slots__ = ("kind", "_numbers", "_strings", "_text", "_width", "_names", "_hash")

    def __init__(self, kind: type, numbers: array, strings: tuple[str, ...], text: tuple[int, ...], width: int):
        self.kind, self._numbers, self._strings, self._text, self._width = kind, numbers, strings, text, width
        self._names = tuple(f.name for f in fields(kind))
        self._hash = None

    @classmethod
    def of(cls, kind: type, items: Iterable) -> Records:
        """The records of `items` (instances of `kind`) in columns."""
        builder = RecordsBuilder(kind)
        for item in items:
            builder.append(item)
        return builder.done()

    def __len__(self) -> int:
        return len(self._numbers) // self._width

    def _made(self, values):
        if self._text:
            values = list(values)
            for i in self._text:
                values[i] = self._strings[values[i]]
        return self.kind(*values)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("record index out of range")
        return self._made(self._numbers[index * self._width : (index + 1) * self._width])

    def __iter__(self):
        rows = zip(*[iter(self._numbers)] * self._width)  # the numbers, a row at a time
        if not self._text:
            kind = self.kind
            return (kind(*row) for row in rows)
        return map(self._made, rows)

    def column(self, name: str) -> array:
        """One numeric field of every record, without making the records."""
        at = self._names.index(name)
        if at in self._text:
            raise TypeError(f"{self.kind.__name__}.{name} is a string field")
        return self._numbers[at :: self._width]

    def numbers(self) -> array | None:
        """Every record's fields in one int64 array, row after row (for native code; the array itself,
        not a copy: never to be changed), or None for kinds with string fields (their numbers are
        indices into a table of strings)."""
        return None if self._text else self._numbers

    def __eq__(self, other) -> bool:
        if isinstance(other, Records) and other.kind is self.kind and other._strings == self._strings:
            return self._numbers == other._numbers
        if isinstance(other, (Records, tuple, list)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple(self))
        return self._hash

    def __add__(self, other):
        return tuple(self) + tuple(other)

    def __radd__(self, other):
        return tuple(other) + tuple(self)

    def __repr__(self) -> str:
        return f"Records({self.kind.__name__}, {len(self)} records)"

    def __reduce__(self):
        return Records, (self.kind, self._numbers, self._strings, self._text, self._width)


class RecordsBuilder:
    """Appends records of `kind` to columns; `done()` is the immutable Records so far."""

    def __init__(self, kind: type):
        self.kind = kind
        self._names = tuple(f.name for f in fields(kind))
        self._text = tuple(i for i, f in enumerate(fields(kind)) if f.type in ("str", str))  # the string fields
        self._numbers = array("q")
        self._strings: dict[str, int] = {}
        self._handed_out = False  # the columns belong to a Records too: copied before the next append

    def append(self, item) -> None:
        self.append_values(*(getattr(item, name) for name in self._names))

    def append_values(self, *values) -> None:
        """A record given by its fields' values, in their order."""
        if len(values) != len(self._names):
            raise TypeError(f"{self.kind.__name__} has {len(self._names)} fields, got {len(values)}")
        if self._handed_out:
            self._numbers, self._handed_out = array("q", self._numbers), False
        if self._text:
            values = list(values)
            for i in self._text:
                values[i] = self._strings.setdefault(values[i], len(self._strings))
        self._numbers.extend(values)

    def extend(self, rows: Iterable[tuple[int, ...]]) -> None:
        """Records given as tuples of their fields' values; for kinds without string fields."""
        if self._text:
            raise TypeError(f"{self.kind.__name__} has string fields: append them one by one")
        if self._handed_out:
            self._numbers, self._handed_out = array("q", self._numbers), False
        before = len(self._numbers)
        self._numbers.extend(chain.from_iterable(rows))
        if (len(self._numbers) - before) % len(self._names):
            del self._numbers[before:]
            raise TypeError(f"{self.kind.__name__} records have {len(self._names)} fields")

    def __len__(self) -> int:
        return len(self._numbers) // len(self._names)

    def done(self) -> Records:
        self._handed_out = True
        return Records(self.kind, self._numbers, tuple(self._strings), self._text, len(self._names))
