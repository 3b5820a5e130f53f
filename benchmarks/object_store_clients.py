"""Which client reads an object store faster: ranged GETs of one object, many in flight, against a local
S3 server (moto's standalone server on 127.0.0.1, started here), through obstore and through boto3.

    python benchmarks/object_store_clients.py [--mb 256] [--range-mb 8] [--threads 32]

Prints one table: MB/s per client and concurrency, measured side by side in one run. The server is
the bottleneck it is (one Python process), so only the ratio between clients means anything.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))
from s3_server import S3Server  # noqa: E402


def _obstore_reader(bucket: str):
    from obstore.store import S3Store

    store = S3Store(bucket, config={"endpoint": os.environ["AWS_ENDPOINT_URL"]}, client_options={"allow_http": True})
    import obstore

    return lambda key, start, end: len(obstore.get_range(store, key, start=start, end=end))


def _boto3_reader(server: S3Server, bucket: str):
    import boto3
    import botocore.config

    client = boto3.client(
        "s3",
        endpoint_url=server.url,
        aws_access_key_id="t",
        aws_secret_access_key="t",
        region_name="us-east-1",
        config=botocore.config.Config(max_pool_connections=64),  # as many connections as threads
    )
    return lambda key, start, end: len(
        client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"].read()
    )


def _rate(read, key: str, size: int, range_bytes: int, threads: int) -> float:
    ranges = [(s, min(size, s + range_bytes)) for s in range(0, size, range_bytes)]
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        got = sum(pool.map(lambda r: read(key, *r), ranges))
    assert got == size
    return size / (time.perf_counter() - start) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--range-mb", type=int, default=8)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    server = S3Server()
    server.start()
    try:
        os.environ.update(AWS_ENDPOINT_URL=server.url, AWS_ACCESS_KEY_ID="t", AWS_SECRET_ACCESS_KEY="t")
        client = server.client()
        client.create_bucket(Bucket="bench")
        size = args.mb << 20
        client.put_object(Bucket="bench", Key="blob", Body=os.urandom(size))
        readers = {"obstore": _obstore_reader("bench"), "boto3": _boto3_reader(server, "bench")}
        print(f"| threads | {' | '.join(f'{n} MB/s' for n in readers)} | obstore / boto3 |")
        print(f"|---|{'---|' * len(readers)}---|")
        for threads in args.threads:
            rates = {n: _rate(r, "blob", size, args.range_mb << 20, threads) for n, r in readers.items()}
            print(
                f"| {threads} | {' | '.join(f'{v:.0f}' for v in rates.values())} | "
                f"{rates['obstore'] / rates['boto3']:.2f} |"
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
