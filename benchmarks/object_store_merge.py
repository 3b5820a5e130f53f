"""One-pass merge S3 -> S3 against download, merge locally, upload (obstore's concurrent GETs and multipart
PUTs), side by side against one moto S3 server on 127.0.0.1 (started here, behind a counting TCP proxy).

    python benchmarks/object_store_merge.py CKPT_DIR      # a checkpoint folder (benchmarks/make_checkpoint.py)

Each way runs as its own process (`python -m fsdpfast ...` / this file's --download-merge-upload); measured
from outside while it runs: wall time, peak RSS of its whole process tree, peak local disk used (blocks
allocated under its TMPDIR and work folder, sampled every 50 ms), and the most requests in flight at once
(counted at the proxy: a request from its first byte until its response's). Then the one pass's two halves
apart (s3:// -> local, local -> s3://), to tell the reading's cost from the writing's, and the local merge
(local -> local) beside them: what the store's target holds above it. Prints one table.

    python benchmarks/object_store_merge.py CKPT_DIR --halves         # the halves and the local merge only
    python benchmarks/object_store_merge.py CKPT_DIR --halves --before OLD_TREE
        # local -> s3:// also with the fsdpfast package of OLD_TREE (a tree holding fsdpfast/, e.g.
        # `git archive REV fsdpfast | tar -x -C OLD_TREE` plus the built extension's .so files)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))
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


def download(prefix: str, folder: str, threads: int = 8) -> None:
    """Every object under `prefix` into `folder`, streamed to disk in chunks, objects in parallel."""
    import obstore

    store = _store()
    listed = [m for batch in obstore.list(store, prefix=f"{prefix}/") for m in batch]

    def get(meta) -> None:
        local = os.path.join(folder, meta["path"][len(prefix) + 1 :])
        os.makedirs(os.path.dirname(local), exist_ok=True)
        with open(local, "wb") as handle:
            for chunk in obstore.get(store, meta["path"]).stream(min_chunk_size=8 << 20):
                handle.write(chunk)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(get, listed))


def download_merge_upload(src: str, dst: str, work: str) -> None:
    import fsdpfast

    download(src, os.path.join(work, "ckpt"))
    fsdpfast.merge(os.path.join(work, "ckpt"), os.path.join(work, "merged"))
    upload(os.path.join(work, "merged"), dst)


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


def _measure(name: str, command: list[str], proxy: TcpProxy, env: dict, scratch: str) -> dict:
    tmp = tempfile.mkdtemp(dir=scratch)
    proxy.peak = 0
    start = time.perf_counter()
    command = [c.replace("{tmp}", tmp) for c in command]
    process = subprocess.Popen(command, env={**env, "TMPDIR": tmp})
    sampler = _Sampler(process.pid, [tmp])
    code = process.wait()
    sampler.stop()
    seconds = time.perf_counter() - start
    shutil.rmtree(tmp, ignore_errors=True)
    if code != 0:
        raise SystemExit(f"{name}: exit {code}")
    return {"way": name, "s": seconds, "rss": sampler.rss, "disk": sampler.disk, "in_flight": proxy.peak}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", nargs="?")
    parser.add_argument("--download-merge-upload", nargs=3, metavar=("SRC", "DST", "WORK"))
    parser.add_argument("--halves", action="store_true", help="only the halves apart and the local merge")
    parser.add_argument("--before", help="a tree whose fsdpfast/ runs local -> s3:// once more, beside")
    args = parser.parse_args()
    if args.download_merge_upload:
        return download_merge_upload(*args.download_merge_upload)
    server = S3Server()
    server.start()
    proxy = TcpProxy(server.port).start()
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": proxy.url,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
    }
    os.environ.update(env)
    scratch = tempfile.mkdtemp(prefix="fsdpfast-bench-")
    try:
        server.client().create_bucket(Bucket=BUCKET)
        upload(args.checkpoint, "run")
        size = sum(os.path.getsize(os.path.join(args.checkpoint, f)) for f in _files(args.checkpoint))
        merge = [sys.executable, "-m", "fsdpfast", "merge"]
        rows = []
        if not args.halves:
            rows += _both_ways(proxy, env, scratch)
        rows += [
            # the two halves of the one pass, apart: what reading costs, what writing costs
            _measure("(s3:// -> local)", [*merge, f"s3://{BUCKET}/run", "--out", "{tmp}/merged"], proxy, env, scratch),
            _measure(
                "(local -> s3://)", [*merge, args.checkpoint, "--out", f"s3://{BUCKET}/half"], proxy, env, scratch
            ),
            _measure("(local -> local)", [*merge, args.checkpoint, "--out", "{tmp}/merged"], proxy, env, scratch),
        ]
        if args.before:
            before = {**env, "PYTHONPATH": os.path.abspath(args.before), "PYTHONSAFEPATH": "1"}  # not the cwd's
            out = f"s3://{BUCKET}/before"
            rows.append(
                _measure("(local -> s3://, --before)", [*merge, args.checkpoint, "--out", out], proxy, before, scratch)
            )
    finally:
        proxy.stop()
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"checkpoint {size / 1e6:.0f} MB ({len(_files(args.checkpoint))} files), moto S3 on 127.0.0.1\n")
    print("| way | wall s | peak RSS MB (process tree) | peak local disk MB | requests in flight (most) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['way']} | {r['s']:.1f} | {r['rss'] / 1e6:.0f} | {r['disk'] / 1e6:.0f} | {r['in_flight']} |")


def _both_ways(proxy: TcpProxy, env: dict, scratch: str) -> list[dict]:
    """The one pass s3:// -> s3:// and download, merge, upload."""
    one = [sys.executable, "-m", "fsdpfast", "merge", f"s3://{BUCKET}/run", "--out", f"s3://{BUCKET}/one"]
    three = [sys.executable, __file__, "--download-merge-upload", "run", "three", "{tmp}"]
    return [
        _measure("one pass", one, proxy, env, scratch),
        _measure("download, merge, upload", three, proxy, env, scratch),
    ]


if __name__ == "__main__":
    main()
