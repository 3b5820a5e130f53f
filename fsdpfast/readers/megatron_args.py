"""The training args Megatron-LM saves in a checkpoint's common.pt: config.json is checked against
them, or built from them when no config.json is given (readers.megatron_config).

Megatron-LM (and NeMo, verl) put their argparse `args` in the checkpoint's common state, beside
`iteration` and `checkpoint_version`; `dist_checkpointing.save` writes that common state to
common.pt with torch.save. The args are the model's sizes as the run built it, so a config.json
that disagrees is not this model's, even where every tensor shape fits (4 heads of 16 and 8 heads
of 8 give the same shapes and different q/k/v splits). common.pt is read with the restricted
unpickler: argparse.Namespace and Megatron's own classes (enums in the args) become inert
records; a common.pt that needs anything else is not read, and the plan says so.
"""

from __future__ import annotations

import os
import pickletools
from dataclasses import dataclass, field

from .._parsing.safe_load import Record, safe_unpickle
from .._parsing.torch_zip import TorchZip
from ..errors import BadInput, UnsafeCheckpoint

COMMON = "common.pt"


@dataclass(frozen=True)
class TrainingArgs:
    """The model's sizes as Megatron-LM's args give them (None: not recorded)."""

    layers: int | None
    hidden: int | None
    heads: int | None
    groups: int | None
    head_dim: int | None
    ffn: int | None
    tied: bool | None
    # Every arg recorded as a plain value (number, string, bool, None, or a tuple of them: window_size),
    # for the config built from them
    recorded: dict = field(default_factory=dict, compare=False)


def read_training_args(folder: str) -> tuple[TrainingArgs | None, str | None]:
    """(the args, None), or (None, a note saying why none were read; None when common.pt holds none)."""
    path = os.path.join(folder, COMMON)
    if not os.path.isfile(path):
        return None, None
    try:
        with TorchZip(path) as archive:
            data = archive.pickle_bytes
        common = safe_unpickle(data, path, _megatron_classes(data))
    except (BadInput, UnsafeCheckpoint) as exc:
        return None, f"{COMMON} not read, its training args unchecked ({str(exc).split(': ', 1)[-1][:160]})"
    args = common.get("args") if isinstance(common, dict) else None
    if not isinstance(args, Record) or args.qualname != "argparse.Namespace":
        return None, None
    return _sizes(args), None


def _megatron_classes(data: bytes) -> frozenset[str]:
    """argparse.Namespace and the megatron.* classes the pickle names, as inert records.

    Names reached through the memo are not seen here: the unpickler then refuses them, and
    common.pt is left unread."""
    names, strings = {"argparse.Namespace"}, []
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                strings.append(arg)
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.add(f"{strings[-2]}.{strings[-1]}")
            elif op.name == "GLOBAL" and isinstance(arg, str):
                names.add(arg.replace(" ", "."))
    except Exception:  # a damaged pickle: the unpickler says so
        pass
    return frozenset(n for n in names if n == "argparse.Namespace" or n.startswith("megatron."))


def _sizes(args: Record) -> TrainingArgs:
    def whole(key):
        value = args.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    heads = whole("num_attention_heads")
    groups = whole("num_query_groups") if args.get("group_query_attention") else heads
    head_dim = whole("kv_channels")
    hidden = whole("hidden_size")
    if head_dim is None and hidden and heads:
        head_dim = hidden // heads  # Megatron's default kv_channels
    untie = args.get("untie_embeddings_and_output_weights")
    plain = {key: value for key, value in args.state.items() if isinstance(key, str) and _plain(value)}
    return TrainingArgs(
        whole("num_layers"),
        hidden,
        heads,
        groups,
        head_dim,
        whole("ffn_hidden_size"),
        (not untie) if isinstance(untie, bool) else None,
        plain,
    )


def _plain(value) -> bool:
    """A value of the built-in kinds only (not a stand-in record that subclasses one, as a dtype's does)."""
    if type(value) in (tuple, list):
        return all(_plain(v) for v in value)
    return value is None or type(value) in (bool, int, float, str)
