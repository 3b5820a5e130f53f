"""What one GET costs a test S3 server, by the size it asks for: one object of 170 MB (a rank file of the
merge benchmark's checkpoint), read whole and by ranges of 32, 8 and 1 MB, against moto and, given
--s3rver, s3rver (npm), one after the other in one run. Each GET is timed alone (nothing else in flight),
with the server's CPU seconds meanwhile; each size is read REPEAT times (median printed).

    python benchmarks/object_store_get_cost.py [--s3rver node_modules/.bin/s3rver] [--mb 170]

What it shows: moto answers every GET by reading the whole object (moto.s3.models.FakeKey.value), so a
1 MB range costs it about what the whole object does; a server that reads only the range (s3rver reads
that range of its file) charges for the bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))
sys.path.insert(0, os.path.dirname(__file__))
from object_store_merge import BUCKET, S3rver  # noqa: E402
from s3_server import S3Server  # noqa: E402

REPEAT = 3
SIZES = [("whole", None), ("32 MB", 32 << 20), ("8 MB", 8 << 20), ("1 MB", 1 << 20)]


def _cpu(process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def measure(server, key: str, secret: str, nbytes: int) -> list[tuple[str, float, float]]:
    import obstore
    import psutil
    from obstore.store import S3Store

    store = S3Store(
        BUCKET,
        config={"endpoint": server.url, "access_key_id": key, "secret_access_key": secret, "region": "us-east-1"},
        client_options={"allow_http": True},
    )
    obstore.put(store, "object", os.urandom(nbytes), chunk_size=16 << 20)
    etag = obstore.head(store, "object")["e_tag"]
    process = psutil.Process(server.process.pid)
    rows = []
    for label, size in SIZES:
        walls, cpus = [], []
        for i in range(REPEAT):
            options = {"if_match": etag}
            if size is not None:
                start = (i * 37 << 20) % (nbytes - size)  # somewhere else each time
                options["range"] = (start, start + size)
            cpu, wall = _cpu(process), time.perf_counter()
            for _ in obstore.get(store, "object", options=options).stream(min_chunk_size=1 << 20):
                pass
            walls.append(time.perf_counter() - wall)
            cpus.append(_cpu(process) - cpu)
        rows.append((label, statistics.median(walls), statistics.median(cpus)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--s3rver", metavar="PROGRAM", help="s3rver (npm) too")
    parser.add_argument("--mb", type=int, default=170, help="the object's size")
    args = parser.parse_args()
    results = {}
    servers = [("moto", lambda: S3Server(), ("test", "test"))]
    if args.s3rver:
        servers.append(("s3rver", lambda: S3rver(args.s3rver), S3rver.credentials))
    for name, make, (key, secret) in servers:
        server = make()
        server.start()
        try:
            if name == "moto":
                server.client().create_bucket(Bucket=BUCKET)
            else:
                server.create_bucket()
            results[name] = measure(server, key, secret, args.mb << 20)
        finally:
            server.stop()
    print(f"one {args.mb} MB object, one GET at a time, median of {REPEAT}\n")
    print("| GET | " + " | ".join(f"{n} wall s | {n} server CPU s" for n in results) + " |")
    print("|---|" + "---|---|" * len(results))
    for i, (label, _) in enumerate(SIZES):
        cells = " | ".join(f"{results[n][i][1]:.2f} | {results[n][i][2]:.2f}" for n in results)
        print(f"| {label} | {cells} |")


if __name__ == "__main__":
    main()
