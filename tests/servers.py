"""Private servers for tests that restart, crash or disconnect a server.

Tests must never restart or kill the shared PostgreSQL / Redis / beanstalkd the rest of the suite
uses: a test that needs to do that starts its own instance on a free loopback port with these
classes (bench/chaos/servers.py, shared with the chaos battery), through the ``private_postgres``
and ``private_redis`` fixtures of tests/conftest.py.

- ``PrivatePostgres``: initdb into a temp dir, ``postgres`` as the ``postgres`` OS user when run
  as root; ``start``/``stop``/``kill`` (a crash)/``restart`` (crash + start, returns (down, up)),
  ``terminate_backends``, ``ready``, ``create_database``, ``connect``, ``host``/``port``/``url``.
- ``PrivateRedis``: redis-server with an AOF; ``restart`` is SIGKILL + a start replaying it.
- ``PrivateBeanstalkd``: beanstalkd with a binlog; ``restart`` likewise.
- ``PrivateSentinelGroup``: a primary, a replica and three sentinels; ``url`` (redis+sentinel://),
  ``failover`` (SENTINEL FAILOVER), ``kill_primary`` (SIGKILL, promotion, restart as a replica).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from bench.chaos.servers import (
    PrivateBeanstalkd,
    PrivatePostgres,
    PrivateRedis,
    PrivateSentinelGroup,
    free_port,
    postgres_bindir,
)
from tests.procs import REPO_ROOT, worker_env

__all__ = [
    "PostgresForTests",
    "PrivateBeanstalkd",
    "PrivatePostgres",
    "PrivateRedis",
    "PrivateSentinelGroup",
    "RedisForTests",
    "free_port",
    "postgres_bindir",
]


def session_test_database() -> str:
    """The test database worker subprocesses use: tests/settings.py's PG_TEST, named per pytest
    session (``JOBS_TEST_PG_TEST_NAME``, which the subprocesses inherit)."""
    from django.conf import settings

    return str(settings.DATABASES["postgres"]["TEST"]["NAME"])


class PostgresForTests:
    """A started PrivatePostgres holding a migrated test database (this session's
    ``test_django_jobs_<pid>``, the name worker subprocesses use).

    ``env(**extra)`` is ``tests.procs.worker_env`` pointed at it (JOBS_TEST_PG_HOST/PORT), for
    ``jobs_work`` and ``manage.py`` subprocesses; ``connect()`` is an autocommit psycopg
    connection to that database. Everything else (``restart``, ``kill``, ``terminate_backends``,
    ``port``, ...) is the server's.
    """

    def __init__(self, server: PrivatePostgres, dbname: str | None = None) -> None:
        self.server = server
        self.dbname = dbname or session_test_database()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)

    def env(self, lease_timeout: float | None = None, **extra: str) -> dict[str, str]:
        return worker_env(
            lease_timeout,
            JOBS_TEST_PG_HOST=self.server.host,
            JOBS_TEST_PG_PORT=str(self.server.port),
            JOBS_TEST_PG_TEST_NAME=self.dbname,
            **extra,
        )

    def connect(self) -> Any:
        return self.server.connect(self.dbname)

    def migrate(self, timeout: float = 180) -> None:
        """``python -m django migrate --database postgres`` in a worker-env subprocess."""
        proc = subprocess.run(
            [sys.executable, "-m", "django", "migrate", "--database", "postgres", "--verbosity", "0"],
            cwd=REPO_ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"migrate on the private PostgreSQL failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


class RedisForTests:
    """A started PrivateRedis; ``env(**extra)`` points worker subprocesses at it."""

    def __init__(self, server: PrivateRedis) -> None:
        self.server = server

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)

    def env(self, lease_timeout: float | None = None, **extra: str) -> dict[str, str]:
        return worker_env(lease_timeout, JOBS_TEST_REDIS_URL=self.server.url, **extra)
