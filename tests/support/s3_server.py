"""A real S3 server (moto's standalone server, `moto[server]`) on a free 127.0.0.1 port, and what the
tests ask of it through boto3 (an independent client: what a user's tools would see)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class S3Server:
    def __init__(self, **env: str):
        """`env`: moto's settings, e.g. S3_UPLOAD_PART_MIN_SIZE="4096" (its 5 MB minimum part, for tiny tests)."""
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env
        self.process = None

    def start(self):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **self.env},
        )
        for _ in range(200):
            try:
                urllib.request.urlopen(self.url, timeout=1)
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the moto server did not start")

    def stop(self):
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None

    def client(self, url: str | None = None):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=url or self.url,
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
        )


def upload_folder(client, folder: str, bucket: str, prefix: str) -> None:
    for root, _, files in os.walk(folder):
        for file in files:
            path = os.path.join(root, file)
            client.upload_file(path, bucket, f"{prefix}/{os.path.relpath(path, folder)}")


def objects(client, bucket: str, prefix: str = "") -> dict[str, bytes]:
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            found[item["Key"][len(prefix) :].lstrip("/")] = client.get_object(Bucket=bucket, Key=item["Key"])[
                "Body"
            ].read()
    return found


def pending_uploads(client, bucket: str) -> list:
    return client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
