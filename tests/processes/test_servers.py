"""The private servers of tests/servers.py: a test can crash, restart and disconnect them
without touching the shared servers the rest of the suite uses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.procs import REPO_ROOT
from tests.servers import PrivatePostgres

pytestmark = pytest.mark.slow


def test_private_postgres_is_migrated_for_worker_subprocesses(private_postgres):
    assert private_postgres.port != 5432
    with private_postgres.connect() as conn:
        tables = {row[0] for row in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert "django_migrations" in tables
    assert any(t.startswith("django_jobs_") for t in tables), tables
    # A worker-env subprocess sees the same database (settings read JOBS_TEST_PG_HOST/PORT).
    code = (
        "from django.db import connections; c = connections['postgres']; c.ensure_connection(); "
        "print(c.settings_dict['PORT'], c.settings_dict['NAME'])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", f"import django; django.setup(); {code}"],
        cwd=REPO_ROOT,
        env=private_postgres.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(private_postgres.port), private_postgres.dbname]


def test_private_postgres_crash_restart(private_postgres):
    import psycopg

    conn = private_postgres.connect()
    conn.execute("CREATE TABLE IF NOT EXISTS restart_probe (n int)")
    conn.execute("INSERT INTO restart_probe VALUES (1)")
    down, up = private_postgres.restart()
    assert up > down
    with pytest.raises(psycopg.OperationalError):
        conn.execute("SELECT 1")  # the old connection died with the server
    conn.close()
    assert private_postgres.ready()
    with private_postgres.connect() as again:
        # A committed row survives the crash (WAL replay).
        assert again.execute("SELECT count(*) FROM restart_probe").fetchone() == (1,)
        again.execute("DROP TABLE restart_probe")


def test_private_postgres_terminate_backends(private_postgres):
    import psycopg

    victim = private_postgres.connect()
    assert private_postgres.terminate_backends() >= 1
    with pytest.raises(psycopg.OperationalError):
        victim.execute("SELECT 1")
    victim.close()
    assert private_postgres.ready()


def test_private_postgres_kill_start_stop(tmp_path):
    server = PrivatePostgres()
    try:
        server.start()
        assert server.ready()
        server.kill()
        assert not server.ready()
        server.start()  # crash recovery
        server.create_database("again")
        with server.connect("again") as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        server.stop()
        assert not server.ready()
    finally:
        directory = server.directory
        server.cleanup()
    assert not directory.exists()


def test_private_redis_restart(private_redis):
    import redis

    client = redis.Redis.from_url(private_redis.url)
    client.set("probe", "1")
    down, up = private_redis.restart()
    assert up > down
    again = redis.Redis.from_url(private_redis.url)
    assert again.get("probe") == b"1"  # replayed from the AOF
    client.close()
    again.close()
