"""What the user asked a merge for, parsed and checked once at the edge (the command line or the Python face).

`merge_options(**given)` turns the keyword arguments of `merge`, `dry_run`, `plan_merge` and
`inspect` (each flag of `fsdpfast merge`) into a frozen MergeOptions: the dtype as a torch name,
the shard size in bytes, the layout and its options checked against the reader registry. The
stages below take these values as they are and never parse a string again. `given` keeps the
values as they were spelled, for the messages that name them (rank_agreement).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .errors import BadInput, option
from .execute.engines import check_engine_name
from .io.read_modes import check_read_mode
from .plan.layout import DEFAULT_MAX_SHARD_SIZE, parse_size
from .plan.normalise import parse_dtype


@dataclass(frozen=True)
class LoraOptions:
    """PEFT LoRA checkpoints (lora.transform): which adapters to fuse, what the checkpoint does not
    record, and the base model folder of a LoRA-only checkpoint. None: not given."""

    merge_lora: bool | str | tuple | None = None  # True, or adapter names in order ("a,b" or a list)
    lora_alpha: float | None = None
    lora_r: int | None = None
    base: str | None = None

    def given(self) -> dict:
        """The flags given, by their keyword names (what a LoRA flag on a plain checkpoint is refused by)."""
        values = {"merge_lora": self.merge_lora, "lora_alpha": self.lora_alpha, "lora_r": self.lora_r}
        return {k: v for k, v in {**values, "base": self.base}.items() if v not in (None, False, "")}


# How MoE experts are written (families.transform): as save_pretrained writes the family (one tensor
# per expert), or packed as transformers 5 holds them in memory.
EXPERT_LAYOUTS = ("hub", "packed")


@dataclass(frozen=True)
class MergeOptions:
    dtype: str | None = None  # the torch dtype floating tensors are cast to; None keeps each as stored
    max_shard_bytes: int = 0  # the largest output file
    layout: str | None = None  # forced, else detected
    layout_options: dict = field(default_factory=dict)  # each for one layout (readers.LAYOUT_OPTIONS), given only
    config_dir: str | None = None  # config.json and tokenizer files to copy (default: found beside the checkpoint)
    engine: str = "auto"
    read_mode: str = "auto"  # how sources are read (io.read_modes): auto, mmap or pread
    overwrite: bool = False
    allow_extra_tensors: bool = False
    full_copy_check: bool = False  # every byte of the copies held twice (verify --against), not a sample
    expert_layout: str = "hub"  # EXPERT_LAYOUTS
    lora: LoraOptions = field(default_factory=LoraOptions)
    fp8_skip: tuple[str, ...] | None = None  # --dtype fp8: the --fp8-skip patterns (fsdpfast.fp8); None: no fp8
    given: dict = field(default_factory=dict)  # what decides the output, as given: the same on every process


def merge_options(
    *,
    dtype: str | None = "keep",
    max_shard_size: str | int | None = DEFAULT_MAX_SHARD_SIZE,
    layout: str | None = None,
    config: str | None = None,
    overwrite: bool = False,
    engine: str = "auto",
    read_mode: str = "auto",
    allow_extra_tensors: bool = False,
    full_copy_check: bool = False,
    expert_layout: str = "hub",
    merge_lora=None,
    lora_alpha: float | None = None,
    lora_r: int | None = None,
    base: str | None = None,
    fp8_skip=None,
    fp8: list | None = None,
    **layout_options,
) -> MergeOptions:
    """The keyword arguments of the public functions, checked in the order a merge used to meet them."""
    check_engine_name(engine)
    if expert_layout not in EXPERT_LAYOUTS:
        raise BadInput(f"{option('expert_layout', expert_layout)} is not one of {', '.join(EXPERT_LAYOUTS)}")
    check_read_mode(read_mode)
    skip = fp8_patterns(fp8_skip) if fp8_skip else tuple(fp8 or ())  # `fp8`: as a manifest records them
    fp8 = str(dtype) in FP8_NAMES or fp8 is not None
    if fp8_skip and not fp8:
        raise BadInput(f"--fp8-skip applies to --dtype fp8 only, not {option('dtype', dtype)}")
    wanted = "bfloat16" if fp8 else parse_dtype(dtype)  # what fp8 leaves unquantized is bf16, as released
    _check_layout(layout, layout_options)
    shard = parse_size(max_shard_size)
    lora = LoraOptions(merge_lora, lora_alpha, lora_r, os.fspath(base) if base else base)
    given = dict(
        dtype=dtype,
        max_shard_size=max_shard_size,
        layout=layout,
        config=config,
        overwrite=overwrite,
        engine=engine,
        read_mode=read_mode,
        allow_extra_tensors=allow_extra_tensors,
        expert_layout=expert_layout,
        merge_lora=merge_lora,
        lora_alpha=lora_alpha,
        lora_r=lora_r,
        base=base,
        **({"fp8_skip": fp8_skip} if fp8_skip else {}),
        **layout_options,
    )
    return MergeOptions(
        dtype=wanted,
        max_shard_bytes=shard,
        layout=layout,
        layout_options={name: value for name, value in layout_options.items() if value is not None},
        config_dir=os.fspath(config) if config else None,
        engine=engine,
        read_mode=read_mode,
        overwrite=overwrite,
        allow_extra_tensors=allow_extra_tensors,
        full_copy_check=full_copy_check,
        expert_layout=expert_layout,
        lora=lora,
        fp8_skip=skip if fp8 else None,
        given=given,
    )


# --dtype spellings of the block-scaled float8 output (fsdpfast.fp8)
FP8_NAMES = ("fp8", "fp8-block")


def fp8_patterns(value) -> tuple[str, ...]:
    """--fp8-skip PATTERN[,PATTERN...] (or a list): fnmatch patterns on the names written."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    return tuple(p.strip() for p in items if p.strip())


# What only a merge takes: given to plan_merge or inspect, or recorded among a manifest's layout
# options, each is an unknown layout option, as it always was.
MERGE_ONLY = ("max_shard_size", "overwrite", "engine", "read_mode")


def layout_options_only(options: dict) -> dict:
    """`options`, every one a layout option (or a LoRA or plan flag): a merge-only argument is refused."""
    for name in options:
        if name in MERGE_ONLY:
            raise _unknown_layout_option(name)
    return options


def _unknown_layout_option(name: str) -> BadInput:
    from . import readers  # the registry imports every reader: only once options are asked for

    return readers.unknown_layout_option(name)


def _check_layout(layout: str | None, layout_options: dict) -> None:
    from . import readers

    readers.check_layout(layout, layout_options)
