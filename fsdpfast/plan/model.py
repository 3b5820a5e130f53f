"""The merge plan: plain data shared by every layer (imports nothing of ours).

A reader turns a checkpoint folder into a MergePlan; the layout assigns output
files and offsets; the engine executes the extents. Dtypes are torch dtype names
("float32", "bfloat16", ...) so the plan can be printed and compared without torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod


@dataclass(frozen=True)
class SourceBuffer:
    """A run of bytes inside one input file, holding elements of one dtype."""

    path: str
    byte_offset: int
    nbytes: int
    dtype: str


@dataclass(frozen=True)
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


@dataclass
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    source_dtype: str
    target_dtype: str
    extents: list[Extent]
    aliases: list[str] = field(default_factory=list)  # tied names not written, listed for the report
    # Set for a tensor computed from others rather than copied (lora.fuse.FusedWeight, --merge-lora): its
    # extents are the unmerged weight's; the writer computes it, engines never see it.
    compute: object | None = None

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


@dataclass
class MergePlan:
    layout: str  # which reader produced it
    world_size: int
    sources: list[SourceBuffer]
    tensors: list[TensorPlan]
    notes: list[str] = field(default_factory=list)  # what else the checkpoint holds, what was assumed
    left_out: list[str] = field(default_factory=list)  # names left out on request (--exclude-frozen), not missing
    warnings: list[str] = field(default_factory=list)  # what the user must act on before the output is usable
    config_dir: str | None = None  # folder with config.json / tokenizer files to copy, if any
    assumed: dict = field(default_factory=dict)  # what a reader inferred rather than read (shown by inspect)
    # The layout options the plan was read with, given or found (a DeepSpeed tag, FSDP1's wrapping):
    # recorded in the manifest so that verify --against reads the same plan again.
    options: dict = field(default_factory=dict)
    copies: list[Copy] = field(default_factory=list)  # checked by plan.copies before any byte moves
    # The sub-folder of the given folder that holds the model, where a framework put it there
    # (readers.framework_folders); None: the folder given.
    model_folder: str | None = None
    # PEFT adapters split off a LoRA checkpoint (lora.split.AdapterPlan), each written to its own folder.
    adapters: list = field(default_factory=list)
