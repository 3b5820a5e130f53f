"""Tables, target ratios and plots for benchmarks/compare.py, drawn from its CSV of runs.

Runs of one (size, world size) pair were made side by side in rounds, so every ratio here is
taken per round (between runs of the same round) and shown as the median, then each round's.
The floor of a round is the faster of floor-mmap and floor-pwrite.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections import defaultdict

import psutil
from measure import ratios, size

BASE = "fsdpfast-cpu"
FLOORS = ("floor-mmap", "floor-pwrite")
TARGET_WORLD_SIZE = 4  # the sweep over sizes
SWEEP_SIZE = "1"  # the sweep over world sizes


def grouped(rows: list[dict]) -> dict[tuple[int, float], dict[str, list[dict]]]:
    """(world size, size in GB) -> tool -> its runs in round order; tools in run order."""
    groups: dict = defaultdict(lambda: defaultdict(list))
    for row in rows:
        groups[(int(row["world_size"]), float(row["size"]))][row["tool"]].append(row)
    return {
        key: {tool: sorted(runs, key=lambda r: int(r["round"])) for tool, runs in tools.items()}
        for key, tools in sorted(groups.items())
    }


def seconds(runs: list[dict]) -> list[float]:
    return [float(r["seconds"]) for r in runs]


def floor_seconds(tools: dict[str, list[dict]]) -> list[float] | None:
    modes = [seconds(tools[m]) for m in FLOORS if m in tools]
    return [min(per_round) for per_round in zip(*modes)] if modes else None


def peak(runs: list[dict], field: str) -> int:
    return max(int(r[field]) for r in runs)


def verdict(runs: list[dict]) -> str:
    failures = [r["check"] for r in runs if r["check"] not in ("-",) and not r["check"].startswith("ok")]
    if failures:
        return f"**{len(failures)}/{len(runs)} failed**: {failures[0][:120]}"
    return "-" if runs[0]["check"] == "-" else f"ok ({len(runs)}/{len(runs)})"


def succeeded(runs: list[dict]) -> bool:
    """Every run exited 0 and passed the bit-for-bit check (or had none to pass)."""
    return all(r["exit"] == "0" and (r["check"] == "-" or r["check"].startswith("ok")) for r in runs)


def exits(runs: list[dict]) -> str:
    codes = sorted({int(r["exit"]) for r in runs})
    return ",".join(str(c) for c in codes)


def table(groups: dict) -> list[str]:
    lines = [
        "| fp32 shards | ranks | tool | wall s, median (min–max) | input GB/s | CPU s | others CPU s | peak RSS "
        "| peak RssAnon | exit | bit-exact vs unsharded | time ÷ floor | time ÷ fsdpfast-cpu |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (world_size, _), tools in groups.items():
        floor = floor_seconds(tools)
        base = seconds(tools[BASE]) if BASE in tools and succeeded(tools[BASE]) else None
        for tool, runs in tools.items():
            secs, ok = seconds(runs), succeeded(runs)
            median = statistics.median(secs)
            input_bytes = int(runs[0]["input_bytes"])
            lines.append(
                f"| {size(input_bytes)} | {world_size} | {tool} | {median:.2f} ({min(secs):.2f}–{max(secs):.2f}) "
                f"| {f'{input_bytes / median / 1e9:.2f}' if ok else '-'} "
                f"| {statistics.median(float(r['cpu_seconds']) for r in runs):.1f} "
                f"| {statistics.median(float(r['others_cpu_seconds']) for r in runs):.1f} "
                f"| {size(peak(runs, 'peak_rss'))} | {size(peak(runs, 'peak_anon'))} | {exits(runs)} | {verdict(runs)} "
                f"| {ratios(secs, floor) if floor and ok else '-'} | {ratios(secs, base) if base and ok else '-'} |"
            )
    return lines


def pivot(groups: dict) -> list[str]:
    """One row per world size, one column per tool: median wall seconds and peak RSS; the floor as one column."""
    tools = list(dict.fromkeys(t for g in groups.values() for t in g if t not in FLOORS))
    lines = ["| ranks | " + " | ".join(tools) + " | floor |", "|---" * (len(tools) + 2) + "|"]
    for (world_size, _), group in groups.items():
        cells = [
            f"{statistics.median(seconds(group[t])):.2f} ({size(peak(group[t], 'peak_rss'))})" if t in group else "-"
            for t in tools
        ]
        floor = floor_seconds(group)
        lines.append(
            f"| {world_size} | " + " | ".join(cells) + (f" | {statistics.median(floor):.2f} |" if floor else " | - |")
        )
    return lines


def verl_name(tools: dict) -> str | None:
    return next((t for t in ("verl", "verl-style") if t in tools), None)


def met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def per_round_median(values: list[float], bases: list[float]) -> float:
    return statistics.median(v / b for v, b in zip(values, bases))


def targets(groups: dict) -> list[str]:
    sweep = {gb: tools for (w, gb), tools in groups.items() if w == TARGET_WORLD_SIZE and BASE in tools}
    if not sweep:
        return []
    largest, smallest = max(sweep), min(sweep)
    tools = sweep[largest]
    base = tools[BASE]
    if not succeeded(base):
        return [f"Targets: not computed, fsdpfast-cpu failed at the largest size ({verdict(base)})."]
    lines = [
        f"Targets, at the largest size ({size(int(base[0]['input_bytes']))} fp32 -> bf16, "
        f"{TARGET_WORLD_SIZE} ranks), per round, median first:",
        "",
    ]
    verl = verl_name(tools)
    if verl and succeeded(tools[verl]):
        time_ratio = per_round_median(seconds(tools[verl]), seconds(base))
        lines.append(
            f"- {verl} time ÷ fsdpfast-cpu time = {ratios(seconds(tools[verl]), seconds(base))}; "
            f"target ≥ 3: {met(time_ratio >= 3)}"
        )
        for field, label in (("peak_rss", "peak RSS"), ("peak_anon", "peak RssAnon")):
            theirs, ours = [float(r[field]) for r in tools[verl]], [float(r[field]) for r in base]
            lines.append(
                f"- {verl} {label} ÷ fsdpfast-cpu {label} = {ratios(theirs, ours)}; "
                f"target ≥ 4: {met(per_round_median(theirs, ours) >= 4)}"
            )
    floor = floor_seconds(tools)
    if floor:
        lines.append(
            f"- fsdpfast-cpu time ÷ floor = {ratios(seconds(base), floor)}; "
            f"target ≤ 1.3: {met(per_round_median(seconds(base), floor) <= 1.3)}"
        )
    if largest != smallest:
        small = sweep[smallest][BASE]
        for field, label in (("peak_rss", "peak RSS"), ("peak_anon", "peak RssAnon")):
            grow = peak(base, field) / peak(small, field)
            lines.append(
                f"- fsdpfast-cpu {label}, {size(int(base[0]['input_bytes']))} ÷ "
                f"{size(int(small[0]['input_bytes']))}: {size(peak(base, field))} ÷ {size(peak(small, field))} "
                f"= {grow:.2f}; flat within 20%: {met(grow <= 1.2)}"
            )
    return lines


def sections(groups: dict) -> list[tuple[str, dict]]:
    """The size sweep (4 ranks), the world-size sweep (~1 GB) and anything else run, as (title, groups)."""
    by_size = {k: v for k, v in groups.items() if k[0] == TARGET_WORLD_SIZE}
    by_ranks = {k: v for k, v in groups.items() if k[1] == float(SWEEP_SIZE)}
    rest = {k: v for k, v in groups.items() if k not in by_size and k not in by_ranks}
    parts = [(f"By checkpoint size, {TARGET_WORLD_SIZE} ranks", by_size)]
    if len(by_ranks) > 1:
        parts.append((f"By number of ranks, {SWEEP_SIZE} GB checkpoint", by_ranks))
    parts.append(("Other runs", rest))
    return [(title, part) for title, part in parts if part]


def header(rows: list[dict]) -> list[str]:
    dates = sorted({r["date"] for r in rows})
    versions = sorted({r.get("fsdpfast") or "?" for r in rows})
    rounds = max(int(r["round"]) for r in rows)
    return [
        f"Merges of real FSDP2 fp32 checkpoints to bf16, measured {' to '.join(dict.fromkeys([dates[0], dates[-1]]))} "
        f"(fsdpfast {', '.join(versions)}) on {os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM ({platform.machine()}), "
        f"by `python benchmarks/compare.py`. Inputs warm in the page cache; up to {rounds} rounds, every tool in turn "
        "in each round; every run its own process. Ratios are per round (runs made side by side), median first. "
        '"others CPU s": CPU time the rest of the machine used during the run. Peaks are over the whole process '
        "tree. guide and verl-style are baselines written in this repository from those tools' published "
        "algorithms (benchmarks/baselines/).",
        "",
    ]


def render(rows: list[dict], results: str, notes: list[str]) -> str:
    """Write compare.md and the plots into `results`; return the markdown."""
    if not rows:
        return "no runs yet\n"
    groups = grouped(rows)
    lines = header(rows)
    for title, part in sections(groups):
        lines += [f"### {title}", ""] + table(part) + [""]
        if title.startswith("By number of ranks"):
            lines += ["Median wall seconds (peak RSS), by ranks:", ""] + pivot(part) + [""]
    lines += targets(groups)
    lines += ["", "Plots: " + ", ".join(f"[{name}]({name})" for name in plot_all(groups, results))]
    if notes:
        lines += ["", "Notes from the latest run:", ""] + [f"- {note}" for note in notes]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(results, "compare.md"), "w") as f:
        f.write(text)
    return text


# --- plots -------------------------------------------------------------------------------------


def series(groups: dict, keep, x_of) -> dict[str, list[tuple[float, list[dict] | list[float]]]]:
    """tool -> [(x, runs)] over the groups `keep` accepts; the floor as one series of per-round seconds."""
    out: dict = defaultdict(list)
    for key, tools in groups.items():
        if not keep(key):
            continue
        for tool, runs in tools.items():
            if tool not in FLOORS:
                out[tool].append((x_of(key), runs))
        floor = floor_seconds(tools)
        if floor:
            fake = [dict(r, seconds=s) for r, s in zip(tools[FLOORS[0]], floor)]
            out["floor"].append((x_of(key), fake))
    return out


def plot_all(groups: dict, results: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    names = []
    by_size = series(groups, lambda k: k[0] == TARGET_WORLD_SIZE, lambda k: float(k[1]))
    if by_size:
        names += [plot_time(by_size, results), plot_memory(by_size, results)]
    by_ranks = series(groups, lambda k: k[1] == float(SWEEP_SIZE), lambda k: k[0])
    if len({x for points in by_ranks.values() for x, _ in points}) > 1:
        names.append(plot_world_size(by_ranks, results))
    return names


def style(tool: str) -> dict:
    if tool == "floor":
        return dict(color="black", linestyle="--", marker="s")
    if tool.startswith("fsdpfast"):
        return dict(marker="o", linewidth=2.2)
    return dict(marker="^")


def finish(fig, axes, results: str, name: str, xs: list[float], y_label) -> str:
    """Ticks at the measured x values and at 1-2-5 steps of y, labelled plainly; save the PNG."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    for ax in axes:
        ax.set_xticks(sorted(set(xs)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        if ax.get_yscale() == "log":
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: y_label(v)))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(results, name), dpi=110)
    return name


def xs_of(data: dict) -> list[float]:
    return [x for points in data.values() for x, _ in points]


def plot_time(data: dict, results: str) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for tool, points in data.items():
        xs = [x for x, _ in points]
        meds = [statistics.median(seconds(runs)) for _, runs in points]
        lows = [m - min(seconds(runs)) for m, (_, runs) in zip(meds, points)]
        highs = [max(seconds(runs)) - m for m, (_, runs) in zip(meds, points)]
        ax.errorbar(xs, meds, yerr=[lows, highs], label=tool, capsize=3, **style(tool))
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="fp32 checkpoint, GB (4 ranks)",
        ylabel="wall seconds (median, min–max)",
        title="Merge fp32 -> bf16: time vs checkpoint size",
    )
    return finish(fig, [ax], results, "compare_time.png", xs_of(data), lambda v: f"{v:g} s")


def plot_memory(data: dict, results: str) -> str:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, field, label in ((axes[0], "peak_rss", "peak RSS"), (axes[1], "peak_anon", "peak RssAnon")):
        for tool, points in data.items():
            if tool != "floor":
                ax.plot([x for x, _ in points], [peak(runs, field) for _, runs in points], label=tool, **style(tool))
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="fp32 checkpoint, GB (4 ranks)",
            ylabel=f"{label} of the process tree",
            title=f"{label} vs checkpoint size",
        )
    return finish(fig, list(axes), results, "compare_memory.png", xs_of(data), size)


def plot_world_size(data: dict, results: str) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for tool, points in data.items():
        xs = [x for x, _ in points]
        ys = [int(runs[0]["input_bytes"]) / statistics.median(seconds(runs)) / 1e9 for _, runs in points]
        ax.plot(xs, ys, label=tool, **style(tool))
    ax.set_xscale("log", base=2)
    ax.set(
        xlabel="ranks (rank files)",
        ylabel="input GB/s (median)",
        title="~1 GB fp32 checkpoint to bf16: throughput vs ranks",
    )
    return finish(fig, [ax], results, "compare_world_size.png", xs_of(data), lambda v: f"{v:g}")
