"""The merge plan: plain, immutable data shared by every stage (imports nothing of ours but plan.columns).

A reader turns a checkpoint folder into a MergePlan (what the checkpoint holds); normalisation
returns a new one (what gets written: clean names, ties, target dtypes); the layout assigns output
files and offsets; the engine executes the extents. Nothing changes a plan in place: each step
returns a new one (`dataclasses.replace`, `MergePlan.noted`), so what a stage was given stays
true. Dtypes are torch dtype names ("float32", "bfloat16", ...) so the plan can be printed and
compared without torch. A reader may hand over its extents and source buffers as plan.columns.Records
(a million of each at 1,024 ranks): sequences of the same records, kept in columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import prod

from .columns import Records


def _freeze(instance, names: tuple[str, ...]) -> None:
    """Sequence fields become tuples (or stay Records), so a frozen plan's lists cannot be appended to either."""
    for name in names:
        value = getattr(instance, name)
        if not isinstance(value, (tuple, Records)):
            object.__setattr__(instance, name, tuple(value))


@dataclass(frozen=True, slots=True)  # slots: a plan holds one per piece, a million at 1,024 ranks
class SourceBuffer:
    """A run of bytes inside one input file, holding elements of one dtype."""

    path: str
    byte_offset: int
    nbytes: int
    dtype: str


@dataclass(frozen=True, slots=True)
class Extent:
    """`runs` runs of `count` contiguous elements copied from a source buffer into a tensor.

    Run i starts at element `src_offset + i * src_stride` of the source buffer and lands at
    element `dst_offset + i * dst_stride` of the output tensor (row-major, global shape).
    One run (`runs == 1`) is the common case; the strided form covers Shard(d) for d > 0.
    """

    source: int  # index into MergePlan.sources
    src_offset: int
    count: int
    dst_offset: int
    runs: int = 1
    src_stride: int = 0
    dst_stride: int = 0

    @property
    def numel(self) -> int:
        return self.runs * self.count


@dataclass(frozen=True)
class Transposed:
    """TensorPlan.compute of a tensor written transposed: its extents fill the tensor with its last two
    dimensions swapped ([..., rows, cols], row-major), and the written bytes are that tensor transposed
    ([..., cols, rows]). Set by a plan transform (plan.windows.Windows.transposed); every engine writes it
    with the transposed-copy kernel (execute.transposed, csrc/transpose.cpp), one matrix at a time."""

    rows: int
    cols: int
    used: frozenset[int]  # the plan sources its extents read

    def sources(self) -> set[int]:
        return set(self.used)


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    source_dtype: str
    target_dtype: str
    extents: tuple[Extent, ...] | Records
    aliases: tuple[str, ...] = ()  # tied names not written, listed for the report
    # Set for a tensor computed from others rather than copied (an execute.computed.Computed, set by a plan
    # transform): its extents are the unchanged tensor's; the writer computes it, engines never see it.
    # A Transposed (above) is executed by the engines' transposed copy (execute.transposed).
    compute: object | None = None

    def __post_init__(self):
        _freeze(self, ("shape", "extents", "aliases"))

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class Copy:
    """A piece the checkpoint holds twice (a tensor every rank holds whole, an HSDP replica's shard):
    the merge reads `kept`, so `other` must hold the same bytes or the choice would be silent.
    Each is a TensorPlan of its own (the local piece's shape) over the plan's sources."""

    name: str  # the tensor, as the checkpoint names it
    kept: TensorPlan
    other: TensorPlan
    kept_at: str  # where each copy is, for the message: "rank 0 (path)"
    other_at: str
    problem: str  # what a difference means and what to do


@dataclass(frozen=True)
class MergePlan:
    layout: str  # which reader produced it
    world_size: int
    sources: tuple[SourceBuffer, ...] | Records
    tensors: tuple[TensorPlan, ...]
    notes: tuple[str, ...] = ()  # what else the checkpoint holds, what was assumed
    left_out: tuple[str, ...] = ()  # names left out on request (--exclude-frozen), not missing
    warnings: tuple[str, ...] = ()  # what the user must act on before the output is usable
    config_dir: str | None = None  # folder with config.json / tokenizer files to copy, if any
    # config.json a reader built from what the checkpoint records, where no config folder was given or
    # found (readers.megatron_config): written to the output as config.json. Read-only.
    built_config: dict | None = None
    assumed: dict = field(default_factory=dict)  # what a reader inferred rather than read (shown by inspect); read-only
    # The layout options the plan was read with, given or found (a DeepSpeed tag, FSDP1's wrapping):
    # recorded in the manifest so that verify --against reads the same plan again. Read-only.
    options: dict = field(default_factory=dict)
    copies: tuple[Copy, ...] = ()  # checked by checks.copies before any byte moves
    # The sub-folder of the given folder that holds the model, where a framework put it there
    # (readers.framework_folders); None: the folder given.
    model_folder: str | None = None
    # Plans written to folders of their own inside OUT, set by a plan transform (PEFT adapters:
    # lora.split.AdapterPlan, each with a `plan` and a `folder`).
    adapters: tuple = ()
    # The layout's own plan transforms (plan.transform.PlanTransform), set by its reader: the
    # checkpoint's names and shapes onto the model's (readers.megatron_names). The pipeline applies
    # them before any check, then drops them: a plan whose tensors are the model's has none.
    conversions: tuple = ()

    def __post_init__(self):
        _freeze(self, ("sources", "tensors", "notes", "left_out", "warnings", "copies", "adapters", "conversions"))

    def noted(self, *notes: str, first: bool = False, warnings: tuple[str, ...] = ()) -> MergePlan:
        """The same plan with more notes (at the front with `first`) and warnings."""
        kept = tuple(note for note in notes if note)
        return replace(
            self, notes=kept + self.notes if first else self.notes + kept, warnings=self.warnings + tuple(warnings)
        )

    def but(self, **changes) -> MergePlan:
        """The same plan with some fields replaced."""
        return replace(self, **changes)
