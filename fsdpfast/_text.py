"""Sizes and counts as a person reads them in a summary line: `26.4 MB`, `1 file`, `3 files`."""

from __future__ import annotations

_UNITS = ("KB", "MB", "GB", "TB", "PB")  # decimal, as --max-shard-size's 5GB and Hugging Face's


def size(nbytes: int) -> str:
    """`0 B`, `512 B`, `1.50 KB`, `26.4 MB`, `812 MB`, `3.81 GB`: three significant digits from 1 KB up."""
    if nbytes < 1000:
        return f"{nbytes} B"
    value = float(nbytes)
    for unit in _UNITS:
        value /= 1000
        if value < 999.5 or unit == _UNITS[-1]:
            break
    decimals = 2 if value < 9.995 else 1 if value < 99.95 else 0  # where rounding would add a digit
    return f"{value:.{decimals}f} {unit}"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`1 file`, `0 files`, `3 tensors`; `plural` where adding an s is wrong (`1 mismatch`, `2 mismatches`)."""
    return f"{n:,d} {noun if n == 1 else plural or noun + 's'}"
