"""The Hub layout of a live model's tensors (fsdpfast.save_pretrained), from names and shapes alone.

The offline merge applies the family transforms (families.transform) to a plan whose extents say
where every element is; a live save plans on every rank from metadata, and each rank writes its own
piece. So here each state-dict tensor becomes the tensors the Hub layout writes of it, each with the
window of the state-dict tensor it is (an expert's rows) and whether it is written transposed: the
same names, shapes and boxes as HubPrefixes and HubLayout give the offline merge, which live.plan
then cuts out of each rank's piece.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hub_experts import _PACKED, expert_names, hub_parts, is_transposed
from .hub_prefixes import hub_name, rules_for


@dataclass(frozen=True)
class HubTensor:
    """A tensor the Hub layout writes, cut from the state-dict tensor `source`."""

    name: str
    shape: tuple[int, ...]
    source: str  # the state-dict tensor's (clean) name
    offsets: tuple[int, ...] | None = None  # the box of `source` it is (None: all of it)
    sizes: tuple[int, ...] | None = None
    transposed: bool = False  # written with its last two dimensions swapped (shape is the written one)


def hub_tensors(name: str, shape: tuple[int, ...], config: dict, expert_layout: str = "hub") -> list[HubTensor]:
    """What state-dict tensor `name` of `shape` is written as, for the model config.json describes."""
    renamed = hub_name(name, rules_for(config))
    if expert_layout == "packed":
        return [HubTensor(renamed, shape, name)]
    if is_transposed(config) and _PACKED.fullmatch(renamed) and len(shape) == 3:
        return [HubTensor(renamed, (shape[0], shape[2], shape[1]), name, (0, 0, 0), tuple(shape), transposed=True)]
    names = expert_names(config)
    if names is None:
        return [HubTensor(renamed, shape, name)]
    parts = hub_parts(renamed, shape, names)
    if isinstance(parts, str):
        return [HubTensor(parts, shape, name)]
    return [HubTensor(part, part_shape, name, window.offsets, window.sizes) for part, part_shape, window in parts]
