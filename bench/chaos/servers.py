"""The servers the chaos battery uses: its own PostgreSQL database, and PRIVATE redis-server /
beanstalkd processes on free loopback ports with their data in a temp dir.

Private servers are started in their own session and killed by pid (only what this process
started). The shared PostgreSQL server is restarted only by ``restart_postgres`` (the postgres
crash scenario, never in ``--short``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


# -- PostgreSQL ---------------------------------------------------------------------------------


class Postgres:
    """The dedicated database on the (shared) server: created fresh, dropped at the end."""

    def __init__(self, name: str, host: str, port: str, user: str, password: str = "") -> None:
        self.name, self.host, self.port, self.user, self.password = name, host, port, user, password

    def _admin(self) -> Any:
        import psycopg

        return psycopg.connect(
            host=self.host,
            port=self.port,
            user=self.user,
            password=self.password or None,
            dbname="postgres",
            autocommit=True,
            connect_timeout=5,
        )

    def create(self) -> None:
        with self._admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{self.name}"')

    def drop(self) -> None:
        with self._admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')

    def ready(self) -> bool:
        return subprocess.run(["pg_isready", "-q", "-h", self.host, "-p", str(self.port)], check=False).returncode == 0

    def restart(self) -> tuple[float, float]:
        """``pg_ctlcluster ... restart -m immediate`` of the SHARED server (a crash and recovery),
        then wait for pg_isready. Returns (down, up) as time.time() values."""
        versions = sorted(os.listdir("/etc/postgresql"))
        down = time.time()
        subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main", "restart", "-m", "immediate"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        wait_for(self.ready, 120, "pg_isready after the restart", interval=0.1)
        return down, time.time()


# -- Redis --------------------------------------------------------------------------------------


class PrivateRedis:
    """redis-server with an AOF fsynced every second (``--appendonly yes --appendfsync everysec``)
    and no RDB snapshots, in ``directory``. ``restart`` is a crash: SIGKILL, then a start that
    replays the AOF (the kernel keeps what Redis wrote, so only a host crash could lose the
    last second)."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.directory = directory
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if not binary:
            raise RuntimeError("redis-server is not on PATH")
        self.starts += 1
        log = open(self.directory / f"redis-{self.starts}.log", "wb")  # noqa: SIM115 (the child keeps it)
        self.popen = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--dir",
                str(self.directory),
                "--daemonize",
                "no",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        wait_for(self._serving, 60, f"the private redis-server on port {self.port}")

    def _serving(self) -> bool:
        import redis

        if self.popen is not None and self.popen.poll() is not None:
            raise RuntimeError(f"redis-server exited ({self.popen.returncode}): see {self.directory}")
        try:
            with redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=1) as client:
                return bool(client.ping()) and client.info("persistence").get("loading") == 0
        except redis.exceptions.RedisError:
            return False

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def restart(self) -> tuple[float, float]:
        down = time.time()
        self.kill()
        time.sleep(1.0)  # an outage, not just a reconnect
        self.start()
        return down, time.time()


# -- beanstalkd ---------------------------------------------------------------------------------


class PrivateBeanstalkd:
    """beanstalkd with its binlog in ``directory`` (``-b``). ``restart`` is SIGKILL + a start
    that replays the binlog."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.address = ("127.0.0.1", self.port)
        self.directory = directory
        self.binlog = directory / "binlog"
        self.binlog.mkdir(parents=True, exist_ok=True)
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        binary = shutil.which("beanstalkd")
        if not binary:
            raise RuntimeError("beanstalkd is not on PATH")
        self.starts += 1
        log = open(self.directory / f"beanstalkd-{self.starts}.log", "wb")  # noqa: SIM115
        self.popen = subprocess.Popen(
            [binary, "-l", "127.0.0.1", "-p", str(self.port), "-b", str(self.binlog)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        wait_for(self._serving, 60, f"the private beanstalkd on port {self.port}")

    def _serving(self) -> bool:
        if self.popen is not None and self.popen.poll() is not None:
            raise RuntimeError(f"beanstalkd exited ({self.popen.returncode}): see {self.directory}")
        try:
            socket.create_connection(self.address, timeout=1).close()
            return True
        except OSError:
            return False

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def restart(self) -> tuple[float, float]:
        down = time.time()
        self.kill()
        time.sleep(1.0)
        self.start()
        return down, time.time()
