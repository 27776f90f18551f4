"""A TCP proxy whose link flaps: down most of each period, then up for a moment.

Every connection through it is real; while the link is down, the proxy cuts the connections it
carries and closes new ones at once, so clients see their server's connection errors.
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Self

from tests.servers import free_port


class FlappingProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``. :meth:`flap` makes the link go down at
    ``first_down`` (a ``time.monotonic()`` moment) for ``down`` seconds of every ``period``,
    until ``until``; it is up otherwise."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.05)
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._schedule: tuple[float, float, float, float] | None = None
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._accept, daemon=True),
            threading.Thread(target=self._cut, daemon=True),
        ]

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stopping = True
        for thread in self._threads:
            thread.join(5)
        self._listener.close()
        self._close_all()

    def url(self, database: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{database}"

    def flap(self, first_down: float, period: float, down: float, until: float) -> None:
        self._schedule = (first_down, period, down, until)

    def is_down(self, now: float | None = None) -> bool:
        if self._schedule is None:
            return False
        first_down, period, down, until = self._schedule
        now = time.monotonic() if now is None else now
        return first_down <= now < until and (now - first_down) % period < down

    # -- the threads --

    def _accept(self) -> None:
        while not self._stopping:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            if self.is_down():
                client.close()
                continue
            try:
                server = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, server))
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            self._close(sock)

    def _cut(self) -> None:
        """While the link is down, every connection through it is cut."""
        while not self._stopping:
            if self.is_down():
                self._close_all()
            time.sleep(0.005)

    def _close_all(self) -> None:
        with self._lock:
            open_, self._open = self._open, set()
        for sock in open_:
            self._shut(sock)

    def _close(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.discard(sock)
        self._shut(sock)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
