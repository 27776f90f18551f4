"""Helpers for tests/test_redis.py: a private, throw-away ``redis-server``.

Key names come from the backend itself (``RedisBackend.keys(queue)``, a ``QueueKeys``).

The private server exists so a test can stop and restart Redis under running workers without
ever touching the shared server (127.0.0.1:6379) that the rest of the suite and other test
sessions use. It listens on a free loopback port, keeps its data in the test's own tmp folder,
and is killed by pid (only this process, never by name) when the ``with`` block ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path
from typing import Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.procs import wait_until


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


class PrivateRedis:
    """``redis-server`` on ``port`` with an append-only file fsynced on every write.

    ``appendfsync always`` makes every acknowledged write durable, so a restart from the same
    ``--dir`` brings back exactly what clients were told was written. ``--save ""`` turns RDB
    snapshots off: the AOF is the only persistence, which is what ``SHUTDOWN NOSAVE`` keeps.
    """

    def __init__(self, port: int, directory: Path) -> None:
        self.port = port
        self.directory = directory
        self.url = f"redis://127.0.0.1:{port}/0"
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def args(self) -> list[str]:
        binary = redis_server_binary()
        assert binary, "redis-server is not on PATH"
        return [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.directory),
            "--daemonize", "no",
        ]

    def client(self) -> redis.Redis:
        # No retries: redis-py 6+ retries a failed command up to 10 times with backoff, which
        # would turn SHUTDOWN's dropped connection (and each poll of a down server) into seconds.
        return redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0))

    def start(self, timeout: float = 20) -> None:
        assert self.popen is None or self.popen.poll() is not None, "already running"
        self.starts += 1
        log = open(self.directory / f"redis-{self.starts}.log", "wb")  # noqa: SIM115 (kept for the process)
        self.popen = subprocess.Popen(
            self.args(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()  # the child holds its own copy

        def answers() -> bool:
            if self.popen is not None and self.popen.poll() is not None:
                raise AssertionError(f"redis-server exited ({self.popen.returncode}):\n{self.log()}")
            try:
                with self.client() as c:
                    # PING answers LOADING errors while the AOF is replayed: wait until it is served.
                    return bool(c.ping()) and c.info("persistence").get("loading") == 0
            except redis.exceptions.RedisError:
                return False

        wait_until(answers, timeout, f"the private redis-server on port {self.port}", interval=0.05)

    def shutdown_nosave(self, timeout: float = 20) -> int:
        """``SHUTDOWN NOSAVE`` (no RDB snapshot; the AOF is flushed) and wait for the exit."""
        assert self.popen is not None
        with self.client() as c:
            c.shutdown(nosave=True)  # redis-py swallows the dropped connection that follows
        return self.popen.wait(timeout)

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.directory.glob("redis-*.log")))

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            try:
                os.kill(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait(10)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
