"""What a merge, a dry run and an inspection found, as dataclasses; `summary()` is the command line's text."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from .._text import count, size
from ..errors import option
from ..io.earlier_output import overwrite_refusal
from ..plan.layout import OutputFile, tensor_nbytes
from ..plan.model import MergePlan


@dataclass
class MergeReport:
    """What `merge` did: where, from which layout and world size, with which engine, how many tensors
    and bytes in which files, how long; `tied` maps each name written to the names it stands for,
    `copied` the config and tokenizer files, `notes` what was assumed or left out. `summary()` is
    the command line's text."""

    out_dir: str
    layout: str
    world_size: int
    engine: str
    tensors: int
    bytes_written: int  # tensor data, as in the index's total_size
    files: list[str]
    seconds: float
    tied: dict[str, list[str]] = field(default_factory=dict)  # kept name -> names not written
    copied: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # the output needs something more before it is usable
    adapters: list[str] = field(default_factory=list)  # PEFT adapter folders written (OUT/lora_adapter...)
    processes: int = 1  # how many processes wrote it (torchrun)

    def summary(self) -> str:
        lines = [
            f"merged {count(self.tensors, 'tensor')} ({size(self.bytes_written)}) from {count(self.world_size, 'rank')} "
            f"[{self.layout}] into {self.out_dir} in {self.seconds:.2f} s with the {self.engine} engine"
            + (f" in {self.processes} processes" if self.processes > 1 else ""),
            f"files: {', '.join(self.files)}",
        ]
        lines += [f"tied: {', '.join(names)} written once as {kept}" for kept, names in self.tied.items()]
        lines += [
            f"adapter: {os.path.join(self.out_dir, folder)} (PeftModel.from_pretrained(base, that folder))"
            for folder in self.adapters
        ]
        lines += [f"note: {note}" for note in self.notes]
        lines += [f"warning: {warning}" for warning in self.warnings]
        return "\n".join(lines)


@dataclass
class DryRun:
    """What `merge` would write: each file with each tensor's place (dicts, as `dry_run` returns them)."""

    checkpoint: str
    out_dir: str
    layout: str
    world_size: int
    files: list[dict]  # name, bytes, header_bytes, tensors: name, dtype, shape, offset, bytes
    total_bytes: int
    notes: list[str]
    warnings: list[str]

    @classmethod
    def of(cls, src: str, dst: str, plan: MergePlan, files: list[OutputFile]) -> DryRun:
        placed = [
            {
                "name": f.name,
                "bytes": f.size,
                "header_bytes": len(f.header),
                "tensors": [
                    {
                        "name": p.tensor.name,
                        "dtype": p.tensor.target_dtype,
                        "shape": list(p.tensor.shape),
                        "offset": p.offset,
                        "bytes": p.nbytes,
                    }
                    for p in f.tensors
                ],
            }
            for f in files
        ]
        total = sum(p.nbytes for f in files for p in f.tensors)
        notes = list(plan.notes) + _existing_output_notes(dst)
        return cls(src, dst, plan.layout, plan.world_size, placed, total, notes, list(plan.warnings))

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        tensors = sum(len(f["tensors"]) for f in self.files)
        lines = [
            f"dry run: {self.checkpoint} [{self.layout}, {count(self.world_size, 'rank')}] -> {self.out_dir}: "
            f"{count(tensors, 'tensor')}, {size(self.total_bytes)} in {count(len(self.files), 'file')}; nothing written"
        ]
        for f in self.files:
            lines.append(f"{f['name']}  {f['bytes']:,d} B (header {f['header_bytes']:,d} B)")
            width = max((len(t["name"]) for t in f["tensors"]), default=0)
            lines += [
                f"  {t['name']:<{width}}  {t['dtype']:<9} {str(tuple(t['shape'])):<18} at {t['offset']:>12,d}  "
                f"{t['bytes']:>14,d} B"
                for t in f["tensors"]
            ]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


@dataclass
class Inspection:
    """What a checkpoint holds and a merge would write, from metadata alone (as `inspect` returns it)."""

    checkpoint: str
    layout: str
    model_folder: str | None  # where a framework put the model inside the folder given (None: itself)
    world_size: int
    tensors: list[dict]  # name, shape, dtype, bytes, tied
    total_tensors: int
    total_bytes: int
    source_files: list[str]
    config_dir: str | None
    built_config: dict | None  # config.json built from the checkpoint's own records (no config_dir)
    notes: list[str]
    warnings: list[str]
    assumed: dict
    adapters: list[dict] = field(default_factory=list)  # PEFT LoRA adapters (lora.transform)

    @classmethod
    def of(cls, src: str, plan: MergePlan, features: dict, said=None) -> Inspection:
        """`features`: what each plan transform shows (lora.transform: `adapters`). `said`: how a path
        the plan names is told (a store's prefix planned from a local stand-in: Mirrored.said); as it is."""
        said = said or (lambda value: value)
        tensors = [
            {
                "name": t.name,
                "shape": list(t.shape),
                "dtype": t.source_dtype,
                "bytes": tensor_nbytes(t),
                "tied": list(t.aliases),
            }
            for t in plan.tensors
        ]
        return cls(
            checkpoint=src,
            layout=plan.layout,
            model_folder=plan.model_folder,
            world_size=plan.world_size,
            tensors=tensors,
            total_tensors=len(tensors),
            total_bytes=sum(t["bytes"] for t in tensors),
            source_files=sorted({said(s.path) for s in plan.sources}),
            config_dir=said(plan.config_dir),
            built_config=plan.built_config,
            notes=[said(note) for note in plan.notes],
            warnings=[said(warning) for warning in plan.warnings],
            assumed={key: said(value) for key, value in plan.assumed.items()},
            **features,
        )

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        inside = f" (the model in {self.model_folder}/)" if self.model_folder else ""
        lines = [
            f"{self.checkpoint}{inside}: layout {self.layout}, {count(self.world_size, 'rank')}, "
            f"{count(self.total_tensors, 'tensor')}, {size(self.total_bytes)}, "
            f"{count(len(self.source_files), 'file')}"
        ]
        width = max((len(t["name"]) for t in self.tensors), default=0)
        for t in self.tensors:
            tied = f"  (also {', '.join(t['tied'])})" if t["tied"] else ""
            lines.append(
                f"  {t['name']:<{width}}  {t['dtype']:<9} {str(tuple(t['shape'])):<18} {t['bytes']:>14,d} B{tied}"
            )
        for adapter in self.adapters:
            alpha = adapter["lora_alpha"] if adapter["lora_alpha"] is not None else "missing (give --lora-alpha)"
            targets = adapter["target_modules"]
            lines.append(
                f"adapter {adapter['adapter']} -> {adapter['folder']}: r {adapter['r']}, lora_alpha {alpha}, "
                f"{adapter['modules']} modules ({', '.join(targets) if isinstance(targets, list) else targets}), "
                f"{adapter['tensors']} tensors, {adapter['bytes']:,d} B{', DoRA' if adapter['use_dora'] else ''}"
            )
        lines += [f"note: {note}" for note in self.notes]
        lines += [f"warning: {warning}" for warning in self.warnings]
        return "\n".join(lines + _assumed_lines(self.assumed))


def _assumed_lines(assumed: dict) -> list[str]:
    """fsdp1-flat: the model, wrap classes, units and each unit's parameter order that were assumed."""
    if not assumed.get("units"):
        return []
    lines = [
        f"assumed: model {assumed['model']} from {assumed['config']}; wrap {', '.join(assumed['wrap']) or 'nothing'} "
        f"({assumed['wrap_source']}); use_orig_params={assumed['use_orig_params']} ({assumed['alignment_source']})"
    ]
    for adapter in assumed.get("peft") or ():  # the peft model rebuilt over it (lora.fsdp1_model)
        targets, others = adapter["target_modules"], len(adapter["rank_pattern"] or {})
        lines.append(
            f"assumed: PEFT adapter {adapter['adapter']}: r {adapter['r']}"
            + (f" ({others} modules otherwise)" if others else "")
            + (f", {len(targets)} modules" if isinstance(targets, list) else f", target_modules {targets!r}")
            + f"{', DoRA' if adapter['use_dora'] else ''} ({adapter['source']})"
        )
    for unit in assumed["units"]:
        lines.append(
            f"  unit {unit['module']} ({unit['class']}): {unit['key']}, {unit['numel']:,} elements, "
            f"{unit['padding']:,} padding, {count(len(unit['params']), 'parameter')} in this order:"
        )
        for param in unit["params"]:
            tied = f"  (also {', '.join(param['tied'])})" if param["tied"] else ""
            lines.append(f"    {param['offset']:>12,d}  {param['name']} {tuple(param['shape'])}{tied}")
    return lines


def _existing_output_notes(dst: str) -> list[str]:
    if not os.path.lexists(dst):
        parent = os.path.dirname(os.path.abspath(dst))
        return [] if os.path.isdir(parent) else [f"{parent} does not exist: the merge will create it"]
    if os.path.isdir(dst) and not os.path.islink(dst) and not os.listdir(dst):
        return [f"{dst} is an empty folder: the merge will replace it"]
    refusal = overwrite_refusal(dst, dst) if os.path.isdir(dst) else f"{dst} is not a folder"
    if refusal is None:
        return [f"{dst} exists: the merge needs {option('overwrite', True)}"]
    return [f"{dst} exists: the merge will refuse it, even with {option('overwrite', True)} ({refusal})"]
