"""DCP folders written by torch's HuggingFaceStorageWriter: safetensors files, no .metadata.

`dcp.save(state, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))` has
every rank write its chunks as `shard-{r+1:05}-model-{i:05}-of-{n:05}.safetensors` (i up to n
when `fqn_to_index_mapping` spreads tensors over n model files). Nothing else records the
sharding: each file's `__metadata__` holds `DCP_SHARDING_INFO`, JSON {name: {"saved_offsets":
[...]}}, where that file's chunk of `name` starts in the global tensor. As in torch's own reader
and `consolidate_safetensors_files`, a tensor's global shape is the largest offset + size over
its chunks. Chunks are read in place from the safetensors files.

So a checkpoint missing its last shard file (all of the last rank's chunks) leaves no gap in
the numbering and merges into a smaller model; the model's config.json, when present, catches
that: the embeddings' inferred shapes must reach its vocab_size and hidden size.
"""

from __future__ import annotations

import json
import os
import re
from math import prod

from .._parsing.safetensors_header import SafetensorsHeader, looks_like_safetensors, read_header, stored_tensor
from ..errors import BadInput, option
from ..geometry.boxes import box_extents, first_overlap
from ..hf.config import load_config
from ..plan.model import MergePlan, SourceBuffer, TensorPlan
from .framework_folders import in_or_beside
from .reader import Reader

NAME = "dcp-hf"
DESCRIPTION = "shard-{r}-model-{i}-of-{n}.safetensors with DCP offsets in their headers (HuggingFaceStorageWriter)"
_SHARDING_KEY = "DCP_SHARDING_INFO"
_SHARD_FILE = re.compile(r"shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors")
_EMBEDDING = re.compile(r"(?:^|\.)(?:embed_tokens|word_embeddings|wte|embed_in|lm_head|embed_out)\.weight$")


def matches(folder: str) -> bool:
    files = _safetensors_files(folder)
    return any(_SHARD_FILE.fullmatch(os.path.basename(f)) for f in files) or any(_has_sharding_info(f) for f in files)


def read(folder: str, config: str | None = None) -> MergePlan:
    """`config`: the folder of the model's config.json (--config); default: huggingface/ in the checkpoint,
    else the checkpoint folder itself when config.json is beside the shard files."""
    files = _safetensors_files(folder)
    shards = _check_numbering(folder, files)
    sources: list[SourceBuffer] = []
    chunks: dict[str, list[tuple[tuple, tuple, int]]] = {}  # name -> (offsets, sizes, source) per chunk
    for path in files:
        header = read_header(path)
        for name, offsets in _saved_offsets(header).items():
            stored = stored_tensor(header, name)
            if len(offsets) != len(stored.shape):
                raise BadInput(
                    f"{path}: {_SHARDING_KEY} places {name} at {offsets}, which does not fit its shape {list(stored.shape)}"
                )
            sources.append(SourceBuffer(path, stored.byte_offset, stored.nbytes, stored.dtype))
            chunks.setdefault(name, []).append((tuple(offsets), stored.shape, len(sources) - 1))
    tensors = [_plan_tensor(folder, name, pieces, sources) for name, pieces in chunks.items()]
    plan = MergePlan(NAME, shards or len(files), sources, tensors)
    plan = plan.but(config_dir=in_or_beside(folder))
    checked = _check_against_config(folder, tensors, config or plan.config_dir)
    plan = plan.noted(
        f"{len(files)} shard files; every tensor's global shape is inferred from its chunks (the writer records "
        "none), so a missing last shard file cannot be detected from them"
        + (
            f"; the embeddings' shapes agree with {checked}"
            if checked
            else f"; no config.json to check the embeddings' shapes against (give one with {option('config')})"
        )
    )
    return plan


def _check_against_config(folder: str, tensors: list[TensorPlan], config_dir: str | None) -> str | None:
    """The config.json the embeddings were checked against (None: none to check); an error if they fall short of it."""
    path = os.path.join(config_dir, "config.json") if config_dir else None
    if path is None or not os.path.isfile(path):
        return None
    config = load_config(path)
    vocab = config.get("vocab_size")
    width = next(
        (config[k] for k in ("embedding_size", "hidden_size", "n_embd", "d_model") if isinstance(config.get(k), int)),
        None,
    )
    if not isinstance(vocab, int) or width is None:
        return None
    for tensor in tensors:
        # Only smaller is a lost shard; larger (a padded vocabulary) is the model's own business.
        if (
            _EMBEDDING.search(tensor.name)
            and len(tensor.shape) == 2
            and (tensor.shape[0] < vocab or tensor.shape[1] < width)
        ):
            raise BadInput(
                f"{folder}: {tensor.name} is {list(tensor.shape)} by its chunks' offsets but {path} gives vocab_size "
                f"{vocab} and width {width}: a shard file is missing (the last one leaves no gap in the numbering) "
                "or config.json is another model's"
            )
    return path


def _safetensors_files(folder: str) -> list[str]:
    names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    return [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]


def _has_sharding_info(path: str) -> bool:
    if not looks_like_safetensors(path):
        return False
    try:
        return _SHARDING_KEY in read_header(path).metadata
    except BadInput:
        return False


def _check_numbering(folder: str, files: list[str]) -> int:
    """The number of shards (ranks that wrote files); an error naming a gap in the file numbers."""
    numbers = [tuple(int(g) for g in m.groups()) for f in files if (m := _SHARD_FILE.fullmatch(os.path.basename(f)))]
    if not numbers:
        return 0
    totals = {n for _, _, n in numbers}
    if len(totals) > 1:
        raise BadInput(
            f"{folder}: the shard files disagree on the number of model files ({sorted(totals)}); "
            "they come from different checkpoints"
        )
    (total,) = totals
    for kind, present, last in (
        ("shard", {s for s, _, _ in numbers}, max(s for s, _, _ in numbers)),
        ("model", {m for _, m, _ in numbers}, total),
    ):
        missing = [i for i in range(1, last + 1) if i not in present]
        if missing:
            pattern = (
                f"shard-{missing[0]:05d}-model-*-of-{total:05d}.safetensors"
                if kind == "shard"
                else f"shard-*-model-{missing[0]:05d}-of-{total:05d}.safetensors"
            )
            raise BadInput(f"{os.path.join(folder, pattern)} is missing: the files are numbered up to {kind} {last}")
    return len({s for s, _, _ in numbers})


def _saved_offsets(header: SafetensorsHeader) -> dict[str, list[int]]:
    """{tensor name: its chunk's offsets in the global tensor}, in the order the writer saved them."""
    path = header.path
    text = header.metadata.get(_SHARDING_KEY)
    if text is None:
        raise BadInput(
            f"{path}: no {_SHARDING_KEY} in its header, so it was not written by HuggingFaceStorageWriter; "
            "move it out of the checkpoint folder"
        )
    try:
        info = json.loads(text)
    except (TypeError, ValueError):
        raise BadInput(f"{path}: {_SHARDING_KEY} in its header is not valid JSON; the file is corrupt") from None
    if not isinstance(info, dict) or set(info) != set(header.entries):
        raise BadInput(f"{path}: {_SHARDING_KEY} does not list exactly the tensors the file holds; the file is corrupt")
    offsets = {}
    for name, entry in info.items():
        value = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
            raise BadInput(f"{path}: {_SHARDING_KEY} has no valid saved_offsets for {name}; the file is corrupt")
        offsets[name] = value
    return offsets


def _plan_tensor(folder: str, name: str, pieces, sources: list[SourceBuffer]) -> TensorPlan:
    dtypes = {sources[source].dtype for _, _, source in pieces}
    ranks = {len(sizes) for _, sizes, _ in pieces}
    if len(dtypes) > 1 or len(ranks) > 1:
        raise BadInput(
            f"{folder}: the chunks of {name} disagree on dtype or number of dimensions "
            f"({sorted(dtypes)}, {sorted(ranks)}); the files come from different checkpoints"
        )
    sized = [piece for piece in pieces if prod(piece[1])] or pieces  # where an empty chunk claims to start is no size
    shape = tuple(max(o[d] + s[d] for o, s, _ in sized) for d in range(ranks.pop()))
    overlap = first_overlap([(offsets, sizes) for offsets, sizes, _ in pieces])
    if overlap is not None:
        first, second = (pieces[i] for i in overlap)
        raise BadInput(
            f"{sources[second[2]].path}: its chunk of {name} at {list(second[0])} overlaps the one at "
            f"{list(first[0])} in {os.path.basename(sources[first[2]].path)}; the offsets are wrong"
        )
    extents = [e for offsets, sizes, source in pieces for e in box_extents(source, 0, shape, offsets, sizes)]
    covered = sum(e.numel for e in extents)
    if covered != prod(shape):
        raise BadInput(
            f"{folder}: the chunks of {name} cover {covered} of the {prod(shape)} elements of its shape "
            f"{list(shape)}; a shard file is missing or its offsets are wrong"
        )
    dtype = dtypes.pop()
    return TensorPlan(name, shape, dtype, dtype, extents)


READER = Reader(NAME, DESCRIPTION, sniff=matches, read=read, reads_config=True)
