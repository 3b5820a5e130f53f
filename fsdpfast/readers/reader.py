"""What every checkpoint reader offers the rest of fsdpfast: one `Reader` per layout.

A reader module ends with `READER = Reader(...)`; readers/__init__.py lists them, and the command
line's layout options and --help are generated from that list, so a new layout is one module and
one line there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..plan.model import MergePlan


@dataclass(frozen=True)
class ReaderOption:
    """An option of one layout, as `read(folder, name=value)` takes it and the command line offers it.

    kind: "value" (--tag TAG), "flag" (--exclude-frozen) or "switch" (--use-orig-params / --no-use-orig-params).
    internal: recorded by a merge and given back by verify --against, never typed by a user.
    """

    name: str
    help: str
    kind: str = "value"
    internal: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class Reader:
    """One checkpoint layout.

    sniff(folder): whether the folder holds this layout, from file names (and, where names alone
        cannot tell, a file header); cheap, reads no tensor data.
    read(folder, **options): the MergePlan, from metadata only; options are this reader's own
        (None: not given), plus `config` (the --config folder) when `reads_config`, and `lora_r`
        (--lora-r, when given) when `takes_lora_r`.
    """

    name: str
    description: str
    sniff: Callable[[str], bool]
    read: Callable[..., MergePlan]
    options: tuple[ReaderOption, ...] = ()
    reads_config: bool = False  # reads config.json itself: to rebuild the model, or to place plain pieces
    takes_lora_r: bool = False  # rebuilds a PEFT model, and takes --lora-r for it where the files do not show the rank
