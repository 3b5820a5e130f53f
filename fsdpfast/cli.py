"""Command line: `fsdpfast merge`, `inspect`, `verify`, `watch`, `demo`. Errors are one line and an exit status.

Exit status: 0 ok, 2 bad input, 3 verify found a mismatch, 1 anything else (fsdpfast.errors).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from dataclasses import asdict

from . import __version__, readers
from .errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_MISMATCH,
    BadInput,
    FsdpfastError,
    command_line_messages,
    out_of_files,
)
from .remote.urls import is_remote


class _OneLineParser(argparse.ArgumentParser):
    """Command-line mistakes are one line and exit status 2, like every other bad input."""

    def error(self, message):
        self.exit(EXIT_BAD_INPUT, f"fsdpfast: error: {message} (see '{self.prog} --help')\n")


class _VersionAction(argparse.Action):
    """--version: the version and which engines this install has (the build's reason when CUDA ops are missing)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from . import _ops

        native = "built" if _ops.native_cpu() else f"missing ({_ops.NATIVE_ERROR})"
        cuda = (
            f"built against torch {_ops.TORCH_BUILT}"
            if _ops.CUDA_OPS
            else f"not built ({_ops.CUDA_SKIPPED or 'unknown'})"
        )
        _emit(f"fsdpfast {__version__}: native cpu engine {native}; CUDA ops {cuda}")
        parser.exit(0)


_DTYPES = (
    "keep (default), bf16, fp16 or fp32 (or torch's names bfloat16, float16, float32); only floating tensors are cast; "
    "fp8 (or fp8-block): linear weights in block-scaled float8_e4m3fn, the rest bf16 (docs/usage.md)"
)
_MERGE_EXAMPLES = """examples:
  fsdpfast merge checkpoints/global_step_100/actor --out merged
  fsdpfast merge ckpt --out merged --dtype bf16 --max-shard-size 2GB
  fsdpfast merge ds_checkpoint --out merged --tag global_step500 --exclude-frozen
  fsdpfast merge ckpt --out merged --dry-run          # the plan; writes nothing

several processes, one merge (each node writes its share into one shared --out folder):
  torchrun --nproc-per-node 8 -m fsdpfast merge ckpt --out merged
  torchrun --nnodes 4 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
      -m fsdpfast merge /shared/ckpt --out /shared/merged --timeout 300
  Every process gets the same arguments; CKPT and --out must be the same folders on a filesystem
  all of them share. Rank 0 plans and publishes; each process writes its share of the bytes
  (files split at 1 MiB boundaries where a share ends inside one). Any rank's failure stops all
  and publishes nothing. The output and its manifest are those of a single-process merge.

layouts (detected; --layout forces one):
""" + "\n".join(f"  {name:<15} {reader.description}" for name, reader in readers.READERS.items())
_INSPECT_EXAMPLES = """examples:
  fsdpfast inspect checkpoints/global_step_100/actor
  fsdpfast inspect ds_checkpoint --tag global_step500 --json"""
_VERIFY_EXAMPLES = """examples:
  fsdpfast verify merged                              # checksums against the manifest; needs no sources
  fsdpfast verify merged --against checkpoints/global_step_100/actor
  fsdpfast verify merged --reference hf_export --atol 1e-6
  fsdpfast verify merged --manifest earlier_merge --smoke

exit status: 0 all checks passed, 3 a mismatch, 2 bad input"""
_WATCH_EXAMPLES = """examples:
  fsdpfast watch checkpoints --out hf --dtype bf16          # every 30 s until stopped (SIGTERM)
  fsdpfast watch checkpoints --out hf --once                # what is complete now, then exit
  fsdpfast watch checkpoints --out hf --keep-last 3 --then ./eval.sh --json
  fsdpfast watch checkpoints --out hf --nproc-per-merge 8  # each merge by 8 processes (torchrun)
  fsdpfast watch s3://ckpt/run --out s3://models/run       # a run in an object store, listed each look

exit status (--once): 0 every complete checkpoint published, 2 one was refused, 1 one failed"""
_DEMO_EXAMPLES = """examples:
  fsdpfast demo
  fsdpfast demo --world-size 2 --workdir /tmp/fsdpfast-demo   # keep the files"""


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="fsdpfast",
        description="Merge sharded training checkpoints into a Hugging Face safetensors folder.",
        epilog="exit status: 0 done, 2 bad input, 3 verify found a mismatch, 1 anything else; "
        "'fsdpfast COMMAND --help' shows examples",
    )
    parser.add_argument("--version", action=_VersionAction, help="show the version and which engines this install has")
    verbs = parser.add_subparsers(dest="verb", required=True, parser_class=_OneLineParser)
    examples = dict(formatter_class=argparse.RawDescriptionHelpFormatter)
    layouts = ", ".join(readers.READERS)

    merge = verbs.add_parser(
        "merge",
        help="merge a checkpoint folder into a Hugging Face model folder",
        epilog=_MERGE_EXAMPLES,
        description="Merge a sharded checkpoint folder into a Hugging Face safetensors folder, bit for bit.",
        **examples,
    )
    merge.add_argument("checkpoint", help="folder holding the rank files")
    merge.add_argument(
        "--out",
        required=True,
        help="output folder; created with its parents, or an empty folder replaced "
        "(an earlier merge only with --overwrite)",
    )
    _add_merge_options(merge)
    merge.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="under torchrun: how long a process waits for the others at each step before all give up (default 600)",
    )
    merge.add_argument("--json", action="store_true", help="print the report as JSON")
    merge.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (files, each tensor's file, offset, bytes) and write nothing",
    )
    merge.add_argument("--quiet", action="store_true", help="no progress bar (it shows only on a terminal anyway)")
    merge.add_argument(
        "-v", "--verbose", action="store_true", help="log each decision (layout, engine, tensor -> file) on stderr"
    )

    inspect = verbs.add_parser(
        "inspect",
        help="show what a checkpoint folder holds and what a merge would write",
        description="Show a checkpoint's layout, ranks, every tensor and the totals, from metadata alone.",
        epilog=_INSPECT_EXAMPLES,
        **examples,
    )
    inspect.add_argument("checkpoint", help="folder holding the rank files")
    inspect.add_argument(
        "--layout", default=None, metavar="NAME", help=f"force a layout instead of detecting it: {layouts}"
    )
    inspect.add_argument("--config", default=None, help="folder with config.json (default CHECKPOINT/huggingface)")
    _add_layout_options(inspect)
    inspect.add_argument("--allow-extra-tensors", action="store_true", help="as for merge")
    inspect.add_argument("--expert-layout", choices=("hub", "packed"), default="hub", help="as for merge")
    _add_lora_options(inspect, _LORA_NUMBERS)
    inspect.add_argument("--json", action="store_true", help="print JSON for machines")
    _add_storage_option(inspect)

    verify = verbs.add_parser(
        "verify",
        help="check a merged folder (manifest, shards or a reference); exit 3 on a mismatch",
        description="Check a merged folder against its manifest (default), the shards, a reference "
        "folder or another merge's manifest.",
        epilog=_VERIFY_EXAMPLES,
        **examples,
    )
    verify.add_argument("out_dir", help="the merged folder")
    verify.add_argument(
        "--against",
        metavar="CKPT_DIR",
        default=None,
        help="recompute every tensor from the shards and compare bit for bit",
    )
    verify.add_argument(
        "--reference",
        metavar="HF_DIR",
        default=None,
        help="compare with another safetensors folder, exact unless --rtol/--atol",
    )
    verify.add_argument(
        "--rtol", type=float, default=None, help="relative tolerance for --reference (compared in float64)"
    )
    verify.add_argument("--atol", type=float, default=None, help="absolute tolerance for --reference")
    verify.add_argument(
        "--manifest",
        metavar="FILE_OR_DIR",
        default=None,
        help="another merge's manifest (e.g. an earlier merge of the same checkpoint): the checksums must match",
    )
    verify.add_argument(
        "--smoke",
        action="store_true",
        help="load with transformers and run one forward pass (finite outputs, right shapes)",
    )
    verify.add_argument(
        "--layout", default=None, metavar="NAME", help=f"--against: force the checkpoint layout: {layouts}"
    )
    verify.add_argument(
        "--read-mode",
        default="auto",
        help="--against: how the checkpoint is read, as in merge: auto (default), mmap or pread",
    )
    _add_layout_options(verify, "--against: ")
    verify.add_argument("--json", action="store_true", help="print the report (every mismatch) as JSON")
    _add_storage_option(verify)

    watch = verbs.add_parser(
        "watch",
        help="publish every checkpoint a training run completes as a Hugging Face folder, once each",
        description="Watch a training run's checkpoint folder and merge each checkpoint once it is complete "
        "(never one still being written) into OUT_ROOT/<its name>, with the options of merge.",
        epilog=_WATCH_EXAMPLES,
        **examples,
    )
    watch.add_argument(
        "run_dir",
        help="the run's checkpoint folder (verl, Megatron, DeepSpeed, Trainer, torchtitan, DCP), or its prefix "
        "in an object store (s3://, gs://, az://)",
    )
    watch.add_argument("--out", required=True, metavar="OUT_ROOT", help="where each checkpoint's folder is published")
    _add_merge_options(watch)
    watch.add_argument("--once", action="store_true", help="merge what is complete now, then exit")
    watch.add_argument(
        "--interval", type=float, default=30.0, metavar="SECONDS", help="seconds between looks (default 30)"
    )
    watch.add_argument(
        "--keep-last",
        type=int,
        default=None,
        metavar="K",
        help="after each publish, remove all but the K newest outputs fsdpfast merged from this run "
        "(only the files their manifests list)",
    )
    watch.add_argument(
        "--then",
        default=None,
        metavar="CMD",
        help="run CMD on each published folder, its path the last argument (no shell); exit status logged",
    )
    watch.add_argument("--then-shell", action="store_true", help="run --then's CMD with /bin/sh, the folder as $1")
    watch.add_argument("--json", action="store_true", help="one JSON line per event on stdout")
    watch.add_argument(
        "--nproc-per-merge",
        type=int,
        default=1,
        metavar="N",
        help="merge each checkpoint with N processes on this machine (torchrun, as `torchrun --nproc-per-node N "
        "-m fsdpfast merge` does; default 1: in the watcher's process)",
    )
    watch.add_argument(
        "--nnodes",
        type=int,
        default=1,
        metavar="N",
        help="merge each checkpoint on N nodes together, each running this same watch command "
        "(torchrun's c10d rendezvous at --rdzv-endpoint, one per checkpoint; default 1)",
    )
    watch.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="with --nnodes: the rendezvous of the nodes' merges (a node's address and a free port)",
    )

    demo = verbs.add_parser(
        "demo",
        help="write a small real 4-rank FSDP2 checkpoint, merge it and check it bit for bit",
        description="Write a tiny Llama's FSDP2 checkpoint with real gloo ranks, merge it (as it is and "
        "to bf16) and check every tensor and transformers' logits. Needs transformers.",
        epilog=_DEMO_EXAMPLES,
        **examples,
    )
    demo.add_argument(
        "--workdir", default=None, help="where to write (default: a temporary folder, removed afterwards)"
    )
    demo.add_argument(
        "--world-size", type=int, default=4, metavar="N", help="how many ranks write the checkpoint (default 4)"
    )
    return parser


def _add_merge_options(verb) -> None:
    """What decides a merge's output, declared once: `merge` and `watch` take the same."""
    layouts = ", ".join(readers.READERS)
    verb.add_argument("--dtype", default="keep", metavar="DTYPE", help=_DTYPES)
    verb.add_argument(
        "--fp8-skip",
        default=None,
        metavar="PATTERN",
        help="with --dtype fp8: names (fnmatch, comma-separated) left unquantized",
    )
    verb.add_argument(
        "--max-shard-size", default="5GB", help="largest output file, e.g. 500MB, 5GB, 2GiB or bytes (default 5GB)"
    )
    verb.add_argument(
        "--layout", default=None, metavar="NAME", help=f"force a layout instead of detecting it: {layouts}"
    )
    verb.add_argument(
        "--config", default=None, help="folder with config.json and tokenizer files (default CHECKPOINT/huggingface)"
    )
    verb.add_argument(
        "--engine",
        default="auto",
        help="auto (default: the native cpu engine, unless benchmarks/gpu_check.sh "
        "measured another faster on this machine for this kind of cast), cpu, cuda or torch",
    )
    verb.add_argument(
        "--read-mode",
        default="auto",
        help="how sources are read: auto (default: large parallel reads when the checkpoint is on a network "
        "filesystem or FUSE mount, else mapped), mmap or pread",
    )
    _add_layout_options(verb)
    verb.add_argument(
        "--allow-extra-tensors",
        action="store_true",
        help="keep tensors the model class in config.json does not have (e.g. a value head) instead of refusing",
    )
    verb.add_argument(
        "--expert-layout",
        choices=("hub", "packed"),
        default="hub",
        help="MoE experts one tensor per expert, as save_pretrained writes the family (hub, default), "
        "or packed as transformers 5 holds them (packed)",
    )
    _add_lora_options(verb)
    verb.add_argument(
        "--overwrite", action="store_true", help="replace an earlier merge in --out once the new one is complete"
    )
    _add_storage_option(verb)


def _add_layout_options(verb, purpose: str = "") -> None:
    """Each layout's own options, from the readers' registry; verify's default is what the merge recorded."""
    for reader, opt in readers.user_options():
        kinds = {"value": {}, "flag": {"action": "store_true"}, "switch": {"action": argparse.BooleanOptionalAction}}
        verb.add_argument(opt.flag, default=None, help=f"{purpose}{reader.name}: {opt.help}", **kinds[opt.kind])


_LORA_NUMBERS = ("--lora-alpha", "--lora-r")  # what inspect takes of the LoRA flags


def _add_lora_options(verb, only: tuple[str, ...] = ()) -> None:
    """The PEFT LoRA flags (all of them, or `only` those named)."""
    flags = {
        "--merge-lora": dict(
            nargs="?",
            const=True,
            default=None,
            metavar="ADAPTERS",
            help="PEFT LoRA: write one model with the adapter fused in (W + alpha/r * B @ A, as peft's "
            "merge_and_unload) instead of the base model and OUT/lora_adapter; several adapters: name them "
            "in order, e.g. default,second",
        ),
        "--lora-alpha": dict(
            type=float,
            default=None,
            help="PEFT LoRA: the adapters' lora_alpha, where the checkpoint does not record it or its files disagree",
        ),
        "--lora-r": dict(
            type=int,
            default=None,
            help="PEFT LoRA: the adapters' rank r (default: recorded, else the lora_A shapes; it must fit the "
            "lora_A shapes)",
        ),
        "--base": dict(
            metavar="HF_DIR",
            default=None,
            help="PEFT LoRA-only checkpoint (save_lora_only): the base model folder; "
            "writes the fused model and OUT/lora_adapter",
        ),
    }
    for flag, settings in flags.items():
        if not only or flag in only:
            verb.add_argument(flag, **settings)


def _lora_options(args) -> dict:
    """The LoRA flags the verb has, by their keyword names."""
    lora = {name: getattr(args, name) for name in ("merge_lora", "lora_alpha", "lora_r", "base") if hasattr(args, name)}
    alpha = lora.get("lora_alpha")
    if alpha is not None and alpha == int(alpha):
        lora["lora_alpha"] = int(alpha)  # adapter_config.json says 16, as peft writes it, not 16.0
    return lora


def _layout_options(args) -> dict:
    return {opt.name: getattr(args, opt.name) for _, opt in readers.user_options()}


def main(argv: list[str] | None = None) -> int:
    status = _main(argv)
    from .pipeline import processes

    if processes.started_here():  # torchrun: leave without the interpreter's shutdown (see processes.leave)
        processes.leave(status)
    return status


def _add_storage_option(verb) -> None:
    verb.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an object store's setting for s3:// (gs://, az://) paths (obstore's keys: endpoint, region, ...); "
        "credentials are read as the AWS tools read them (AWS_* variables, AWS_ENDPOINT_URL)",
    )


def _main(argv: list[str] | None) -> int:
    with command_line_messages():
        args = build_parser().parse_args(argv)
        try:
            signal.signal(signal.SIGTERM, _on_terminate)
        except ValueError:  # main() called from a thread other than the main one: leave signals alone
            pass
        try:
            if getattr(args, "storage_option", None):
                from .remote.stores import set_storage_options

                set_storage_options(args.storage_option)
            if args.verb == "merge":
                return _merge(args)
            if args.verb == "inspect":
                return _inspect(args)
            if args.verb == "verify":
                return _verify(args)
            if args.verb == "watch":
                return _watch(args)
            if args.verb == "demo":
                from .demo import run_demo

                return run_demo(args.workdir, args.world_size)
        except FsdpfastError as exc:
            print(f"fsdpfast: error: {exc}", file=sys.stderr)
            return exc.exit_code
        except BrokenPipeError:  # the reader of our output went away (| head) while the demo printed
            _silence_stdout()
            return EXIT_FAILURE
        except KeyboardInterrupt as exc:  # InterruptedAfterPublishing says what was published
            print(f"fsdpfast: interrupted; {str(exc) or 'nothing was published'}", file=sys.stderr)
            return 130
        except OSError as exc:
            message = out_of_files(exc, exc.filename or "") or f"{exc.filename or ''}: {exc.strerror or exc}"
            print(f"fsdpfast: error: {message}", file=sys.stderr)
            return EXIT_FAILURE
        return EXIT_BAD_INPUT


def _emit(text: str) -> None:
    """Print the report on stdout. A reader that went away (`| head`) does not change the exit status,
    which says what was done: the rest of the output is dropped, quietly."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()


def _silence_stdout() -> None:
    # Later writes, and the interpreter's flush at exit (which would print an error and exit 120), go nowhere.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _on_terminate(signum, frame):
    # `kill` (SIGTERM) unwinds like Ctrl-C, so the staging folder and lock are removed on the way
    # out; only SIGKILL leaves them, for the next merge into the same folder to clean.
    raise KeyboardInterrupt


def _plan_options(args) -> dict:
    """What a dry run and a merge both plan from: the same flags give the same plan."""
    return dict(
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        layout=args.layout,
        config=args.config,
        allow_extra_tensors=args.allow_extra_tensors,
        expert_layout=args.expert_layout,
        **({"fp8_skip": args.fp8_skip} if args.fp8_skip else {}),
        **_layout_options(args),
        **_lora_options(args),
    )


class _WarningLines(logging.Handler):
    """The package's logged warnings (what was kept of an earlier OUT_DIR), each said once on stderr as
    `fsdpfast: warning: ...` at once, even when the merge then stops; the report's copy is not repeated."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.said: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.said.add(message)
        print(f"fsdpfast: warning: {message}", file=sys.stderr)


def _merge(args) -> int:
    logger = logging.getLogger("fsdpfast")
    lines = _WarningLines()
    logger.addHandler(lines)
    try:
        return _merge_logged(args, lines.said)
    finally:
        logger.removeHandler(lines)


def _merge_logged(args, said: set[str]) -> int:
    from .api import dry_run, merge
    from .rank_agreement import RankDisagrees

    if args.verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("fsdpfast: %(message)s"))
        handler.addFilter(lambda record: record.levelno < logging.WARNING)  # _WarningLines says those
        logging.getLogger("fsdpfast").addHandler(handler)
        logging.getLogger("fsdpfast").setLevel(logging.INFO)
    from .pipeline import processes as group
    from .pipeline.report import DryRun

    if args.dry_run:
        if group.launched_by_torchrun() and group.this_rank() != 0:
            return 0  # the plan is rank 0's to print; nothing is written anyway
        plan = dry_run(args.checkpoint, args.out, **_plan_options(args))
        _emit(json.dumps(plan, indent=2) if args.json else DryRun(**plan).summary())
        _warn(plan["warnings"])
        return 0
    several = group.launched_by_torchrun()  # one of several processes: rank 0 alone prints the report
    if args.timeout is not None and not args.timeout > 0:
        raise BadInput(f"--timeout {args.timeout:g}: give a number of seconds above 0")
    pg = group.start_process_group(args.timeout or group.DEFAULT_TIMEOUT_S) if several else None
    try:
        report = merge(
            args.checkpoint,
            args.out,
            overwrite=args.overwrite,
            engine=args.engine,
            read_mode=args.read_mode,
            progress=not args.quiet,
            group=pg,
            **_plan_options(args),
        )
    except FsdpfastError as exc:
        told = (group.OtherRankFailed, group.LostRank, RankDisagrees)  # these name the rank already
        if several and not isinstance(exc, told):  # say which process found it
            exc.args = (f"rank {group.this_rank()}: {exc}",)
        raise
    finally:
        if several:
            group.end_process_group()
    if several and group.this_rank() != 0:
        return 0
    _emit(json.dumps(asdict(report), indent=2) if args.json else report.summary())
    _warn([warning for warning in report.warnings if warning not in said])
    return 0


def _warn(warnings: list[str]) -> None:
    """Warnings go to stderr whatever the format (the text report also lists them on stdout)."""
    for warning in warnings:
        print(f"fsdpfast: warning: {warning}", file=sys.stderr)


def _verify(args) -> int:
    from .verify import verify

    report = verify(
        args.out_dir,
        against=args.against,
        reference=args.reference,
        rtol=args.rtol,
        atol=args.atol,
        smoke=args.smoke,
        layout=args.layout,
        manifest_of=args.manifest,
        read_mode=args.read_mode,
        **_layout_options(args),
    )
    status = 0 if report.ok else EXIT_MISMATCH  # decided before printing: a closed stdout cannot change it
    _emit(json.dumps({**asdict(report), "ok": report.ok}, indent=2) if args.json else report.summary())
    return status


def _inspect(args) -> int:
    from .api import inspect
    from .pipeline.report import Inspection

    found = inspect(
        args.checkpoint,
        layout=args.layout,
        config=args.config,
        allow_extra_tensors=args.allow_extra_tensors,
        expert_layout=args.expert_layout,
        **_lora_options(args),
        **_layout_options(args),
    )
    _emit(json.dumps(found, indent=2) if args.json else Inspection(**found).summary())
    return 0


def _place(path: str) -> str:
    """A folder or an object-store prefix, written one way (to tell two names of one place)."""
    return path.rstrip("/") if is_remote(path) else os.path.abspath(path)


def _watch(args) -> int:
    from .options import merge_options
    from .watch.events import Events
    from .watch.loop import WatchSettings, watch
    from .watch.processes import merge_words

    if args.keep_last is not None and args.keep_last < 1:
        raise BadInput(f"--keep-last {args.keep_last}: give the number of outputs to keep, 1 or more")
    if not args.interval > 0:
        raise BadInput(f"--interval {args.interval:g}: give a number of seconds above 0")
    if os.path.lexists(args.run_dir) and not os.path.isdir(args.run_dir):
        raise BadInput(f"{args.run_dir}: not a folder; give the folder the run saves its checkpoints in")
    if _place(args.out) == _place(args.run_dir):
        raise BadInput(f"--out {args.out} is the run folder itself; publish into another folder")
    options = merge_options(engine=args.engine, overwrite=args.overwrite, **_plan_options(args))  # parsed once
    if args.nproc_per_merge < 1:
        raise BadInput(f"--nproc-per-merge {args.nproc_per_merge}: give the number of processes, 1 or more")
    if args.nnodes < 1:
        raise BadInput(f"--nnodes {args.nnodes}: give the number of nodes, 1 or more")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise BadInput(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, where the nodes' merges meet")
    if is_remote(args.run_dir) and (args.nproc_per_merge > 1 or args.nnodes > 1):
        raise BadInput(
            f"{args.run_dir}: a run in an object store is merged by the watcher's own process; "
            "leave out --nproc-per-merge and --nnodes"
        )
    merge_only = argparse.ArgumentParser(add_help=False)
    _add_merge_options(merge_only)
    settings = WatchSettings(
        args.run_dir,
        args.out,
        options,
        args.once,
        args.interval,
        args.keep_last,
        args.then,
        args.then_shell,
        args.nproc_per_merge,
        tuple(merge_words(merge_only, args)),
        args.nnodes,
        args.rdzv_endpoint,
    )
    return watch(settings, Events(args.json))
