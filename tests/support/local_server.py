"""What the tests' local servers share (fake-gcs-server, Azurite, s3rver in the benchmarks): a free
127.0.0.1 port, a program started there and waited for, stopped at the end."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalServer:
    """A server program on `self.port`; subclasses say how it is started (`command`) and when it is up (`ready`)."""

    name = "the server"

    def __init__(self):
        self.port = free_port()
        self.process = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether it answers; the default: it accepts a connection."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=1):
            return True

    def start(self):
        self.process = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                if self.ready():
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None
