"""What the model-shape check costs a merge and a dry run now that it runs beside them, side by side.

    python benchmarks/model_check_overlap.py [--merge DIR] [--plan 8B:64] [--repeat 3]

For each case, in turn and repeated: the check off (transformers hidden from the run, as if not
installed: the config files are still copied, the names are not checked), the check on a cold
cache (a fresh FSDPFAST_CACHE_DIR: a child process imports torch and transformers and builds the
model while the bytes move; the merge waits for it before publishing) and on a warm one (the
model read from the cache: nothing imported). A merge also gets the I/O floor beside it
(benchmarks/io_floor.py with the output's size, the faster of its two write modes) and, with
`--cold`, both again with the rank files' pages dropped first (posix_fadvise DONTNEED). Each run is
`python -m fsdpfast merge` as its own process: wall time, CPU time (user + sys, children included) and
peak RSS of the whole process
tree (benchmarks/measure.py), and the other CPU work on the machine meanwhile.

Cases: `--merge DIR` merges a checkpoint with huggingface/config.json to bf16 (cpu engine; default:
a 16-layer Llama of hidden 1024 in fp32 over 4 ranks written once by benchmarks/make_checkpoint.py,
about 1 GB); `--plan MODEL:W` plans (`--dry-run`) a verl-style folder of W rank files of a Llama-3
shape with its config.json (fsdpfast._testing.many_ranks, sparse data; `8B:1024` is issue 25's
target: <= 4 s and <= 150 MB once the cache is warm).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

from measure import Run, run_measured, size  # noqa: E402
from read_modes import drop_cached  # noqa: E402

# the command line with transformers hidden: the check cannot run (a note says so), all else as usual
CHECK_OFF = (
    "import sys; sys.modules['transformers'] = None; from fsdpfast.cli import main; sys.exit(main(sys.argv[1:]))"
)
MODES = ("check off", "cold cache", "warm cache")
# merges only: the I/O floor beside them (benchmarks/io_floor.py: every input byte read, the output's
# bytes written and fsynced; the faster of its two write modes), and with --cold both again with the
# rank files' pages dropped first (posix_fadvise DONTNEED: a first merge after training)
FLOOR, COLD_MERGE, COLD_FLOOR = "I/O floor", "cold pages, warm cache", "cold pages, I/O floor"


def default_merge_case(root: str) -> str:
    folder = os.path.join(root, "llama-h1024-l16-w4")
    if not os.path.isfile(os.path.join(folder, "huggingface", "config.json")):
        print(f"writing {folder} ...", flush=True)
        subprocess.run(
            [sys.executable, os.path.join(HERE, "make_checkpoint.py"), folder, "--hidden", "1024", "--layers", "16",
             "--intermediate", "2816", "--heads", "16", "--world-size", "4"],
            check=True,
            env={**os.environ, "PYTHONPATH": REPO},
        )  # fmt: skip
    return folder


def plan_case(root: str, text: str, jobs: int) -> str:
    model, world = text.split(":")
    folder = os.path.join(root, f"many-{model}-w{world}")
    done = folder + ".complete"
    if not os.path.exists(done):
        shutil.rmtree(folder, ignore_errors=True)
        print(f"writing {folder} ...", flush=True)
        command = [sys.executable, "-m", "fsdpfast._testing.many_ranks", folder, "--model", model]
        command += ["--world-size", world]
        env = {**os.environ, "PYTHONPATH": REPO, "TORCH_CPP_LOG_LEVEL": "ERROR"}
        cuts = [int(world) * i // jobs for i in range(jobs + 1)]
        workers = [
            subprocess.Popen(command + ["--ranks", f"{a}:{b}"] + (["--config"] if a == 0 else []), env=env)
            for a, b in zip(cuts, cuts[1:])
            if b > a
        ]
        if any(worker.wait() for worker in workers):
            raise SystemExit(f"writing {folder} failed")
        open(done, "w").close()
    return folder


def input_files(folder: str) -> list[str]:
    return sorted(e.path for e in os.scandir(folder) if e.is_file() and not e.name.endswith(".json"))


def output_bytes(folder: str, dtype: str) -> int:
    """Bytes of tensor data the merge writes (from the plan: metadata only)."""
    from fsdpfast import plan_merge
    from fsdpfast.plan.layout import tensor_nbytes

    return sum(tensor_nbytes(t) for t in plan_merge(folder, dtype=dtype).tensors)


def floor(inputs: list[str], nbytes: int, out: str, cold: bool) -> Run:
    """The faster of io_floor.py's two write modes, each a process of its own."""
    found = []
    for mode in ("mmap", "pwrite"):
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        os.sync()
        if cold:
            drop_cached(inputs)
        argv = [sys.executable, os.path.join(HERE, "io_floor.py"), os.path.join(out, "floor.bin"), str(nbytes)]
        found.append(run_measured([*argv, *inputs, "--write", mode]))
        if found[-1].returncode != 0:
            raise SystemExit(f"io_floor.py failed: {found[-1].stderr.strip()[-400:]}")
    shutil.rmtree(out, ignore_errors=True)
    return min(found, key=lambda r: r.seconds)


def run(mode: str, argv: list[str], cache: str) -> Run:
    env = ["env", f"PYTHONPATH={REPO}", f"FSDPFAST_CACHE_DIR={cache}", "FSDPFAST_MEASUREMENTS=/dev/null"]
    python = [sys.executable, "-c", CHECK_OFF] if mode == "check off" else [sys.executable, "-m", "fsdpfast"]
    result = run_measured([*env, *python, *argv])
    if result.returncode != 0:
        raise SystemExit(f"{mode} {' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()[-400:]}")
    return result


def measure_case(
    argv: list[str], out: str | None, root: str, repeat: int, folder: str = "", dtype: str = "", cold: bool = False
) -> dict:
    """Each mode's runs; a merge (`folder` given) with its I/O floors, warm and cold, beside it."""
    warm = os.path.join(root, "warm-cache")
    shutil.rmtree(warm, ignore_errors=True)
    if out:
        shutil.rmtree(out, ignore_errors=True)
    run("warm cache", argv, warm)  # fills it (and the page cache with the checkpoint)
    inputs = input_files(folder) if folder else []
    nbytes = output_bytes(folder, dtype) if folder else 0
    modes = (*MODES, FLOOR, COLD_MERGE, COLD_FLOOR) if cold else (*MODES, FLOOR)
    runs = {mode: [] for mode in (modes if folder else MODES)}
    for _ in range(repeat):
        for mode in runs:
            if mode in (FLOOR, COLD_FLOOR):
                runs[mode].append(floor(inputs, nbytes, out, cold=mode == COLD_FLOOR))
                continue
            if out:
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
            if mode == COLD_MERGE:
                drop_cached(inputs)
            cache = warm if mode in ("warm cache", COLD_MERGE) else tempfile.mkdtemp(prefix="cold-", dir=root)
            runs[mode].append(run("warm cache" if mode == COLD_MERGE else mode, argv, cache))
            if cache != warm:
                shutil.rmtree(cache, ignore_errors=True)
    if out:
        shutil.rmtree(out, ignore_errors=True)
    return runs


def table(title: str, runs: dict[str, list[Run]]) -> None:
    base = statistics.median(r.seconds for r in runs["check off"])
    floors = {m: [r.seconds for r in runs[m]] for m in (FLOOR, COLD_FLOOR) if m in runs}
    print(f"\n{title}, median of {len(runs['check off'])} (wall min-max):")
    extra = " wall / its floor, per round |" if floors else ""
    print(f"| check | wall s | CPU s | peak RSS (tree) | wall / check off | other CPU s meanwhile |{extra}")
    print("|---|---|---|---|---|---|" + ("---|" if floors else ""))
    for mode, found in runs.items():
        against = floors.get(COLD_FLOOR if mode.startswith("cold pages") else FLOOR) if floors else None
        per_round = ", ".join(f"{r.seconds / f:.2f}" for r, f in zip(found, against)) if against else ""
        wall = sorted(r.seconds for r in found)
        shown = f"{statistics.median(wall):.2f}" + (f" ({wall[0]:.2f}-{wall[-1]:.2f})" if len(wall) > 1 else "")
        cpu = statistics.median(r.cpu_seconds for r in found)
        others = statistics.median(r.others_cpu_seconds for r in found)
        peak = size(max(r.peak_rss for r in found))
        row = f"| {mode} | {shown} | {cpu:.2f} | {peak} | {statistics.median(wall) / base:.2f} | {others:.1f} |"
        print(row + (f" {per_round} |" if floors else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--merge", action="append", default=None, help="checkpoint folders to merge (repeatable; '' for none)"
    )
    parser.add_argument("--plan", default="8B:64", help="MODEL:W cases to dry-run, comma-separated ('' for none)")
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "fsdpfast-check-bench"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2, help="processes writing the rank files")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--cold", action="store_true", help="merges also with the rank files' pages dropped first")
    args = parser.parse_args()
    os.makedirs(args.root, exist_ok=True)
    merges = [m for m in args.merge if m] if args.merge is not None else [default_merge_case(args.root)]
    plans = [(text, plan_case(args.root, text, args.jobs)) for text in args.plan.split(",") if text]
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(REPO, "fsdpfast")], check=True)
    out = os.path.join(args.root, "out")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"machine: {os.cpu_count()} CPUs, load average {load} at the start")
    for folder in merges:
        argv = ["merge", folder, "--out", out, "--dtype", args.dtype, "--engine", "cpu", "--quiet"]
        table(
            f"merge of {folder} to {args.dtype} (cpu engine)",
            measure_case(argv, out, args.root, args.repeat, folder, args.dtype, args.cold),
        )
    for text, folder in plans:
        argv = ["merge", folder, "--out", out, "--dry-run", "--quiet"]
        table(f"`merge --dry-run` of {text} ({folder})", measure_case(argv, None, args.root, args.repeat))


if __name__ == "__main__":
    main()
