"""A TCP proxy on 127.0.0.1 in front of a test server, to fail it on purpose and to count what goes through.

`stop()` closes the listening socket and resets every open connection (to a client the server is
gone); `start()` listens again on the same port. `drop(marker, times)`: the next `times` connections
that send a request whose bytes hold `marker` (b"partNumber=": a part upload) are reset before it is
forwarded; `outage(until)` resets every request until one holding `until` has come. `peak` is the most connections that carried a request at once (requests in flight: a
client keeps one request per connection at a time)."""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.port = 0
        self.peak = 0
        self.dropped = 0
        self._busy = 0
        self._drops: list[tuple[bytes, int]] = []
        self._until: bytes | None = None
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._open = list(self._open), set()
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            except OSError:
                pass
            listener.close()
        for sock in sockets:
            _reset(sock)

    def drop(self, marker: bytes, times: int = 1) -> None:
        with self._lock:
            self._drops.append((marker, times))

    def outage(self, until: bytes) -> None:
        """Every request reset (the server down) until one holding `until` has been reset too; then the
        server answers again (a client's next retry of that request goes through)."""
        with self._lock:
            self._until = until

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed by stop()
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                if self._listener is not listener:  # stopped meanwhile
                    _reset(client), _reset(server)
                    return
                self._open |= {client, server}
            state = {"busy": False}
            threading.Thread(target=self._pipe, args=(client, server, state, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, state, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, state: dict, upstream: bool) -> None:
        try:
            while True:
                data = source.recv(1 << 16)
                if not data:
                    break
                if upstream and self._dropping(data):
                    _reset(source), _reset(sink)
                    break
                self._mark(state, upstream)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            self._mark(state, None)
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _mark(self, state: dict, upstream: bool | None) -> None:
        """A connection is busy from its request's first bytes until the response's first bytes come back
        (None: closed): requests in flight, counted at the proxy."""
        with self._lock:
            busy = upstream is True
            if busy != state["busy"]:
                state["busy"] = busy
                self._busy += 1 if busy else -1
                self.peak = max(self.peak, self._busy)

    def _dropping(self, data: bytes) -> bool:
        with self._lock:
            if self._until is not None:
                if self._until in data:
                    self._until = None
                self.dropped += 1
                return True
            for i, (marker, times) in enumerate(self._drops):
                if marker in data and times > 0:
                    self._drops[i] = (marker, times - 1)
                    self.dropped += 1
                    return True
        return False


def _reset(sock: socket.socket) -> None:
    """Closed now, though another thread may be blocked reading it (close alone would wait for that)."""
    for step in (lambda: sock.shutdown(socket.SHUT_RDWR), sock.close):
        try:
            step()
        except OSError:
            pass
