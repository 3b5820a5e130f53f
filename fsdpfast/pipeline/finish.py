"""The one writer of a Hugging Face folder's small files, once its weights files are written.

Used by the merge, by `save_pretrained` (live.save) and for the folders a plan transform adds
inside OUT (a PEFT adapter). In this order, into the target: the index (more than one weights
file), config.json with the dtype written (copied with the generation config, tokenizer and
custom-code files from a config folder, or written from a dict), generation_config.json,
the tokenizer's or processor's files, each extra folder's JSON files and manifest, and last the
folder's manifest, which lists every file before it. Then the caller publishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..execute.parts import tensor_checksums
from ..fp8.plan import written_config
from ..hf.config_files import copy_config_files, write_built_config
from ..manifest import MANIFEST_NAME, build_manifest
from ..plan.layout import OutputFile, index_json
from ..plan.model import MergePlan
from ..plan.transform import ExtraFolder

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class Provenance:
    """Where the bytes came from, for the manifests: the checkpoint folder (None: a model in memory),
    the identity of its files (manifest.source_identity) and the engine's name."""

    checkpoint: str | None
    identity: list[dict]
    engine: str


@dataclass
class FolderFiles:
    """What goes beside the weights files. `config_dir`: a folder whose config files are copied;
    else `config`: config.json's content. `dtype`: written into config.json (None: kept as it is)."""

    config_dir: str | None = None
    config: dict | None = None
    dtype: str | None = None
    generation_config: dict | None = None
    tokenizer: object = None  # anything with save_pretrained(folder): a tokenizer or processor
    extras: list[ExtraFolder] = field(default_factory=list)


@dataclass(frozen=True)
class Finished:
    copied: list[str]  # the config files written
    extras: list[str]  # the extra folders written
    notes: list[str]


def write_small_files(
    target,
    plan: MergePlan,
    files: list[OutputFile],
    pieces: list,
    beside: FolderFiles,
    source: Provenance,
    manifest_dtype: str | None,
) -> Finished:
    """Everything but the weights into `target`, the manifest last (`pieces`: the executor's checksums)."""
    checksums = tensor_checksums(files + [extra.placed for extra in beside.extras], pieces)
    if len(files) > 1:
        target.write_json(INDEX_NAME, index_json(files))
    copied = _write_config(target, beside, written_config(plan))
    if beside.generation_config is not None:
        target.write_json("generation_config.json", beside.generation_config)
    if beside.tokenizer is not None:
        with target.local_folder() as folder:
            beside.tokenizer.save_pretrained(folder)
    for extra in beside.extras:
        for name, content in extra.json_files:
            target.write_json(f"{extra.folder}/{name}", content)
        manifest = _manifest(extra.plan, [extra.weights], checksums[extra.placed.name], source, manifest_dtype)
        target.write_json(f"{extra.folder}/{MANIFEST_NAME}", manifest)
    model_checksums = {name: crc for f in files for name, crc in checksums[f.name].items()}
    manifest = _manifest(plan, files, model_checksums, source, manifest_dtype)
    if beside.extras:
        manifest["adapters"] = [extra.folder for extra in beside.extras]  # each with a manifest of its own
    target.write_manifest(manifest)  # last: it lists every file above
    return Finished(copied, [extra.folder for extra in beside.extras], [n for e in beside.extras for n in e.notes])


def written_names(files: list[OutputFile], extras: list[ExtraFolder]) -> list[str]:
    """The weights files, the index and each extra folder's files, as a report lists them."""
    return [f.name for f in files] + ([INDEX_NAME] if len(files) > 1 else []) + [n for e in extras for n in e.written()]


def _write_config(target, beside: FolderFiles, quantization: dict | None = None) -> list[str]:
    if beside.config_dir:
        return copy_config_files(beside.config_dir, target, beside.dtype, quantization)
    if beside.config is not None:
        return write_built_config(beside.config, target, beside.dtype, quantization)
    return []


def _manifest(plan: MergePlan, files: list[OutputFile], checksums: dict, source: Provenance, dtype) -> dict:
    manifest = build_manifest(source.checkpoint or ".", plan, files, checksums, source.identity, source.engine, dtype)
    if source.checkpoint is None:
        manifest["checkpoint"] = None  # written from a model in memory: no source files to verify --against
    return manifest
