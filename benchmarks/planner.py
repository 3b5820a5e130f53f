"""Planning many ranks: today's planner against an earlier one, side by side, on the same files.

Writes (once, kept under --root) verl-style `model_world_size_{W}_rank_{r}.pt` folders of Llama-3
shaped models, and DCP folders, with fsdpfast._testing.many_ranks: real FSDP2 (`fully_shard`) over
torch's fake process group, real metadata and sparse data. Then times `fsdpfast merge --dry-run`
(planning: every rank file read, every piece placed and checked) with the code of this tree and
with the code of an earlier commit (--old, default the parent of the planner work), each run its
own process, in turn; wall time, CPU time (user + sys) and peak RSS of the process tree
(benchmarks/measure.py). Both packages are byte-compiled first, as pip does when it installs one
(else, with PYTHONDONTWRITEBYTECODE set, every run compiles every module again). This tree's
planner runs under `ulimit -n 1024`; the old one needs two open files per rank file, so it runs
under the machine's hard limit. --merge adds whole merges (cpu engine) and the I/O floor
(benchmarks/io_floor.py) of the same output.

    python benchmarks/planner.py --cases 8B:8,8B:64,8B:256 [--merge 1B:1024] [--repeat 3]
    python benchmarks/planner.py --cases 8B:1024,70B:512,70B:1024,405B:1024,dcp-8B:256   # about an hour to write
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

from measure import Run, run_measured, size  # noqa: E402

from fsdpfast._testing.many_ranks import LLAMA3  # noqa: E402

OLD_DEFAULT = "ca32be8"  # the commit before the planner work (issue 17)
NEW_LIMIT = 1024  # the usual default soft limit of open files


@dataclass(frozen=True)
class Case:
    model: str  # a LLAMA3 size
    world: int
    layout: str = "fsdp-ranks"  # or "dcp"

    @classmethod
    def parse(cls, text: str) -> Case:
        layout = "dcp" if text.startswith("dcp-") else "fsdp-ranks"
        model, world = text.removeprefix("dcp-").split(":")
        if model not in LLAMA3:
            raise SystemExit(f"unknown model {model!r}; known: {', '.join(LLAMA3)}")
        return cls(model, int(world), layout)

    @property
    def name(self) -> str:
        return f"{'dcp-' if self.layout == 'dcp' else ''}{self.model}-w{self.world}"

    @property
    def tensors(self) -> int:
        shape = LLAMA3[self.model]
        return shape.layers * 9 + 2 + (0 if shape.tied else 1)


def write_case(case: Case, root: str, jobs: int) -> str:
    """The case's checkpoint folder, written first if it is not there yet."""
    folder = os.path.join(root, case.name)
    done = os.path.join(root, f".{case.name}.complete")
    if os.path.exists(done):
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "fsdpfast._testing.many_ranks",
        folder,
        "--model",
        case.model,
        "--world-size",
        str(case.world),
        "--layout",
        case.layout,
    ]
    env = {**os.environ, "PYTHONPATH": REPO, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    print(f"writing {case.name} ...", flush=True)
    if case.layout == "dcp":
        subprocess.run(command, check=True, env=env)
    else:
        cuts = [case.world * i // jobs for i in range(jobs + 1)]
        workers = [
            subprocess.Popen(command + ["--ranks", f"{a}:{b}"], env=env) for a, b in zip(cuts, cuts[1:]) if b > a
        ]
        if any(worker.wait() for worker in workers):
            raise SystemExit(f"writing {case.name} failed")
    open(done, "w").close()
    return folder


def old_tree(root: str, revision: str) -> str:
    """The package as it was at `revision` (git archive), with this tree's compiled modules."""
    where = os.path.join(root, f"old-{revision}")
    if not os.path.isdir(where):
        os.makedirs(where)
        archive = subprocess.run(
            ["git", "-C", REPO, "archive", revision, "fsdpfast"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
        for name in os.listdir(os.path.join(REPO, "fsdpfast")):
            if name.endswith(".so") or name == "_build_config.py":
                shutil.copy(os.path.join(REPO, "fsdpfast", name), os.path.join(where, "fsdpfast", name))
    return where


def run(code: str, argv: list[str], open_files: int | None) -> Run:
    """`python -m fsdpfast ARGV` with the package at `code`, under a soft open-file limit (None: the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = hard if open_files is None else min(open_files, hard)
    # from a folder of no package: `python -m` puts the current folder first on the path
    return run_measured(
        [
            "prlimit",
            f"--nofile={limit}:{hard}",
            "--",
            "env",
            f"--chdir={os.path.dirname(code)}",
            f"PYTHONPATH={code}",
            sys.executable,
            "-m",
            "fsdpfast",
            *argv,
        ]
    )


def check(result: Run, what: str) -> Run:
    if result.returncode != 0:
        raise SystemExit(f"{what} failed ({result.returncode}): {result.stderr.strip()[-400:]}")
    return result


def summary(runs: list[Run]) -> tuple[str, str, str]:
    wall = sorted(r.seconds for r in runs)
    shown = f"{statistics.median(wall):.2f}" + (f" ({wall[0]:.2f}-{wall[-1]:.2f})" if len(wall) > 1 else "")
    return shown, f"{statistics.median(r.cpu_seconds for r in runs):.2f}", size(max(r.peak_rss for r in runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="8B:8,8B:64,8B:256", help="MODEL:W or dcp-MODEL:W, comma-separated")
    parser.add_argument(
        "--merge", default="", help="cases merged whole (cpu engine) against the I/O floor, e.g. 1B:1024"
    )
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "fsdpfast-planner-bench"))
    parser.add_argument("--old", default=OLD_DEFAULT, help="the earlier commit to compare with ('' for none)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2, help="processes writing the rank files")
    parser.add_argument("--write-only", action="store_true", help="write the checkpoints, measure nothing")
    args = parser.parse_args()
    os.makedirs(args.root, exist_ok=True)
    cases = [Case.parse(c) for c in args.cases.split(",") if c]
    merges = [Case.parse(c) for c in args.merge.split(",") if c]
    folders = {case: write_case(case, args.root, args.jobs) for case in dict.fromkeys(cases + merges)}
    if args.write_only:
        return
    codes = {"new": REPO}
    if args.old:
        codes["old"] = old_tree(args.root, args.old)
    for code in codes.values():  # as an install does: no run pays for compiling the package
        subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(code, "fsdpfast")], check=True)
    out = os.path.join(args.root, "out")

    rows = []
    for case in cases:
        runs = {who: [] for who in codes}
        for _ in range(args.repeat):
            for who, code in codes.items():
                argv = ["merge", folders[case], "--out", out, "--dry-run"]
                runs[who].append(check(run(code, argv, NEW_LIMIT if who == "new" else None), f"{who} {case.name}"))
        rows.append((case, {who: summary(r) for who, r in runs.items()}, runs))
    print(
        f"\n`fsdpfast merge --dry-run`, median of {args.repeat} (wall min-max); new: this tree under ulimit -n "
        f"{NEW_LIMIT}; old: {args.old or '-'}"
    )
    header = "| model | layout | tensors | W |" + "".join(
        f" {who} wall s | {who} CPU s | {who} peak RSS |" for who in codes
    )
    print(header + (" CPU old/new |" if "old" in codes else ""))
    print("|" + "---|" * (header.count("|") - 1 + ("old" in codes)))
    for case, shown, runs in rows:
        line = f"| {case.model} | {case.layout} | {case.tensors} | {case.world} |"
        line += "".join(f" {w} | {c} | {m} |" for w, c, m in shown.values())
        if "old" in codes:
            old_cpu = statistics.median(r.cpu_seconds for r in runs["old"])
            new_cpu = statistics.median(r.cpu_seconds for r in runs["new"])
            line += f" {old_cpu / new_cpu:.1f}x |"
        print(line, flush=True)

    for case in merges:
        results = {who: [] for who in [*codes, "floor"]}
        for _ in range(args.repeat):
            for who, code in codes.items():
                shutil.rmtree(out, ignore_errors=True)
                argv = ["merge", folders[case], "--out", out, "--engine", "cpu", "--quiet"]
                results[who].append(
                    check(run(code, argv, NEW_LIMIT if who == "new" else None), f"{who} merge {case.name}")
                )
            written = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out) if n.endswith(".safetensors"))
            shutil.rmtree(out, ignore_errors=True)
            inputs = sorted(
                os.path.join(folders[case], n) for n in os.listdir(folders[case]) if n.endswith((".pt", ".distcp"))
            )
            floor_file = os.path.join(args.root, "floor.bin")
            floors = [
                check(
                    run_measured(
                        [
                            sys.executable,
                            os.path.join(HERE, "io_floor.py"),
                            floor_file,
                            str(written),
                            *inputs,
                            "--write",
                            how,
                        ]
                    ),
                    "io floor",
                )
                for how in ("pwrite", "mmap")
            ]
            os.remove(floor_file)
            results["floor"].append(min(floors, key=lambda r: r.seconds))
        floor = statistics.median(r.seconds for r in results["floor"])
        print(f"\nwhole merge of {case.name} ({size(written)} written, cpu engine), median of {args.repeat}:")
        print("| code | wall s | CPU s | peak RSS | time / I/O floor |")
        print("|---|---|---|---|---|")
        for who, runs in results.items():
            wall, cpu, rss = summary(runs)
            print(
                f"| {who} | {wall} | {cpu} | {rss} | {statistics.median(r.seconds for r in runs) / floor:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
