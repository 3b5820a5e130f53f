"""fsdpfast: merge sharded training checkpoints into a Hugging Face safetensors folder, bit for bit.

Distributed training leaves one file per rank: FSDP / FSDP2 rank files of DTensors (verl),
torch.distributed.checkpoint folders, DeepSpeed ZeRO stage 1-3 checkpoints, FSDP1 flat
parameters. fsdpfast reads only their metadata (no code from a checkpoint ever runs), plans
where every byte of every tensor goes, and streams the bytes into model.safetensors (or shards
and an index) identical to the unsharded model. The output folder appears complete or not at
all, with fsdpfast-manifest.json (every tensor's CRC-32C) for a later `verify`. Sources are
never modified.

    import fsdpfast

    report = fsdpfast.merge("checkpoints/global_step_100/actor", "merged", dtype="bf16")
    print(report.summary())
    check = fsdpfast.verify("merged", against="checkpoints/global_step_100/actor")
    assert check.ok, check.summary()

Functions:
    merge(src, dst, ...)    merge a checkpoint folder into a Hugging Face folder; a MergeReport
                            (group=pg: several processes share the work, as under torchrun)
    verify(out_dir, ...)    check a merged folder (manifest, shards, a reference); a VerifyReport
    inspect(src, ...)       what a checkpoint holds and a merge would write, as JSON-able data
    plan_merge(src, ...)    the MergePlan (every tensor's pieces), from metadata alone
    save_pretrained(model, out_dir, ...)
                            on every rank of a job: a Hugging Face folder written straight from a
                            live FSDP2 or FSDP1 model, no gather; a SaveReport (background=True:
                            a handle at once, the files written while training goes on; wait())

Layout options, keyword arguments of all four, each for one layout: prefix (dcp), tag and
exclude_frozen (deepspeed-zero), wrap and use_orig_params (fsdp1-flat).

Errors (all FsdpfastError, with a one-line message that says what was found and what to do):
    BadInput          the checkpoint, an argument or the output folder is not usable as given;
                      also a ValueError
    UnsafeCheckpoint  a pickle asked for code or classes a checkpoint never needs (a BadInput)
    SourceChanged     a source file changed while it was merged (a trainer still writing)

The command line does the same: `fsdpfast merge|inspect|verify|watch|demo --help`; `fsdpfast watch`
publishes every checkpoint a training run completes.
"""

from ._version import __version__
from .api import MergeReport, inspect, merge, plan_merge
from .errors import BadInput, FsdpfastError, UnsafeCheckpoint
from .live.save import SaveReport, save_pretrained
from .manifest import SourceChanged
from .verify import VerifyReport, verify

__all__ = [
    "merge",
    "inspect",
    "plan_merge",
    "verify",
    "save_pretrained",
    "MergeReport",
    "VerifyReport",
    "SaveReport",
    "FsdpfastError",
    "BadInput",
    "UnsafeCheckpoint",
    "SourceChanged",
    "__version__",
]
