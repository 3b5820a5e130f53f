"""The two ways a merge reads its sources, side by side: mapped (--read-mode mmap) and large parallel
preads (--read-mode pread), warm and cold on local disk and on a slowfs FUSE mount that answers each
read request after a fixed latency (benchmarks/slowfs.c), each beside the parallel-read floor of the
same files (N threads of 8 MB preads, the best N: what any reader could get from that storage).

    python benchmarks/read_modes.py [CKPT_DIR] [--dtype bf16] [--latency-ms 2,10] [--repeats 3]

Without CKPT_DIR a small checkpoint is written first (benchmarks/make_checkpoint.py, about 90 MB).
The merges run on a folder of hard links to the rank files alone (no config.json: no model check,
so the figures are reading and writing only), each as its own process (benchmarks/measure.py:
wall time, peak RSS of its tree). Cold: the rank files' cached pages dropped first with
posix_fadvise(DONTNEED) (the kernel may keep pages it cannot drop; the floor is measured the
same way). The slowfs rows need /dev/fuse, fusermount3, a C compiler and the fuse3 headers
(apt-get install fuse3 libfuse3-dev); they are left out, with the reason, where one is missing.
The best of --repeats runs is shown; the machine's load is printed with the table. On a loaded
machine, `--floor-each` measures the slowfs floor again (at its best N) just before each merge, and
each row's ratio is to that floor: side by side.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import busy_cores, run_measured  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
READ = 8 << 20
THREADS = (1, 4, 8, 16, 32, 64)


def rank_files(folder: str) -> list[str]:
    return sorted(p for p in glob.glob(os.path.join(folder, "*")) if os.path.isfile(p) and not p.endswith(".json"))


def bare_copy(checkpoint: str, into: str) -> str:
    """A folder of the checkpoint's rank files alone, hard-linked where the filesystem allows."""
    os.makedirs(into, exist_ok=True)
    for path in rank_files(checkpoint):
        target = os.path.join(into, os.path.basename(path))
        if os.path.exists(target):  # a --workdir used before
            os.remove(target)
        try:
            os.link(path, target)
        except OSError:
            shutil.copyfile(path, target)
    return into


def drop_cached(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_floor(paths: list[str], threads: int) -> float:
    """Seconds for `threads` threads to read every byte of `paths` with 8 MB preads (a shared queue)."""
    jobs = [(p, at, min(READ, os.path.getsize(p) - at)) for p in paths for at in range(0, os.path.getsize(p), READ)]
    lock, fds = threading.Lock(), {p: os.open(p, os.O_RDONLY) for p in paths}

    def work():
        buffer = memoryview(bytearray(READ))
        while True:
            with lock:
                if not jobs:
                    return
                path, at, length = jobs.pop()
            os.preadv(fds[path], [buffer[:length]], at)

    start = time.perf_counter()
    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - start
    for fd in fds.values():
        os.close(fd)
    return seconds


def best_floor(paths: list[str], cold: bool, repeats: int) -> tuple[float, int]:
    """(the best seconds, its thread count) over THREADS."""
    found = []
    for n in THREADS:
        for _ in range(repeats):
            if cold:
                drop_cached(paths)
            found.append((read_floor(paths, n), n))
    return min(found)


def merge(src: str, out: str, mode: str, dtype: str, paths: list[str], cold: bool, repeats: int) -> dict:
    """The best of `repeats` merges as processes of their own: the bytes' s (-v's "wrote ... in"), the
    merge's own s (planning too), the process's, peak RSS."""
    best = None
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        if cold:
            drop_cached(paths)
        argv = [sys.executable, "-m", "fsdpfast", "merge", src, "--out", out, "--quiet", "--json", "-v"]
        run = run_measured(argv + ["--dtype", dtype, "--read-mode", mode])
        if run.returncode != 0:
            raise SystemExit(f"merge failed ({mode}): {run.stderr.strip()}")
        report = json.loads(run.stdout)
        wrote = re.search(r"rank 0 wrote \d+ bytes in ([0-9.]+) s", run.stderr)
        found = {"write": float(wrote.group(1)) if wrote else float("nan"), "merge": report["seconds"]}
        found.update(wall=run.seconds, rss=run.peak_rss, notes=report["notes"])
        if best is None or found["write"] < best["write"]:
            best = found
    shutil.rmtree(out, ignore_errors=True)
    return best


class SlowMount:
    """`folder` served through slowfs at `latency_ms` per read request, mounted at `mount`."""

    def __init__(self, binary: str, folder: str, mount: str, latency_ms: float, options: list[str]):
        os.makedirs(mount, exist_ok=True)
        argv = [binary, folder, mount, "--latency-us", str(int(latency_ms * 1000)), "-f", *options]
        self.mount, self.server = mount, subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        for _ in range(200):
            if os.path.ismount(mount) or self.server.poll() is not None:
                break
            time.sleep(0.05)
        if not os.path.ismount(mount):
            self.server.kill()
            raise RuntimeError(f"slowfs did not mount: {self.server.communicate()[1].strip()[:300]}")

    def close(self) -> str:
        subprocess.run(["fusermount3", "-u", self.mount], capture_output=True)
        try:
            return self.server.communicate(timeout=30)[1].strip()
        except subprocess.TimeoutExpired:
            self.server.kill()
            return ""


def built_slowfs(into: str) -> tuple[str | None, str]:
    """(the slowfs binary, or None and why not)."""
    if not os.path.exists("/dev/fuse"):
        return None, "/dev/fuse is missing"
    if shutil.which("fusermount3") is None:
        return None, "fusermount3 is missing (apt-get install fuse3)"
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True)
    if flags.returncode != 0:
        return None, "the fuse3 headers are missing (apt-get install libfuse3-dev pkg-config)"
    binary = os.path.join(into, "slowfs")
    built = subprocess.run(
        ["cc", "-O2", "-o", binary, os.path.join(HERE, "slowfs.c"), *flags.stdout.split()],
        capture_output=True,
        text=True,
    )
    return (binary, "") if built.returncode == 0 else (None, f"slowfs did not build: {built.stderr.strip()[:200]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", help="an FSDP checkpoint folder (default: a small one is written)")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--latency-ms", default="2", help="slowfs latencies per read request, e.g. 2,10 ('' : none)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each row; the best is shown")
    parser.add_argument(
        "--slowfs-option", action="append", default=[], help="passed to slowfs, e.g. -o max_read=1048576"
    )
    parser.add_argument(
        "--floor-each", action="store_true", help="slowfs rows: the floor measured again just before each merge"
    )
    parser.add_argument("--no-local", action="store_true", help="the slowfs rows alone (no local warm/cold rows)")
    parser.add_argument("--workdir", default=None, help="where the bare copy and the outputs go (default: a temp dir)")
    args = parser.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="fsdpfast-read-modes-")
    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint = os.path.join(work, "checkpoint")
        if not rank_files(checkpoint):
            print(f"writing a small checkpoint into {checkpoint} ...", flush=True)
            make = [sys.executable, os.path.join(HERE, "make_checkpoint.py"), checkpoint, "--hidden", "512"]
            subprocess.run(make + ["--layers", "4", "--intermediate", "1408", "--vocab", "8000"], check=True)
    backing = bare_copy(checkpoint, os.path.join(work, "backing", "ckpt"))
    paths = rank_files(backing)
    total = sum(os.path.getsize(p) for p in paths)
    out = os.path.join(work, "out")
    print(f"{len(paths)} rank files, {total / 1e6:.0f} MB, --dtype {args.dtype}; best of {args.repeats}", flush=True)
    print(
        f"load before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; busy CPUs {busy_cores():.2f} of {os.cpu_count()}"
    )

    rows = []  # (storage, reader, the merge's figures, floor seconds, floor threads)
    for cold in () if args.no_local else (False, True):
        where = "local cold" if cold else "local warm"
        floor, threads = best_floor(paths, cold, args.repeats)
        for mode in ("mmap", "pread"):
            found = merge(backing, out, mode, args.dtype, paths, cold, args.repeats)
            rows.append((where, mode, found, floor, threads))

    latencies = [float(x) for x in args.latency_ms.split(",") if x.strip()]
    binary, why_not = built_slowfs(work) if latencies else (None, "no latency asked")
    for latency in latencies if binary else []:
        mount = SlowMount(binary, os.path.dirname(backing), os.path.join(work, "mount"), latency, args.slowfs_option)
        try:
            through = os.path.join(mount.mount, "ckpt")
            mounted = rank_files(through)
            floor, threads = best_floor(mounted, True, 1)
            for mode in ("auto", "mmap"):
                # the floor again at its best N just before each merge: the machine's load moves between rows
                beside = floor
                if args.floor_each:
                    drop_cached(mounted + paths)
                    beside = read_floor(mounted, threads)
                found = merge(through, out, mode, args.dtype, mounted + paths, True, args.repeats)
                name = "pread (auto)" if mode == "auto" and any("FUSE" in n for n in found["notes"]) else mode
                rows.append((f"slowfs {latency:g} ms", name, found, beside, threads))
        finally:
            said = mount.close()
        if said:
            print(f"slowfs {latency:g} ms: {said.splitlines()[-1]}")

    print()
    print("write s: the bytes read, converted and written (-v's figure); merge s: planning too; process s: all")
    print(
        "| storage | reader | write s | input MB/s | merge s | process s | peak RSS MB | read floor s (threads) | floor / write |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for where, mode, found, floor, threads in rows:
        seconds = found["write"]
        print(
            f"| {where} | {mode} | {seconds:.2f} | {total / seconds / 1e6:.0f} | {found['merge']:.2f} | "
            f"{found['wall']:.2f} | {found['rss'] / 1e6:.0f} | {floor:.2f} ({threads}) | {floor / seconds:.2f} |"
        )
    if not binary:
        print(f"\nslowfs rows left out: {why_not}")
    print(f"load after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
