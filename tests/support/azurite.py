"""Azurite's blob service (npm `azurite`, the Azure Storage emulator) on a free 127.0.0.1 port, in memory,
and the one call obstore cannot make: creating a container (a request signed with the emulator's
published development key, as Azure's SharedKey scheme says)."""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import shutil
import urllib.request

from local_server import LocalServer

ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="  # Azurite's documented dev key


def azurite_program() -> str | None:
    return shutil.which("azurite-blob")


class Azurite(LocalServer):
    name = "azurite"

    def __init__(self):
        super().__init__()
        self.endpoint = f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    def command(self) -> list[str]:
        return [azurite_program(), "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--inMemoryPersistence"]

    def create_container(self, name: str) -> None:
        date = email.utils.formatdate(usegmt=True)
        version = "2021-08-06"
        signed = (
            "PUT\n"
            + "\n" * 11
            + f"x-ms-date:{date}\nx-ms-version:{version}\n/{ACCOUNT}/{ACCOUNT}/{name}\nrestype:container"
        )
        signature = base64.b64encode(hmac.new(base64.b64decode(KEY), signed.encode(), hashlib.sha256).digest()).decode()
        request = urllib.request.Request(
            f"{self.endpoint}/{name}?restype=container",
            method="PUT",
            headers={
                "x-ms-date": date,
                "x-ms-version": version,
                "Content-Length": "0",
                "Authorization": f"SharedKey {ACCOUNT}:{signature}",
            },
        )
        urllib.request.urlopen(request).close()

    def storage_options(self) -> list[str]:
        return [f"endpoint={self.endpoint}", f"account_name={ACCOUNT}", f"account_key={KEY}"]
