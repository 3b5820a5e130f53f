"""Megatron-Core MoE checkpoints at the 1 B scale: fsdpfast's merge beside the I/O floor and megatron-bridge.

Cases (benchmarks/megatron_moe_checkpoint.py holds the shapes; each checkpoint is written by real
megatron-core 0.16.1 on gloo CPU ranks with dist_checkpointing.save, bf16, into --workdir, and deleted after
its case unless --keep):
  tiny         tests/data/megatron/tp2_ep2_qwen3_moe_bf16, the committed 2-rank fixture: the small end
               of the memory comparison (nothing written)
  qwen3_moe    Qwen3-30B-A3B's layer shapes, 8 layers, 16 experts: 1.02 B parameters, TP2 / EP2
  qwen3_dense  its dense twin (the experts' bytes as one dense MLP), TP2: what megatron-bridge 0.3.1 can
               export (it cannot export SequentialMLP experts, the only ones megatron-core builds on a CPU)
  gpt_oss      gpt-oss's layer shapes (hidden 2880, experts of 2880, packed transposed with gate/up
               interleaved on the Hub), 2 layers, 16 experts: 1.03 B parameters, TP1
Each case runs, as its own process each (benchmarks/measure.py: wall, CPU, peak RSS and RssAnon of the
process tree):
  floor-mmap / floor-pwrite  benchmarks/io_floor.py over the checkpoint's .distcp files and the merged
                             output's size (the floor of a round is the faster of the two)
  fsdpfast                   python -m fsdpfast merge RUN --out OUT --config HF (cpu engine, default read mode,
                             dtype kept: bf16, the fp32 norms fp32); with --baseline-python, also
                             another checkout's (`fsdpfast, baseline`: e.g. before a change)
  megatron-bridge            (qwen3_moe, qwen3_dense) megatron_moe_checkpoint.py bridge: the model built at
                             TP1 by bridge's provider, dist_checkpointing.load, AutoBridge.save_hf_weights;
                             its output checked bit for bit against fsdpfast's (every tensor, dtype and
                             shape); a command that fails is not run again
Every command runs once untimed (megatron-bridge excepted: a minute a run; its rounds follow the others'
warm-up, so the checkpoint is in the page cache for it too), then --repeat rounds run every command in turn,
so the ratios compare runs made side by side. Run it under nice on a shared machine.

    nice python benchmarks/megatron_moe.py [--cases tiny,qwen3_moe,qwen3_dense,gpt_oss] [--repeat 3]
        [--workdir /tmp/fsdpfast-megatron-moe] [--megatron-python /work/megatron-venv/bin/python] [--keep]
        [--baseline-python OTHER_CHECKOUT/.venv/bin/python]

Tables: benchmarks/results/megatron_moe_CASE.md, one per case (--results: another folder).
"""

from __future__ import annotations

import argparse
import glob
import json
import mmap
import os
import shlex
import shutil
import statistics
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from measure import Run, busy_cores, clean, ratios, run_measured, size  # noqa: E402

WRITER = os.path.join(HERE, "megatron_moe_checkpoint.py")
TINY = os.path.join(os.path.dirname(HERE), "tests", "data", "megatron", "tp2_ep2_qwen3_moe_bf16")
BRIDGED = {"qwen3_moe", "qwen3_dense"}
FLOORS = ("floor-mmap", "floor-pwrite")
DESCRIPTIONS = {
    "tiny": "the committed fixture tp2_ep2_qwen3_moe_bf16 (hidden 64, 2 layers, 4 experts; TP2/EP2)",
    "qwen3_moe": "Qwen3-MoE-like, Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query heads / 4 KV groups of 128, "
    "experts of 768), 8 layers, 16 experts, vocab 65,536: 1.02 B parameters; TP2/EP2",
    "qwen3_dense": "its dense twin: Qwen3 with one dense MLP of 12,288 (the 16 experts' bytes), 1.02 B parameters; TP2",
    "gpt_oss": "gpt-oss-like, gpt-oss's layer shapes (hidden 2880, 64 query heads / 8 KV groups of 64, experts of "
    "2880 with biases, sinks), 2 layers, 16 experts, vocab 32,000: 1.03 B parameters; TP1",
}


def output_bytes(run: str, hf: str) -> int:
    """Bytes of tensor data the merge writes (from its plan: metadata only)."""
    from fsdpfast import plan_merge
    from fsdpfast.plan.layout import tensor_nbytes

    return sum(tensor_nbytes(t) for t in plan_merge(run, config=hf).tensors)


def safetensors_index(folder: str) -> dict[str, tuple[str, str, list[int], int, int]]:
    """name -> (file, dtype, shape, start, end) over the folder's .safetensors files (their headers only)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                found[name] = (path, entry["dtype"], entry["shape"], 8 + length + start, 8 + length + end)
    return found


def same_tensors(got: str, want: str) -> str:
    """'ok: N tensors bit-identical' if the two folders hold the same tensors byte for byte, else what differs."""
    a, b = safetensors_index(got), safetensors_index(want)
    if sorted(a) != sorted(b):
        return f"tensor names differ: {sorted(set(a) ^ set(b))[:4]}"
    maps: dict[str, mmap.mmap] = {}

    def mapped(path: str) -> mmap.mmap:
        if path not in maps:
            with open(path, "rb") as f:
                maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return maps[path]

    try:
        for name, (path, dtype, shape, start, end) in a.items():
            other = b[name]
            if (dtype, shape) != (other[1], other[2]):
                return f"{name}: {dtype} {shape} against {other[1]} {other[2]}"
            mine, theirs, step = mapped(path), mapped(other[0]), 64 << 20
            for at in range(0, end - start, step):
                n = min(step, end - start - at)
                if mine[start + at : start + at + n] != theirs[other[3] + at : other[3] + at + n]:
                    return f"{name}: bytes differ"
    finally:
        for m in maps.values():
            m.close()
    return f"ok: {len(a)} tensors bit-identical"


def make_template(merged: str, template: str) -> None:
    """A Hugging Face folder megatron-bridge can be built from: config.json and an index of `merged`'s files."""
    os.makedirs(template)
    shutil.copy(os.path.join(merged, "config.json"), template)
    weight_map = {name: os.path.basename(entry[0]) for name, entry in safetensors_index(merged).items()}
    with open(os.path.join(template, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def commands(name: str, run: str, hf: str, inputs: list[str], out: str, out_bytes: int, args, template: str):
    floor = [sys.executable, os.path.join(HERE, "io_floor.py"), os.path.join(out, "floor.bin"), str(out_bytes), *inputs]
    cmds = {
        mode: ["sh", "-c", f"mkdir -p {shlex.quote(out)} && exec {shlex.join(floor + ['--write', mode.split('-')[1]])}"]
        for mode in FLOORS
    }
    merge = ["-m", "fsdpfast", "merge", run, "--out", out, "--config", hf, "--overwrite"]
    cmds["fsdpfast"] = [sys.executable, *merge]
    if args.baseline_python:  # another checkout's fsdpfast, its tree left as it is (no bytecode written into it);
        # PYTHONSAFEPATH: `-m` would put the working directory (this checkout, when run from its root) first on
        # sys.path, and the baseline would time this checkout's code
        env = ["env", "PYTHONDONTWRITEBYTECODE=1", "PYTHONSAFEPATH=1"]
        cmds["fsdpfast, baseline"] = [*env, args.baseline_python, *merge]
    if name in BRIDGED:
        cmds["megatron-bridge"] = [args.megatron_python, WRITER, "bridge", name, os.path.dirname(run), out, template]
    return cmds


def last_line(run: Run) -> str:
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    return lines[-1][:160] if lines else f"exit {run.returncode}"


def measure_case(name: str, args) -> str:
    folder = os.path.join(args.workdir, name)
    out, reference, template = (os.path.join(args.workdir, d) for d in ("out", "reference", "template"))
    notes = []
    if name == "tiny":
        run, hf = os.path.join(TINY, "run"), os.path.join(TINY, "hf")
    else:
        run, hf = os.path.join(folder, "run"), os.path.join(folder, "hf")
        if not os.path.exists(os.path.join(run, "latest_checkpointed_iteration.txt")):
            shutil.rmtree(folder, ignore_errors=True)
            made = run_measured([args.megatron_python, WRITER, "write", name, folder])
            if made.returncode:
                raise SystemExit(f"writing {name} failed:\n{made.stderr[-3000:]}")
            notes.append(
                f"written by megatron-core's dist_checkpointing.save in {made.seconds:.0f} s "
                f"({made.cpu_seconds:.0f} CPU s; its ranks' peak RSS {size(made.peak_rss)}, RssAnon {size(made.peak_anon)})"
            )
            print(f"{name}: {notes[-1]}", flush=True)
    began = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    load = (
        f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}, {busy_cores():.1f} CPUs busy before measuring"
    )
    iteration = sorted(glob.glob(os.path.join(run, "iter_*")))[-1]
    inputs = sorted(glob.glob(os.path.join(iteration, "*.distcp")))
    input_bytes = sum(os.path.getsize(p) for p in inputs)
    out_bytes = output_bytes(run, hf)
    cmds = commands(name, run, hf, inputs, out, out_bytes, args, template)
    if name in BRIDGED:  # fsdpfast's output, untimed: bridge's template and the reference it is checked against
        for path in (reference, template):
            shutil.rmtree(path, ignore_errors=True)
        subprocess_ok(cmds["fsdpfast"][:6] + [reference] + cmds["fsdpfast"][7:])
        make_template(reference, template)
    for tool, argv in cmds.items():  # warm-up: page cache, bytecode caches
        if tool != "megatron-bridge":
            clean(out)
            subprocess_ok(argv)
    runs: dict[str, list[Run]] = {tool: [] for tool in cmds}
    checks: dict[str, list[str]] = {tool: [] for tool in cmds}
    for round_no in range(args.repeat):
        for tool, argv in cmds.items():
            if runs[tool] and runs[tool][-1].returncode:
                continue  # failed once: not run again (megatron-bridge on the MoE checkpoint)
            clean(out)
            r = run_measured(argv)
            runs[tool].append(r)
            if r.returncode:
                checks[tool].append(f"exit {r.returncode}: {last_line(r)}")
            elif tool == "megatron-bridge":
                checks[tool].append(same_tensors(out, reference))
            print(
                f"{name} round {round_no + 1} {tool}: {r.seconds:.2f} s, {r.cpu_seconds:.1f} CPU s, "
                f"peak RSS {size(r.peak_rss)}, others {r.others_cpu_seconds:.1f} CPU s"
                + (f", {checks[tool][-1]}" if checks[tool] else ""),
                flush=True,
            )
    clean(out)
    if not args.keep and name != "tiny":
        for path in (folder, reference, template):
            shutil.rmtree(path, ignore_errors=True)
    load_after = f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())} after"
    when = f"measured {began}-{time.strftime('%H:%M UTC', time.gmtime())} on {os.cpu_count()} CPUs"
    notes.append(f"{when}; {load}; {load_after}")
    return table(name, runs, checks, input_bytes, notes, cmds, args, inputs, out_bytes)


def subprocess_ok(argv: list[str]) -> None:
    r = run_measured(argv)
    if r.returncode:
        raise SystemExit(f"{shlex.join(argv)} failed ({r.returncode}):\n{r.stderr[-3000:]}")


def table(name, runs, checks, input_bytes, notes, cmds, args, inputs, out_bytes) -> str:
    floor = [min(a.seconds, b.seconds) for a, b in zip(*(runs[m] for m in FLOORS))]
    base = [r.seconds for r in runs["fsdpfast"]]
    lines = [
        f"#### {name}: {DESCRIPTIONS[name]}",
        "",
        f"{size(input_bytes)} of .distcp files, {size(out_bytes)} of tensors written; {args.repeat} rounds. "
        + " ".join(f"{note[0].upper()}{note[1:]}." for note in notes),
        "",
        "| command | wall s, median (min–max) | input GB/s | CPU s | others CPU s | peak RSS | peak RssAnon "
        "| peak RSS ÷ checkpoint | exit | check | time ÷ floor | time ÷ fsdpfast |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tool, rs in runs.items():
        secs = [r.seconds for r in rs]
        median = statistics.median(secs)
        ok = all(r.returncode == 0 for r in rs)
        peak = max(r.peak_rss for r in rs)
        found = checks[tool]
        check = "-" if not found else (found[0] if len(set(found)) == 1 else "; ".join(sorted(set(found))))
        lines.append(
            f"| {tool} | {median:.2f} ({min(secs):.2f}–{max(secs):.2f}) | {input_bytes / median / 1e9:.2f} "
            f"| {statistics.median(r.cpu_seconds for r in rs):.1f} | {statistics.median(r.others_cpu_seconds for r in rs):.1f} "
            f"| {size(peak)} | {size(max(r.peak_anon for r in rs))} | {peak / input_bytes:.3f} "
            f"| {','.join(sorted({str(r.returncode) for r in rs}))} | {check} "
            f"| {ratios(secs, floor) if ok else '-'} | {ratios(secs, base) if ok else '-'} |"
        )
    shown = {tool: shorten(argv, args.workdir, inputs) for tool, argv in cmds.items()}
    lines += ["", "Commands:", ""] + [f"- {tool}: `{command}`" for tool, command in shown.items()]
    return "\n".join(lines) + "\n"


def shorten(argv: list[str], workdir: str, inputs: list[str]) -> str:
    """The command line with the work folder written WORK, the input files as a pattern."""
    pattern = os.path.join(os.path.dirname(inputs[0]), "*.distcp")
    return (
        shlex.join(argv)
        .replace(shlex.join(inputs), pattern)
        .replace(workdir, "WORK")
        .replace(sys.executable, "python")
        .replace(os.path.dirname(HERE) + "/", "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="tiny,qwen3_moe,qwen3_dense,gpt_oss")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/fsdpfast-megatron-moe")
    parser.add_argument(
        "--megatron-python", default=os.environ.get("MEGATRON_PYTHON", "/work/megatron-venv/bin/python")
    )
    parser.add_argument(
        "--baseline-python", help="also time this Python's fsdpfast (another checkout's venv), e.g. before a change"
    )
    parser.add_argument("--keep", action="store_true", help="keep the written checkpoints in --workdir")
    parser.add_argument("--results", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    sections = []
    for name in args.cases.split(","):
        sections.append(measure_case(name, args))
        os.makedirs(args.results, exist_ok=True)
        with open(os.path.join(args.results, f"megatron_moe_{name}.md"), "w") as f:
            f.write(sections[-1])
    header = (
        f"Megatron-Core checkpoints merged by fsdpfast, measured {started} to "
        f"{time.strftime('%H:%M UTC', time.gmtime())} on {os.cpu_count()} CPUs by "
        f"`python benchmarks/megatron_moe.py --cases {args.cases} --repeat {args.repeat}`. Inputs warm in the page "
        "cache; every command its own process, run in turn in each round; ratios per round (side by side), median "
        'first. "others CPU s": CPU time the rest of the machine used during the run. Peaks are over the whole '
        "process tree.\n"
    )
    text = "\n".join([header] + sections)
    print("\n" + text)


if __name__ == "__main__":
    main()
