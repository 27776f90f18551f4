"""Helpers for tests/test_beanstalk.py: raw beanstalkd access and a private, throw-away beanstalkd.

Raw access (``raw_tube``) talks to beanstalkd with its own greenstalk connection, never through
the backend under test, so what a test reads back (``stats-tube``, ``stats-job``, ``peek``) is
beanstalkd's own view. Tube names always come from ``backend.tube_name(queue)``.

The private server exists so a test can ``kill -9`` and restart beanstalkd under running
workers without touching the shared server (the one scripts/services started, used by the rest
of the suite and by concurrent test sessions). It listens on a free loopback port, keeps its
binlog in the test's own tmp folder, and is killed by pid (only the process it started).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

import greenstalk

from tests.procs import wait_until

# stats-tube fields, and the names the backend's stats() gives them.
TUBE_COUNTS = {
    "pending": "current-jobs-ready",
    "delayed": "current-jobs-delayed",
    "in_progress": "current-jobs-reserved",
    "failed": "current-jobs-buried",
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def beanstalkd_binary() -> str | None:
    return shutil.which("beanstalkd")


@contextmanager
def raw_tube(address: tuple[str, int], tube: str) -> Iterator[greenstalk.Client]:
    """A plain greenstalk client that uses and watches ``tube`` (bytes bodies)."""
    client = greenstalk.Client(address, encoding=None, use=tube, watch=tube)
    try:
        yield client
    finally:
        client.close()


def tube_counts(client: greenstalk.Client, tube: str) -> dict[str, int]:
    """ready/delayed/reserved/buried of ``tube`` under the backend's names (0 for an unknown tube)."""
    try:
        raw = client.stats_tube(tube)
    except greenstalk.NotFoundError:
        raw = {}
    return {name: int(raw.get(field, 0)) for name, field in TUBE_COUNTS.items()}


def job_state(client: greenstalk.Client, job_id: int) -> dict[str, Any]:
    """``stats-job`` of a beanstalk job id, or ``{"state": "gone"}`` once it was deleted."""
    try:
        return dict(client.stats_job(job_id))
    except greenstalk.NotFoundError:
        return {"state": "gone"}


def reachable(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


class PrivateBeanstalkd:
    """``beanstalkd -l 127.0.0.1 -p PORT -b DIR``: every job is written to the binlog in DIR.

    The binlog is written with ``write(2)`` on every change, so a ``kill -9`` (the page cache
    survives a process, unlike a host, crash) loses nothing that a client was told was stored;
    a restart with the same ``-b`` replays it.
    """

    def __init__(self, port: int, directory: Path) -> None:
        self.port = port
        self.address = ("127.0.0.1", port)
        self.binlog = directory / "binlog"
        self.binlog.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, timeout: float = 20) -> None:
        assert self.popen is None or self.popen.poll() is not None, "already running"
        binary = beanstalkd_binary()
        assert binary, "beanstalkd is not on PATH"
        self.starts += 1
        log = open(self.directory / f"beanstalkd-{self.starts}.log", "wb")  # noqa: SIM115 (the child keeps it)
        self.popen = subprocess.Popen(
            [binary, "-l", "127.0.0.1", "-p", str(self.port), "-b", str(self.binlog)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

        def answers() -> bool:
            if self.popen is not None and self.popen.poll() is not None:
                raise AssertionError(f"beanstalkd exited ({self.popen.returncode}):\n{self.log()}")
            return reachable(self.port)

        wait_until(answers, timeout, f"the private beanstalkd on port {self.port}")

    def kill9(self) -> int:
        """SIGKILL: no chance to flush or close anything. Returns the exit status."""
        assert self.popen is not None and self.popen.poll() is None, "not running"
        os.kill(self.popen.pid, signal.SIGKILL)
        return self.popen.wait(10)

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.directory.glob("beanstalkd-*.log")))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.popen is not None and self.popen.poll() is None:
            try:
                os.kill(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait(10)
