"""DeepSpeed ZeRO stage 1, 2 and 3 checkpoints: the fp32 master weights, read in place.

Where each parameter's elements sit (the same arithmetic as DeepSpeed's zero_to_fp32):
- stage 1/2: per parameter group, the ranks' saved partitions laid end to end form one flat vector
  (DeepSpeed strips the alignment padding at its end before saving); the group's parameters follow
  each other in `param_shapes` order, each followed by its `param_alignment_paddings` entry;
- stage 3: every parameter is partitioned on its own: rank r holds elements
  [r * ceil(n / W), (r + 1) * ceil(n / W)) (the last piece padded), and each rank's flat groups
  hold its pieces one after another in `param_shapes` order.
Frozen parameters come from the model-states files (stage 2: whole, stage 3: per-rank pieces laid
out like trained ones; stage 1 saves none, so they are read whole from the module state dict),
buffers from the module state dict, and `shared_params` names become aliases of what they share.
"""

from __future__ import annotations

import os
from math import prod

from .._parsing.safe_load import TensorRef, as_dims, is_count
from ..errors import BadInput, option
from ..geometry.flat_runs import FlatRuns
from ..plan.model import Extent, MergePlan, TensorPlan
from .deepspeed_experts import AutoEpToTransformers, expert_tensors
from .deepspeed_files import RankFiles, flat_partition, is_tag_folder, read_rank_files, resolve_tag, tags_in
from .deepspeed_moe import NativeMoeToTransformers
from .deepspeed_moe import expert_tensors as native_expert_tensors
from .deepspeed_saves import check_one_save
from .reader import Reader, ReaderOption
from .storage_sources import StorageSources

NAME = "deepspeed-zero"
DESCRIPTION = "latest + global_stepN/ with *_model_states.pt and *_optim_states.pt: DeepSpeed ZeRO stage 1/2/3"


def matches(folder: str) -> bool:
    # A `latest` file alone is no evidence (other tools write one too): a folder of DeepSpeed files is.
    return is_tag_folder(folder) or bool(tags_in(folder))


def read(folder: str, tag: str | None = None, exclude_frozen: bool | None = None) -> MergePlan:
    """`exclude_frozen`: leave frozen parameters out, as zero_to_fp32's exclude_frozen_parameters
    (they are still read and checked, so a damaged file is refused either way)."""
    tag_dir, tag, how = resolve_tag(folder, tag)
    files = read_rank_files(tag_dir)
    model_path, model = files.model[0]
    shared = _shared_params(model, model_path)
    sources = StorageSources()
    excluded: dict[str, TensorPlan] = {}
    try:
        trained = (_stage12_trained if files.stage < 3 else _stage3_trained)(files, sources)
        if exclude_frozen:
            skipped = StorageSources()
            try:
                excluded, _ = _frozen(files, skipped, set(trained))
            finally:
                skipped.close()
            frozen, frozen_from = {}, ""
        else:
            frozen, frozen_from = _frozen(files, sources, set(trained))
        buffers = _buffers(files, sources)
    finally:
        sources.close()
    # After planning, so a file whose own sizes disagree is named by what the plan found in it first.
    one_save = check_one_save(tag_dir, files)
    planned = {**trained, **frozen, **buffers}
    order = [str(name) for name in model["module"] if name in planned] + [
        n for n in planned if n not in model["module"]
    ]
    tensors = [planned[name] for name in order]
    notes = [
        f"DeepSpeed ZeRO stage {files.stage}, tag {tag} ({how}), {files.world} ranks, "
        f"{'bf16' if files.bf16 else 'fp32'} training, saved by DeepSpeed {model.get('ds_version', '?')}"
    ]
    notes.append(one_save)
    tensors += _aliases(shared, planned, notes, excluded)
    leftover = [
        str(n) for n in model["module"] if str(n) not in planned and str(n) not in shared and str(n) not in excluded
    ]
    notes.append(
        f"{len(trained)} trained parameters: the fp32 master weights from the *_optim_states.pt files "
        "(their Adam moments are never read)"
    )
    if frozen:
        notes.append(f"{len(frozen)} frozen parameters as the model held them ({_dtypes(frozen)}), {frozen_from}")
    if exclude_frozen:
        notes.append(
            f"{len(excluded)} frozen parameters left out ({option('exclude_frozen', True)}), as DeepSpeed's "
            f"zero_to_fp32 --exclude_frozen_parameters does"
            + (f": {', '.join(list(excluded)[:3])}{', ...' if len(excluded) > 3 else ''}" if excluded else "")
        )
    if buffers:
        notes.append(f"{len(buffers)} buffers as saved ({_dtypes(buffers)}), from {os.path.basename(model_path)}")
    if leftover:
        notes.append(
            f"not merged: {len(leftover)} module entries with no saved data ({', '.join(leftover[:3])}"
            f"{', ...' if len(leftover) > 3 else ''}); frozen parameters excluded when saving?"
        )
    plan = MergePlan(NAME, files.world, sources.buffers, tensors, notes)
    if exclude_frozen:  # missing from the output on purpose: the model-shape check allows them
        plan = plan.but(left_out=list(excluded))
    plan = plan.but(config_dir=_config_dir(tag_dir, folder))
    plan = plan.but(options={"tag": tag})
    if files.autoep is not None:
        plan = plan.but(conversions=(AutoEpToTransformers(),)).noted(
            f"DeepSpeed AutoEP: {len(files.autoep)} MoE layers, {files.autoep[0].get('num_experts')} experts each "
            f"over {files.autoep[0].get('ep_size')} expert-parallel ranks (their fp32 masters from the optimizer files)"
        )  # the tag read, so verify reads it again even after `latest` moves on
    if files.native_moe is not None:
        first = os.path.join(tag_dir, "layer_0_expert_0_mp_rank_00_model_states.pt")
        plan = plan.but(conversions=(NativeMoeToTransformers(first),)).noted(
            f"DeepSpeed MoE (deepspeed.moe.layer.MoE): {len(files.native_moe)} MoE layers of "
            f"{', '.join(map(str, sorted(set(files.native_moe))))} experts, their fp32 masters from the optimizer "
            "files; the per-expert files checked to be there"
        )
    return plan


def _shared_params(model: dict, path: str) -> dict[str, str]:
    """{tied name: the name it shares storage with}, as DeepSpeed records them."""
    shared = model.get("shared_params")
    if shared is None:
        return {}
    if not isinstance(shared, dict):
        raise BadInput(f"{path}: shared_params is {shared!r:.60}, not a name -> name map; the file is corrupt")
    return {str(alias): str(owner) for alias, owner in shared.items()}


def _buffer_names(model: dict, path: str) -> list[str]:
    names = model.get("buffer_names")
    if names is None:
        return []
    if not isinstance(names, (list, tuple, set)):
        raise BadInput(f"{path}: buffer_names is {names!r:.60}, not a list of names; the file is corrupt")
    return [str(name) for name in names]


def _group_shapes(model: dict, path: str) -> list[dict[str, tuple[int, ...]]]:
    groups = []
    for group in model["param_shapes"]:
        if not isinstance(group, dict):
            raise BadInput(f"{path}: param_shapes is not a list of name -> shape maps; the file is corrupt")
        groups.append({str(name): _shape(shape, path, name) for name, shape in group.items()})
    return groups


def _shape(shape, path: str, name) -> tuple[int, ...]:
    dims = as_dims(shape)
    if dims is None:
        raise BadInput(f"{path}: the shape of {name} is {shape!r}, not a list of sizes; the file is corrupt")
    return dims


def _rank_groups(files: RankFiles, key: str, sources: StorageSources) -> list[list[tuple[int, int, int]]]:
    """Per rank, per group: (source, offset, length) of the saved flat fp32 partition."""
    out = []
    for path, state in files.optim:
        groups = state.get(key)
        if not isinstance(groups, (list, tuple)):
            raise BadInput(f"{path}: no {key} list; not a ZeRO stage {files.stage} optimizer file or a corrupt one")
        pieces = []
        for g, tensor in enumerate(groups):
            tensor = flat_partition(tensor, path, f"{key}[{g}]")
            pieces.append((sources.index(path, tensor), tensor.offset, tensor.shape[0]))
        if out and len(pieces) != len(out[0]):
            raise BadInput(f"{path}: {len(pieces)} parameter groups but {files.optim[0][0]} has {len(out[0])}")
        out.append(pieces)
    return out


def _stage12_trained(files: RankFiles, sources: StorageSources) -> dict[str, TensorPlan]:
    model_path, model = files.model[0]
    shapes = _group_shapes(model, model_path)
    ranks = _rank_groups(files, "single_partition_of_fp32_groups", sources)
    if len(shapes) != len(ranks[0]):
        raise BadInput(
            f"{model_path}: param_shapes lists {len(shapes)} groups but the optimizer files hold {len(ranks[0])}"
        )
    dtype = _partition_dtype(files, "single_partition_of_fp32_groups")
    alignment = _alignment_paddings(files, shapes)
    out = {}
    for g, group in enumerate(shapes):
        _check_partition_sizes(files, g, [rank[g][2] for rank in ranks])
        if files.autoep is not None and _expert_group(files, g):  # each rank's own experts, whole
            out.update(
                expert_tensors(files.autoep, model_path, group, [rank[g] for rank in ranks], alignment[g], dtype)
            )
            continue
        if files.native_moe is not None and _expert_group(files, g):
            out.update(_native_experts(files, g, model_path, group, [rank[g] for rank in ranks], alignment[g], dtype))
            continue
        flat = FlatRuns([rank[g] for rank in ranks])
        paddings = alignment[g]
        offset = 0
        for (name, shape), padding in zip(group.items(), paddings):
            numel = prod(shape)
            if offset + numel > flat.numel:
                raise _mismatch(files, model_path, f"group {g} ends at element {flat.numel}, inside {name}")
            out[name] = TensorPlan(name, shape, dtype, dtype, flat.extents(offset, numel, 0))
            offset += numel + padding
        if offset != flat.numel:
            raise _mismatch(
                files,
                model_path,
                f"its parameters of group {g} fill {offset} elements, the partitions hold {flat.numel}",
            )
    return out


def _native_experts(files: RankFiles, g: int, model_path: str, group, ranks, paddings, dtype) -> dict:
    """A deepspeed.moe expert group partitioned over fewer ranks than the dense ones: each rank's own experts,
    whole, when every rank is an expert-parallel rank of its own (expert data parallelism 1)."""
    count = files.optim[0][1]["partition_count"][g]
    if count != 1:
        raise BadInput(
            f"{model_path}: DeepSpeed MoE experts sharded over {count} expert-data-parallel ranks each, "
            f"{files.world // count} expert-parallel ranks: not supported yet (expert parallelism of 1 or of every rank is)"
        )
    return native_expert_tensors(files.native_moe, model_path, group, ranks, paddings, dtype)


def _expert_group(files: RankFiles, group: int) -> bool:
    """Whether optimizer group `group` holds experts each expert-parallel rank trains (AutoEP, deepspeed.moe):
    partitioned over fewer ranks than the dense groups."""
    counts = files.optim[0][1].get("partition_count")
    return isinstance(counts, (list, tuple)) and len(counts) > group and counts[group] != files.world


def _alignment_paddings(files: RankFiles, shapes: list[dict]) -> list[tuple[int, ...]]:
    """Per group, the padding after each parameter (stage 1/2); none recorded: no padding."""
    path, state = files.optim[0]
    alignment = state.get("param_alignment_paddings")
    if alignment is None:
        return [(0,) * len(group) for group in shapes]
    groups = [as_dims(paddings) for paddings in alignment] if isinstance(alignment, (list, tuple)) else None
    if groups is None or len(groups) != len(shapes) or any(p is None for p in groups):
        raise BadInput(
            f"{path}: param_alignment_paddings is not one list of paddings per parameter group "
            f"({len(shapes)} groups); the file is corrupt"
        )
    for g, (paddings, group) in enumerate(zip(groups, shapes)):
        if len(paddings) != len(group):
            raise BadInput(
                f"{path}: {len(paddings)} alignment paddings for the {len(group)} parameters of group {g}; the file is corrupt"
            )
    return groups


def _check_partition_sizes(files: RankFiles, group: int, saved: list[int]) -> None:
    """Stage 1/2: every rank's partition is the same size once its end padding (stripped when saving) is counted."""
    full = []
    for (_path, state), length in zip(files.optim, saved):
        paddings = state.get("group_paddings")
        padding = paddings[group] if isinstance(paddings, (list, tuple)) and len(paddings) > group else 0
        full.append(length + (padding if is_count(padding) else 0))
    if len(set(full)) != 1:
        rank = next(r for r, size in enumerate(full) if size != full[0])
        raise BadInput(
            f"{files.optim[rank][0]}: its partition of group {group} holds {full[rank]} elements with padding, "
            f"rank 0's {full[0]}; partition sizes disagree, the files come from different runs or are corrupt"
        )


def _stage3_trained(files: RankFiles, sources: StorageSources) -> dict[str, TensorPlan]:
    model_path, model = files.model[0]
    shapes = {}
    for group in _group_shapes(model, model_path):
        for name, shape in group.items():
            if name in shapes:
                raise BadInput(f"{model_path}: {name} is listed in two parameter groups; the file is corrupt")
            shapes[name] = shape
    ranks = [FlatRuns(pieces) for pieces in _rank_groups(files, "fp32_flat_groups", sources)]
    for rank, flat in enumerate(ranks):
        if flat.numel != ranks[0].numel:
            raise BadInput(
                f"{files.optim[rank][0]}: holds {flat.numel} fp32 elements, rank 0 holds {ranks[0].numel}; "
                "partition sizes disagree, the files come from different runs or are corrupt"
            )
    dtype = _partition_dtype(files, "fp32_flat_groups")
    out, offset = {}, 0
    for name, shape in shapes.items():
        numel = prod(shape)
        piece = -(-numel // files.world)  # ceil, in integers: floats round above 2**53
        if offset + piece > ranks[0].numel:
            raise _mismatch(files, model_path, f"each rank's partition ends at element {ranks[0].numel}, inside {name}")
        extents = []
        for rank, flat in enumerate(ranks):
            count = max(0, min(piece, numel - rank * piece))
            extents += flat.extents(offset, count, rank * piece)
        out[name] = TensorPlan(name, shape, dtype, dtype, extents)
        offset += piece
    if offset != ranks[0].numel:
        raise _mismatch(
            files,
            model_path,
            f"its parameters fill {offset} elements of each rank's partition, which holds {ranks[0].numel}",
        )
    return out


def _mismatch(files: RankFiles, model_path: str, detail: str) -> BadInput:
    return BadInput(
        f"{model_path}: param_shapes disagrees with the partitions in the optimizer files ({detail}); "
        "the files come from different runs or are corrupt"
    )


def _partition_dtype(files: RankFiles, key: str) -> str:
    dtypes = {t.dtype for _, state in files.optim for t in state[key] if isinstance(t, TensorRef)}
    if len(dtypes) != 1:
        raise BadInput(f"{files.optim[0][0]}: {key} mixes dtypes {sorted(dtypes)}; the files are corrupt")
    return dtypes.pop()


def _frozen(files: RankFiles, sources: StorageSources, trained: set[str]) -> tuple[dict[str, TensorPlan], str]:
    model_path, model = files.model[0]
    shapes = model.get("frozen_param_shapes")
    if isinstance(shapes, dict) and shapes:
        shapes = {str(name): _shape(shape, model_path, name) for name, shape in shapes.items()}
        if files.stage == 3:
            return _stage3_frozen(files, sources, shapes), "from each rank's frozen_param_fragments"
        return _whole_tensors(
            model_path, model.get("frozen_param_fragments"), shapes, sources, "frozen_param_fragments"
        ), "from frozen_param_fragments"
    if files.stage == 3:
        return {}, ""
    # Stage 1 saves no frozen fragments; the module state dict holds every parameter whole.
    skip = trained | set(_buffer_names(model, model_path)) | set(_shared_params(model, model_path))
    module = model["module"]
    names = {str(n): tuple(t.shape) for n, t in module.items() if str(n) not in skip and isinstance(t, TensorRef)}
    found = _whole_tensors(model_path, module, names, sources, "module")
    return found, (
        f"from the module state dict (stage {files.stage} saves no frozen fragments; "
        "DeepSpeed's zero_to_fp32 leaves them out)"
    )


def _whole_tensors(
    path: str, holder, shapes: dict[str, tuple[int, ...]], sources: StorageSources, what: str
) -> dict[str, TensorPlan]:
    out = {}
    for name, shape in shapes.items():
        tensor = holder.get(name) if isinstance(holder, dict) else None
        if not isinstance(tensor, TensorRef):
            raise BadInput(f"{path}: {what} has no tensor for {name}; the file is corrupt")
        if prod(tensor.shape) != prod(shape) or not tensor.is_contiguous():
            raise BadInput(
                f"{path}: {what}[{name}] is {list(tensor.shape)}, not the {list(shape)} recorded; the file is corrupt"
            )
        if tensor.offset + prod(shape) > tensor.storage.numel:
            raise BadInput(f"{path}: {name} reaches past the end of its storage; the file is corrupt")
        extents = [Extent(sources.index(path, tensor), tensor.offset, prod(shape), 0)] if prod(shape) else []
        out[name] = TensorPlan(name, shape, tensor.dtype, tensor.dtype, extents)
    return out


def _stage3_frozen(
    files: RankFiles, sources: StorageSources, shapes: dict[str, tuple[int, ...]]
) -> dict[str, TensorPlan]:
    out = {}
    for name, shape in shapes.items():
        numel = prod(shape)
        piece = -(-numel // files.world)
        extents, dtypes = [], set()
        for rank, (path, model) in enumerate(files.model):
            fragments = model.get("frozen_param_fragments")
            tensor = fragments.get(name) if isinstance(fragments, dict) else None
            if not isinstance(tensor, TensorRef):
                raise BadInput(f"{path}: frozen_param_fragments has no piece of {name}; the file is corrupt")
            tensor = flat_partition(tensor, path, f"the frozen piece of {name}")
            if tensor.shape[0] != piece:
                raise BadInput(
                    f"{path}: the frozen piece of {name} holds {tensor.shape[0]} elements; ceil({numel} / {files.world}) "
                    f"is {piece}; partition sizes disagree, the files come from different runs or are corrupt"
                )
            count = max(0, min(piece, numel - rank * piece))
            if count:
                extents.append(Extent(sources.index(path, tensor), tensor.offset, count, rank * piece))
            dtypes.add(tensor.dtype)
        if len(dtypes) != 1:
            raise BadInput(f"{files.model[0][0]}: the pieces of frozen {name} differ in dtype {sorted(dtypes)}")
        dtype = dtypes.pop()
        out[name] = TensorPlan(name, shape, dtype, dtype, extents)
    return out


def _buffers(files: RankFiles, sources: StorageSources) -> dict[str, TensorPlan]:
    path, model = files.model[0]
    names = _buffer_names(model, path)
    module = model["module"]
    shapes = {}
    for name in names:
        if not isinstance(module.get(name), TensorRef):
            raise BadInput(
                f"{path}: buffer {name} is named in buffer_names but missing from the module state dict; the file is corrupt"
            )
        shapes[name] = tuple(module[name].shape)
    return _whole_tensors(path, module, shapes, sources, "module")


def _aliases(
    shared: dict[str, str], planned: dict[str, TensorPlan], notes: list[str], excluded: dict[str, TensorPlan]
) -> list[TensorPlan]:
    """Each shared name reads its partner's bytes; prepare writes such names once and lists them as tied."""
    out = []
    for alias, owner in shared.items():
        if owner in excluded:
            notes.append(f"not merged: {alias}, shared with the frozen {owner}, left out with it")
            continue
        if owner not in planned:
            notes.append(f"not merged: {alias}, shared with {owner}, which the checkpoint does not hold")
            continue
        source = planned[owner]
        out.append(TensorPlan(alias, source.shape, source.source_dtype, source.target_dtype, list(source.extents)))
    return out


def _dtypes(tensors: dict[str, TensorPlan]) -> str:
    return ", ".join(sorted({t.source_dtype for t in tensors.values()}))


def _config_dir(tag_dir: str, folder: str) -> str | None:
    """config.json next to the tag folder (a Hugging Face Trainer's checkpoint-N/), or in a huggingface/ there."""
    for base in dict.fromkeys([os.path.dirname(os.path.normpath(tag_dir)), folder, tag_dir]):
        for candidate in (base, os.path.join(base, "huggingface")):
            if os.path.isfile(os.path.join(candidate, "config.json")):
                return candidate
    return None


READER = Reader(
    NAME,
    DESCRIPTION,
    sniff=matches,
    read=read,
    options=(
        ReaderOption("tag", "the checkpoint tag (default: the one `latest` names)"),
        ReaderOption(
            "exclude_frozen",
            "leave out frozen parameters (requires_grad False), as DeepSpeed's zero_to_fp32 "
            "--exclude_frozen_parameters does",
            kind="flag",
        ),
    ),
)
