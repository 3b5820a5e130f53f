"""What `verify` found: each mismatch, and the report of one verify run (the ground every check writes to)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._text import count, size
from ..errors import on_command_line
from ..io.safetensors_folder import StoredTensor

MAX_LISTED = 20  # mismatches printed one per line; the JSON report holds them all


@dataclass
class Mismatch:
    tensor: str
    what: str
    byte: int | None = None  # first differing byte within the tensor's data
    element: int | None = None  # first differing element (row-major)

    def line(self) -> str:
        where = f" (first difference at element {self.element}, byte {self.byte})" if self.byte is not None else ""
        return f"{self.tensor}: {self.what}{where}"


@dataclass
class VerifyReport:
    """What `verify` checked (`checks`), how many tensors and bytes, and every mismatch found;
    `ok` is True when there is none. `summary()` is the command line's text."""

    out_dir: str
    checks: list[str] = field(default_factory=list)  # manifest, against CKPT, reference DIR, smoke
    tensors: int = 0
    bytes_checked: int = 0  # output bytes some check read, each counted once however many checks read it
    mismatches: list[Mismatch] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        self._checked: set[str] = set()  # not a field: the JSON report holds the count

    def count_checked(self, tensor: StoredTensor) -> None:
        if tensor.name not in self._checked:
            self._checked.add(tensor.name)
            self.bytes_checked += tensor.nbytes

    def mismatch(self, tensor: str, what: str) -> None:
        """Record a mismatch (for checks outside verify, e.g. lora.verify, that never name Mismatch)."""
        self.mismatches.append(Mismatch(tensor, what))

    def include(self, folder: str, sub: VerifyReport) -> None:
        """Add the findings of `sub`, the report of the folder `folder` inside this output, named under it."""
        self.checks += [f"{folder}: {check}" for check in sub.checks]
        self.tensors += sub.tensors
        self.bytes_checked += sub.bytes_checked
        self.mismatches += [Mismatch(f"{folder}/{m.tensor}", m.what, m.byte, m.element) for m in sub.mismatches]
        self.notes += [f"{folder}: {note}" for note in sub.notes]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def summary(self) -> str:
        lines = [f"mismatch: {m.line()}" for m in self.mismatches[:MAX_LISTED]]
        if len(self.mismatches) > MAX_LISTED:
            lines.append(
                f"... and {count(len(self.mismatches) - MAX_LISTED, 'more mismatch', 'more mismatches')} "
                f"({'--json lists' if on_command_line() else 'the report lists'} them all)"
            )
        lines += [f"note: {note}" for note in self.notes]
        verdict = "OK" if self.ok else f"FAILED, {count(len(self.mismatches), 'mismatch', 'mismatches')}"
        lines.append(
            f"verify {self.out_dir}: {verdict}: {count(self.tensors, 'tensor')}, {size(self.bytes_checked)} "
            f"checked ({'; '.join(self.checks)})"
        )
        return "\n".join(lines)


def compare_names(report: VerifyReport, expected: set[str], present: set[str], where: str, source: str) -> None:
    """A mismatch for each name only one side has: `where` names the expected side, `source` the other."""
    for name in sorted(expected - present):
        report.mismatches.append(Mismatch(name, f"{where} but not in the output"))
    for name in sorted(present - expected):
        report.mismatches.append(Mismatch(name, f"in the output but not in {source}"))
