"""Plain tensors in the files of several ranks that hold no DTensor: whole copies, or pieces.

A plain tensor does not record how it was split. `to_local()` pieces of a parameter sharded
on dim 0 or on dim 1 (FSDP2's shard_placement_fn), a buffer every rank holds whole, and a DDP or
full-state-dict save (every tensor whole on every rank) look alike in the files. So each tensor
is placed by the model's own shape when config.json is known (and transformers can build its
class): pieces of that shape are whole copies, which must agree; others are torch.chunk pieces
along the one dimension that rebuilds it. Without the model's shapes only copies that agree on
every rank (same shape, same bytes) are accepted; anything else is refused, not guessed.
"""

from __future__ import annotations

from ..errors import BadInput, option
from ..geometry.boxes import box_extents
from ..geometry.local_pieces import local_piece, local_source, whole_copies
from ..geometry.placements import chunk_span
from ..plan.model import Copy, TensorPlan
from ..plan.model_check import load_expected_model, match_names
from .storage_sources import StorageSources


def expected_shapes(config_dir: str | None, names: list[str]) -> tuple[dict[str, tuple] | None, str]:
    """({checkpoint name: the model's shape for it, or None if the model lacks it}, "") or (None, why not)."""
    from ..plan.normalise import clean_name  # prepare reads plans; imported here to keep the readers' imports light

    model, why_not = load_expected_model(config_dir)
    if model is None:
        return None, why_not
    cleaned = {name: clean_name(name) for name in names}
    mapping = match_names(sorted(set(cleaned.values())), model)
    return {name: model.shapes.get(mapping[clean]) for name, clean in cleaned.items()}, ""


def plan_plain_tensors(
    names: list[str], states, config_dir: str | None, sources: StorageSources
) -> tuple[list[TensorPlan], list[Copy], list[str]]:
    """(tensor plans, copies to compare, notes) for a checkpoint of several ranks without DTensors."""
    shapes, why_not = expected_shapes(config_dir, names)
    tensors, copies, whole, split = [], [], 0, {}
    for name in names:
        pieces = [(s, s.tensors[name]) for s in states]
        expected = shapes.get(name) if shapes is not None else None
        if shapes is None:
            unknown = (
                f"the model's shapes are unknown ({why_not}); give the model's config.json with {option('config', meta='DIR')}, "
                "with transformers installed"
            )
        else:
            unknown = (
                f"{name} is not in the model config.json describes, so its shape is unknown; "
                f"if it belongs to the model, give the trained model's config.json with {option('config', meta='DIR')}"
            )
        tensor, dim = _place(name, pieces, expected, unknown, sources, copies)
        tensors.append(tensor)
        if dim is None:
            whole += 1
        else:
            split[dim] = split.get(dim, 0) + 1
    world = len(states)
    if not split:
        notes = [
            f"every rank holds the whole model (a DDP or full-state-dict save): each of the {world} rank files "
            f"holds every tensor whole; merged from rank {states[0].rank}'s file, the others compared with it"
        ]
    else:
        dims = ", ".join(f"{count} along dim {dim}" for dim, count in sorted(split.items()))
        notes = [
            f"plain pieces (to_local()) placed by the model's shapes from config.json: {dims}"
            + (f"; {whole} tensors every rank holds whole, compared across ranks" if whole else "")
        ]
    return tensors, copies, notes


def _place(name: str, pieces, expected, unknown: str, sources: StorageSources, copies: list[Copy]):
    """(the tensor's plan, the dimension its pieces were concatenated along or None if whole)."""
    first_state, first = pieces[0]
    for state, value in pieces[1:]:
        if value.dtype != first.dtype:
            raise BadInput(
                f"{state.path}: plain tensor {name} is {value.dtype} but {first.dtype} in {first_state.path}; "
                "the pieces of one tensor must share a dtype"
            )
    shapes = [tuple(value.shape) for _, value in pieces]
    if expected is None:
        if any(shape != shapes[0] for shape in shapes):
            raise BadInput(
                f"{first_state.path}: plain tensor {name} has shapes {_listed(shapes)} on the {len(pieces)} ranks: "
                f"pieces that do not record the dimension they were split along; {unknown}"
            )
        copies += whole_copies(
            name,
            pieces,
            sources,
            problem=(
                "the files do not record whether these are whole copies (which must agree) or pieces split along some "
                f"dimension; {unknown}"
            ),
        )
        return local_piece(first_state, name, first, sources), None
    if all(shape == tuple(expected) for shape in shapes):
        copies += whole_copies(name, pieces, sources)
        return local_piece(first_state, name, first, sources), None
    dims = [d for d in range(len(expected)) if _concatenate_to(shapes, tuple(expected), d)]
    if len(dims) != 1:
        _refuse_pieces(name, pieces, tuple(expected))
    dim = dims[0]
    extents = []
    for index, (state, value) in enumerate(pieces):
        want_start, length = chunk_span(expected[dim], len(pieces), index)
        if value.shape[dim] != length:
            raise BadInput(
                f"{state.path}: the piece of {name} has {value.shape[dim]} along dim {dim}; torch.chunk of "
                f"{expected[dim]} over {len(pieces)} ranks gives rank {state.rank} {length}"
            )
        source, offset = local_source(state, name, value, sources)
        offsets = tuple(want_start if d == dim else 0 for d in range(len(expected)))
        extents += box_extents(source, offset, tuple(expected), offsets, tuple(value.shape))
    return TensorPlan(name, tuple(expected), first.dtype, first.dtype, extents), dim


def _refuse_pieces(name: str, pieces, expected: tuple) -> None:
    """No one dimension rebuilds the model's shape: name the first piece that does not fit the split most
    pieces fit (torch.chunk of the model's shape along some dimension), or every shape if none fits."""

    def chunk_shape(dim: int, index: int) -> tuple:
        return tuple(chunk_span(size, len(pieces), index)[1] if d == dim else size for d, size in enumerate(expected))

    fits = {
        dim: [tuple(value.shape) == chunk_shape(dim, i) for i, (_, value) in enumerate(pieces)]
        for dim in range(len(expected))
    }
    best = max(fits, key=lambda dim: sum(fits[dim]), default=None)
    if best is not None and any(fits[best]) and not all(fits[best]):
        index = fits[best].index(False)
        state, value = pieces[index]
        raise BadInput(
            f"{state.path}: the piece of {name} is {list(value.shape)}, but the other ranks' pieces split the "
            f"model's shape {list(expected)} along dim {best}, which gives rank {state.rank} "
            f"{list(chunk_shape(best, index))}; the file does not belong with the others, or config.json "
            f"does not describe the trained model ({option('config', meta='DIR')})"
        )
    state = pieces[0][0]
    raise BadInput(
        f"{state.path}: the pieces of {name} ({_listed([tuple(v.shape) for _, v in pieces])} on the "
        f"{len(pieces)} ranks) do not make the model's shape {list(expected)} along any one dimension; "
        f"check that config.json describes the trained model ({option('config', meta='DIR')})"
    )


def _concatenate_to(shapes: list[tuple], expected: tuple, dim: int) -> bool:
    """True if the pieces, laid end to end along `dim`, have the shape `expected`."""
    if any(len(shape) != len(expected) for shape in shapes):
        return False
    if any(shape[d] != expected[d] for shape in shapes for d in range(len(expected)) if d != dim):
        return False
    return sum(shape[dim] for shape in shapes) == expected[dim]


def _listed(shapes: list[tuple]) -> str:
    shown = ", ".join(str(list(s)) for s in shapes[:4])
    return shown + (", ..." if len(shapes) > 4 else "")
