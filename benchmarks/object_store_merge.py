"""One-pass merge S3 -> S3 against download, merge locally, upload (obstore's concurrent GETs and multipart
PUTs), side by side against one moto S3 server on 127.0.0.1 (started here, behind a counting TCP proxy).

    python benchmarks/object_store_merge.py CKPT_DIR      # a checkpoint folder (benchmarks/make_checkpoint.py)

Each way runs as its own process (`python -m fsdpfast ...` / this file's --download-merge-upload); measured
from outside while it runs: wall time, peak RSS of its whole process tree, peak local disk used (blocks
allocated under its TMPDIR and work folder, sampled every 50 ms), and the most requests in flight at once
(counted at the proxy: a request from its first byte until its response's), the CPU seconds of its process
tree and of the moto server meanwhile, and its GETs (count, bytes asked for; each process records its own
GETs into a file named by FSDPFAST_BENCH_TRACE). Then the one pass's two halves apart (s3:// -> local,
local -> s3://), to tell the reading's cost from the writing's, and download + local merge beside the
first. Prints one table.

    --get-mb N --threads N      the one pass's ranged GETs of at most N MB, N in flight (default: fsdpfast's)
    --gap-mb N                  the one pass's ranges of an object less than N MB apart joined into one GET
    --ways 3,5                  only these rows (numbered as printed)
    --s3rver PROGRAM            against s3rver (`npm install s3rver`; node_modules/.bin/s3rver) instead of
                                moto: a server that reads only the range a GET asks for
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))
from local_server import LocalServer  # noqa: E402
from s3_server import S3Server  # noqa: E402
from tcp_proxy import TcpProxy  # noqa: E402

BUCKET = "bench"


def _store():
    from obstore.store import S3Store

    return S3Store(BUCKET, config={"endpoint": os.environ["AWS_ENDPOINT_URL"]}, client_options={"allow_http": True})


def _files(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(root, f), folder) for root, _, files in os.walk(folder) for f in files)


def upload(folder: str, prefix: str, threads: int = 8) -> None:
    """Every file of `folder` as objects under `prefix`, multipart with parts in flight (obstore.put)."""
    import obstore

    store = _store()

    def put(name: str) -> None:
        with open(os.path.join(folder, name), "rb") as handle:
            obstore.put(store, f"{prefix}/{name}", handle, chunk_size=16 << 20, max_concurrency=8)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, _files(folder)))


class _Gets:
    """The GETs this process made (count, bytes asked for), written as JSON at exit to FSDPFAST_BENCH_TRACE."""

    count = 0
    nbytes = 0
    lock = threading.Lock()

    @classmethod
    def add(cls, nbytes: int) -> None:
        with cls.lock:
            cls.count += 1
            cls.nbytes += nbytes

    @classmethod
    def dump(cls) -> None:
        path = os.environ.get("FSDPFAST_BENCH_TRACE")
        if path:
            with open(path, "w") as handle:
                json.dump({"gets": cls.count, "bytes": cls.nbytes}, handle)


def traced_merge(argv: list[str]) -> int:
    """fsdpfast's command line with each GET of the merge counted (the store's read calls wrapped)."""
    from fsdpfast.cli import main
    from fsdpfast.remote import metadata_mirror, range_sources

    for module in (range_sources, metadata_mirror):
        original = module.get_pinned

        def counted(store, key, start, end, etag, original=original):
            _Gets.add(end - start)
            return original(store, key, start, end, etag)

        module.get_pinned = counted
    if os.environ.get("FSDPFAST_BENCH_GET_MB"):
        range_sources.GET_BYTES = int(float(os.environ["FSDPFAST_BENCH_GET_MB"]) * (1 << 20))
    if os.environ.get("FSDPFAST_BENCH_THREADS"):
        range_sources.THREADS = int(os.environ["FSDPFAST_BENCH_THREADS"])
    if os.environ.get("FSDPFAST_BENCH_GAP_MB"):
        range_sources.GAP_BYTES = int(float(os.environ["FSDPFAST_BENCH_GAP_MB"]) * (1 << 20))
    try:
        return main(argv)
    finally:
        _Gets.dump()


def download(prefix: str, folder: str, threads: int = 8) -> None:
    """Every object under `prefix` into `folder`, streamed to disk in chunks, objects in parallel."""
    import obstore

    store = _store()
    listed = [m for batch in obstore.list(store, prefix=f"{prefix}/") for m in batch]

    def get(meta) -> None:
        local = os.path.join(folder, meta["path"][len(prefix) + 1 :])
        os.makedirs(os.path.dirname(local), exist_ok=True)
        _Gets.add(meta["size"])
        with open(local, "wb") as handle:
            for chunk in obstore.get(store, meta["path"]).stream(min_chunk_size=8 << 20):
                handle.write(chunk)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(get, listed))


def download_merge_upload(src: str, dst: str, work: str) -> None:
    import fsdpfast

    try:
        download(src, os.path.join(work, "ckpt"))
        fsdpfast.merge(os.path.join(work, "ckpt"), os.path.join(work, "merged"))
        if dst != "-":  # "-": the output stays local (the read side's counterpart of s3:// -> local)
            upload(os.path.join(work, "merged"), dst)
    finally:
        _Gets.dump()


class _Sampler:
    """Peak RSS of a process and its descendants, and peak blocks allocated under some folders."""

    def __init__(self, pid: int, folders: list[str]):
        import psutil

        self.root, self.folders = psutil.Process(pid), folders
        self.rss = self.disk = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                tree = [self.root, *self.root.children(recursive=True)]
                self.rss = max(self.rss, sum(p.memory_info().rss for p in tree))
            except psutil.Error:
                pass
            self.disk = max(self.disk, sum(_blocks(folder) for folder in self.folders))
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _blocks(folder: str) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def _cpu(process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _measure(name: str, command: list[str], proxy: TcpProxy, env: dict, scratch: str, server) -> dict:
    import psutil

    tmp = tempfile.mkdtemp(dir=scratch)
    trace = os.path.join(scratch, "gets.json")
    proxy.peak = 0
    moto = psutil.Process(server.process.pid)  # the server (moto, or s3rver)
    moto_cpu, children = _cpu(moto), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    command = [c.replace("{tmp}", tmp) for c in command]
    process = subprocess.Popen(command, env={**env, "TMPDIR": tmp, "FSDPFAST_BENCH_TRACE": trace})
    sampler = _Sampler(process.pid, [tmp])
    code = process.wait()
    sampler.stop()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    shutil.rmtree(tmp, ignore_errors=True)
    if code != 0:
        raise SystemExit(f"{name}: exit {code}")
    with open(trace) as handle:
        gets = json.load(handle)
    os.unlink(trace)
    return {
        "way": name,
        "s": seconds,
        "rss": sampler.rss,
        "disk": sampler.disk,
        "in_flight": proxy.peak,
        "cpu": cpu,
        "server_cpu": _cpu(moto) - moto_cpu,
        **gets,
    }


class S3rver(LocalServer):
    """s3rver (npm `s3rver`, a Node S3 server over files) on a free 127.0.0.1 port: it serves a ranged GET by
    reading that range of its file, where moto reads the whole object for each (the comparison's point)."""

    name = "s3rver"
    credentials = ("S3RVER", "S3RVER")  # the only keys it accepts

    def __init__(self, program: str):
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}"
        self.program, self.folder = program, tempfile.mkdtemp(prefix="fsdpfast-s3rver-")

    def command(self) -> list[str]:
        return [self.program, "-d", self.folder, "-a", "127.0.0.1", "-p", str(self.port), "--silent"]

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def create_bucket(self) -> None:
        import boto3

        key, secret = self.credentials
        boto3.client(
            "s3", endpoint_url=self.url, aws_access_key_id=key, aws_secret_access_key=secret, region_name="us-east-1"
        ).create_bucket(Bucket=BUCKET)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", nargs="?")
    parser.add_argument("--download-merge-upload", nargs=3, metavar=("SRC", "DST", "WORK"))
    parser.add_argument("--get-mb", type=float, help="the one pass's largest ranged GET, MB")
    parser.add_argument("--threads", type=int, help="the one pass's GETs in flight")
    parser.add_argument("--gap-mb", type=float, help="the one pass joins ranges of an object less than this apart")
    parser.add_argument("--ways", help="the rows to run, by number (1-5, comma-separated; default all)")
    parser.add_argument("--s3rver", metavar="PROGRAM", help="the server: s3rver (npm) at PROGRAM instead of moto")
    if sys.argv[1:2] == ["--traced"]:  # a merge measured by the table's run
        raise SystemExit(traced_merge(sys.argv[2:]))
    args = parser.parse_args()
    if args.download_merge_upload:
        return download_merge_upload(*args.download_merge_upload)
    if args.get_mb:
        os.environ["FSDPFAST_BENCH_GET_MB"] = str(args.get_mb)
    if args.threads:
        os.environ["FSDPFAST_BENCH_THREADS"] = str(args.threads)
    if args.gap_mb is not None:
        os.environ["FSDPFAST_BENCH_GAP_MB"] = str(args.gap_mb)
    server = S3rver(args.s3rver) if args.s3rver else S3Server()
    key, secret = server.credentials if args.s3rver else ("test", "test")
    server.start()
    proxy = TcpProxy(server.port).start()
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": proxy.url,
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_REGION": "us-east-1",
    }
    os.environ.update(env)
    scratch = tempfile.mkdtemp(prefix="fsdpfast-bench-")
    traced = [sys.executable, __file__, "--traced", "merge"]
    ways = [
        ("one pass", [*traced, f"s3://{BUCKET}/run", "--out", f"s3://{BUCKET}/one"]),
        ("download, merge, upload", [sys.executable, __file__, "--download-merge-upload", "run", "three", "{tmp}"]),
        # the two halves of the one pass, apart: what reading costs, what writing costs
        ("(s3:// -> local)", [*traced, f"s3://{BUCKET}/run", "--out", "{tmp}/merged"]),
        ("(local -> s3://)", [*traced, args.checkpoint, "--out", f"s3://{BUCKET}/half"]),
        ("(download, merge to local)", [sys.executable, __file__, "--download-merge-upload", "run", "-", "{tmp}"]),
    ]
    if args.ways:
        ways = [ways[int(n) - 1] for n in args.ways.split(",")]
    try:
        server.create_bucket() if args.s3rver else server.client().create_bucket(Bucket=BUCKET)
        upload(args.checkpoint, "run")
        size = sum(os.path.getsize(os.path.join(args.checkpoint, f)) for f in _files(args.checkpoint))
        rows = [_measure(name, command, proxy, env, scratch, server) for name, command in ways]
    finally:
        proxy.stop()
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    name = "s3rver (npm)" if args.s3rver else "moto S3"
    print(f"checkpoint {size / 1e6:.0f} MB ({len(_files(args.checkpoint))} files), {name} on 127.0.0.1\n")
    print(
        "| way | wall s | peak RSS MB (process tree) | peak local disk MB | requests in flight (most) "
        "| CPU s (its processes) | server CPU s | GETs | MB asked by GETs |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['way']} | {r['s']:.1f} | {r['rss'] / 1e6:.0f} | {r['disk'] / 1e6:.0f} | {r['in_flight']} "
            f"| {r['cpu']:.1f} | {r['server_cpu']:.1f} | {r['gets']} | {r['bytes'] / 1e6:.0f} |"
        )
    if not args.ways:
        print(f"\none pass / download-merge-upload wall time: {rows[0]['s'] / rows[1]['s']:.2f}")


if __name__ == "__main__":
    main()
