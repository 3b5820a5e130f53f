"""Where an output folder may be: never equal to, above or inside a folder the merge reads."""

from __future__ import annotations

import os

from ..errors import BadInput, on_command_line


def check_output_place(out_dir: str, checkpoint: str, config: str | None) -> None:
    """Refuse an OUT_DIR equal to, above or inside the checkpoint or --config folder.

    Replacing or containing a source would destroy it; inside one, nothing would be overwritten
    file by file, but a later merge of the checkpoint would find the output among the shards, and
    --overwrite of a folder inside them would delete part of a source: fsdpfast never writes into
    what it reads. Symbolic links and dot segments are resolved first.
    """
    out = os.path.realpath(out_dir)
    for role, folder in (("checkpoint", checkpoint), ("--config" if on_command_line() else "config", config)):
        if folder is None:
            continue
        source = os.path.realpath(folder)
        if _within(source, out):
            raise BadInput(
                f"{out_dir}: the output folder would replace or contain the {role} folder {folder}; "
                "fsdpfast never writes into its inputs, choose a folder outside it"
            )
        if _within(out, source):
            raise BadInput(
                f"{out_dir}: the output folder is inside the {role} folder {folder}; "
                "fsdpfast never writes into its inputs, choose a folder outside it"
            )


def _within(path: str, folder: str) -> bool:
    """`path` is `folder` or below it (both resolved)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)
