"""Shared fixtures: real services that skip locally but fail under CI=true.

Fixtures that several test modules share live here, or in the plugin modules of
``pytest_plugins`` below; a test module never imports a fixture.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings as hypothesis_settings

# Support modules whose fixtures every test module can use:
# - tests.api_support: ``backend`` (the database backend on SQLite and PostgreSQL) and
#   ``clean_state`` (caches and recording handlers emptied around a test);
# - tests.fake_servicebus: ``servicebus_fake`` (autouse: the servicebus backend talks to an
#   in-memory namespace, never to the network).
pytest_plugins = ["tests.api_support", "tests.fake_servicebus"]

hypothesis_settings.register_profile("ci", max_examples=200, deadline=None)
hypothesis_settings.register_profile("dev", max_examples=50, deadline=None)
hypothesis_settings.load_profile("ci" if os.environ.get("CI") == "true" else "dev")

IN_CI = os.environ.get("CI") == "true"


def require_service(name: str, reachable: bool, detail: str = "") -> None:
    """Skip when a service is down locally; fail under CI=true (a skip there hides a gap)."""
    if reachable:
        return
    message = f"{name} is not reachable{': ' + detail if detail else ''}"
    if IN_CI:
        pytest.fail(message + " (CI=true: a missing service is a failure)", pytrace=False)
    pytest.skip(message)


def postgres_reachable() -> tuple[bool, str]:
    import psycopg
    from django.conf import settings

    db = settings.DATABASES["postgres"]
    try:
        psycopg.connect(host=db["HOST"], port=db["PORT"], user=db["USER"], dbname="postgres", connect_timeout=3).close()
        return True, ""
    except Exception as exc:  # noqa: BLE001
        return False, str(exc)


@pytest.fixture(scope="session")
def postgres_up() -> None:
    require_service("PostgreSQL", *postgres_reachable())


def _pgbouncer_console(statement: str) -> None:
    """Run one command on the test PgBouncer's admin console (database ``pgbouncer``)."""
    import psycopg
    from django.conf import settings

    db = settings.DATABASES["pgbouncer"]
    with psycopg.connect(
        host=db["HOST"], port=db["PORT"], user=db["USER"], dbname="pgbouncer", autocommit=True, connect_timeout=3
    ) as console:
        psycopg.ClientCursor(console).execute(statement)  # the console speaks the simple protocol only


@pytest.fixture
def pgbouncer_console():
    """``run(statement)``: one command on the test PgBouncer's admin console."""
    return _pgbouncer_console


@pytest.fixture(scope="session")
def pgbouncer_up() -> None:
    """PgBouncer (transaction pooling, scripts/services starts it) is up in front of the test
    PostgreSQL."""
    try:
        _pgbouncer_console("SHOW VERSION")
        reachable, detail = True, ""
    except Exception as exc:  # noqa: BLE001
        reachable, detail = False, f"{exc} (scripts/services starts it)"
    require_service("PgBouncer", reachable, detail)


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None) -> Iterator[None]:
    """pytest-django's, and at the end of the session, before the test databases are dropped,
    PgBouncer's connections to the PostgreSQL one dropped (``KILL``, then ``RESUME``):
    PostgreSQL refuses to drop a database that a pooler still holds server connections to. Any
    test may have used the ``pgbouncer`` alias (a test in a transaction opens it). (Django's pool
    of ``postgres_pool`` is closed after each test: ``_pool_threads_closed``.)"""
    from django.conf import settings
    from django.db import connections

    yield
    connections["pgbouncer"].close()
    name = settings.DATABASES["postgres"]["NAME"]
    with contextlib.suppress(Exception):  # no PgBouncer: nothing holds the database
        _pgbouncer_console(f'KILL "{name}"')
        _pgbouncer_console(f'RESUME "{name}"')


def mariadb_reachable() -> tuple[bool, str]:
    from django.conf import settings

    db = settings.DATABASES["mariadb"]
    try:
        import MySQLdb
    except ImportError:
        return False, "mysqlclient is not installed (scripts/bootstrap installs it with libmariadb-dev)"
    try:
        MySQLdb.connect(
            host=db["HOST"], port=int(db["PORT"]), user=db["USER"], passwd=db["PASSWORD"], connect_timeout=3
        ).close()
        return True, ""
    except Exception as exc:  # noqa: BLE001
        return False, str(exc)


@pytest.fixture(scope="session")
def mariadb_up() -> None:
    require_service("MariaDB", *mariadb_reachable())


def redis_reachable() -> tuple[bool, str]:
    import redis
    from django.conf import settings

    try:
        redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=3).ping()
        return True, ""
    except Exception as exc:  # noqa: BLE001
        return False, str(exc)


@pytest.fixture
def redis_up():
    """Redis is reachable, and this session's keys are gone before the test starts."""
    import redis
    from django.conf import settings

    require_service("Redis", *redis_reachable())
    client = redis.Redis.from_url(settings.REDIS_URL)
    _delete_prefixed(client, settings.REDIS_PREFIX)
    yield client
    client.close()


def _delete_prefixed(client: Any, prefix: str) -> None:
    stale = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if stale:
        client.delete(*stale)


def redis_cluster_reachable() -> tuple[bool, str]:
    import redis
    from django.conf import settings

    try:
        client = redis.RedisCluster.from_url(settings.REDIS_CLUSTER_URL, socket_connect_timeout=3)
    except Exception as exc:  # noqa: BLE001
        return False, f"{settings.REDIS_CLUSTER_URL}: {exc}"
    client.close()
    return True, ""


@pytest.fixture
def redis_cluster_up():
    """The Redis Cluster is reachable (every slot served), and this session's keys are gone
    from every primary before the test starts."""
    import redis
    from django.conf import settings

    require_service("Redis Cluster", *redis_cluster_reachable())
    client = redis.RedisCluster.from_url(settings.REDIS_CLUSTER_URL)
    _delete_prefixed(client, settings.REDIS_PREFIX)
    yield client
    client.close()


@pytest.fixture
def redis_backend(redis_up):
    """The configured ``redis`` backend; this session's keys are deleted after the test."""
    from django_jobs.backends import get_backend
    from django_jobs.backends.redis import RedisBackend

    instance = get_backend("redis")
    assert isinstance(instance, RedisBackend)
    yield instance
    _delete_prefixed(redis_up, instance.prefix)


@pytest.fixture
def redis_cluster_in_settings(redis_cluster_up, monkeypatch):
    """The backend ``redis_cluster`` in ``JOBS["BACKENDS"]``, here and in worker subprocesses
    (tests/settings.py adds it when ``JOBS_TEST_REDIS_CLUSTER`` is set)."""
    from django.conf import settings

    with _backend_in_settings(monkeypatch, "JOBS_TEST_REDIS_CLUSTER", "redis_cluster", settings.REDIS_CLUSTER):
        yield redis_cluster_up


@contextlib.contextmanager
def _backend_in_settings(monkeypatch: Any, variable: str, name: str, config: dict[str, Any]) -> Iterator[None]:
    """Backend ``name`` in ``JOBS["BACKENDS"]``, here and in the worker subprocesses the test
    starts (tests/settings.py adds it when ``variable`` is set in the environment they copy)."""
    from django.conf import settings
    from django.test import override_settings

    monkeypatch.setenv(variable, "1")
    backends = {**settings.JOBS["BACKENDS"], name: config}
    with override_settings(JOBS={**settings.JOBS, "BACKENDS": backends}):
        yield


@pytest.fixture(params=[pytest.param(False, id="single"), pytest.param(True, id="cluster")])
def redis_topology_backend(request):
    """The backend named ``redis`` on the single Redis (``redis_backend``), then, under the same
    name, on the Redis Cluster: tests written for one server run unchanged on both."""
    from django.conf import settings
    from django.test import override_settings

    from django_jobs.backends import get_backend

    if not request.param:
        yield request.getfixturevalue("redis_backend")
        return
    client = request.getfixturevalue("redis_cluster_up")
    backends = {**settings.JOBS["BACKENDS"], "redis": settings.REDIS_CLUSTER}
    with override_settings(JOBS={**settings.JOBS, "BACKENDS": backends}):
        instance = get_backend("redis")
        yield instance
        instance.close()
    _delete_prefixed(client, settings.REDIS_PREFIX)


def _sentinel_client() -> Any:
    from django.conf import settings

    from django_jobs.backends import redis_connection

    return redis_connection.connect("sentinel", settings.SENTINEL_BACKEND["OPTIONS"], probe=True)


@pytest.fixture
def sentinel_up():
    """The Sentinel group of scripts/services.d/redis-sentinel.sh names a primary that answers;
    this session's keys on it are gone before and after the test. Its client."""
    from django.conf import settings

    client = _sentinel_client()
    try:
        client.ping()
    except Exception as exc:  # noqa: BLE001
        client.close()
        require_service("Redis Sentinel", False, f"{settings.SENTINEL_URL}: {exc}")
    _delete_prefixed(client, settings.REDIS_PREFIX)
    yield client
    _delete_prefixed(client, settings.REDIS_PREFIX)
    client.close()


@pytest.fixture
def sentinel_backend(sentinel_up, monkeypatch):
    """The ``redis_sentinel`` backend in JOBS["BACKENDS"], here and in the worker subprocesses
    the test starts (``JOBS_TEST_SENTINEL=1`` in the environment they copy)."""
    from django.conf import settings

    with _backend_in_settings(monkeypatch, "JOBS_TEST_SENTINEL", "redis_sentinel", settings.SENTINEL_BACKEND):
        yield


@pytest.fixture
def pgbouncer_backend(pgbouncer_up, monkeypatch):
    """The ``pgbouncer`` backend (the database backend through PgBouncer) in JOBS["BACKENDS"],
    here and in the worker subprocesses the test starts (``JOBS_TEST_PGBOUNCER=1``)."""
    from django.conf import settings

    with _backend_in_settings(monkeypatch, "JOBS_TEST_PGBOUNCER", "pgbouncer", settings.PGBOUNCER_BACKEND):
        yield


@pytest.fixture(autouse=True)
def _pool_threads_closed() -> Iterator[None]:
    """Django's pool of the ``postgres_pool`` alias, which any test that reaches that alias opens
    (the system checks' database checks too), keeps threads of its own: closed after each test,
    so that a later test's fork never copies them."""
    yield
    from tests.backend_params import close_pool

    close_pool("postgres_pool")


@pytest.fixture
def pg_pool_backend(postgres_up, monkeypatch):
    """The ``pg_pool`` backend (the database backend through Django's connection pool) in
    JOBS["BACKENDS"], here and in the worker subprocesses the test starts (``JOBS_TEST_PG_POOL=1``)."""
    from django.conf import settings

    with _backend_in_settings(monkeypatch, "JOBS_TEST_PG_POOL", "pg_pool", settings.PG_POOL_BACKEND):
        yield


def _beanstalk_reachable(host: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def beanstalkd_server():
    """The test beanstalkd: the one scripts/services started, or one started here if none runs."""
    import shutil
    import subprocess
    import tempfile
    import time

    from django.conf import settings

    host, port = settings.BEANSTALK_HOST, int(settings.BEANSTALK_PORT)
    started = None
    if not _beanstalk_reachable(host, port) and shutil.which("beanstalkd"):
        binlog = tempfile.mkdtemp(prefix="beanstalkd-")
        started = subprocess.Popen(["beanstalkd", "-l", host, "-p", str(port), "-b", binlog])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not _beanstalk_reachable(host, port):
            time.sleep(0.05)
    require_service("beanstalkd", _beanstalk_reachable(host, port), f"{host}:{port} (apt-get install beanstalkd)")
    yield host, port
    if started is not None:
        started.terminate()
        started.wait(10)


@pytest.fixture
def beanstalk_up(beanstalkd_server):
    """beanstalkd is up, and this session's tubes are empty before the test starts."""
    import gc

    import greenstalk
    from django.conf import settings

    from django_jobs import backends
    from tests.beanstalk_support import raw_tube

    # Close the previous test's connections: beanstalkd releases the jobs they still reserve.
    # Instances dropped by an override_settings(JOBS=...) close theirs when collected.
    gc.collect()
    backends.get_backend("beanstalk").close()
    backends.reset(close=False)
    for queue in settings.JOBS["QUEUES"]:
        tube = f"{settings.BEANSTALK_PREFIX}.{queue}"
        with raw_tube(beanstalkd_server, tube) as client:
            for peek in (client.peek_ready, client.peek_delayed, client.peek_buried):
                while True:
                    try:
                        client.delete(peek())
                    except greenstalk.NotFoundError:
                        break
    yield beanstalkd_server


@pytest.fixture(autouse=True)
def _fresh_metrics():
    from django_jobs.metrics import get_collector

    collector = get_collector()
    if hasattr(collector, "reset"):
        collector.reset()
    yield collector


# -- Private servers (tests that restart, crash or disconnect a server) ----------------------------


@pytest.fixture(scope="module")
def private_postgres(tmp_path_factory):
    """A PostgreSQL server of this module's own (initdb on a free loopback port, see
    tests/servers.py) with this session's test database (``.dbname``, the name worker
    subprocesses use) created and migrated. Restart,
    kill or disconnect it freely: the shared server is never touched. ``.env(**extra)`` points
    worker subprocesses at it; ``.connect()`` opens an autocommit connection to its database."""
    from tests.servers import PostgresForTests, PrivatePostgres, postgres_bindir

    bindir = postgres_bindir()
    require_service("PostgreSQL binaries (initdb)", bindir is not None, "set PG_BINDIR or install postgresql")
    server = PrivatePostgres()
    try:
        server.start()
        wrapped = PostgresForTests(server)
        server.create_database(wrapped.dbname)
        wrapped.migrate()
        yield wrapped
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def private_redis():
    """A redis-server of this module's own (AOF on, free loopback port, see tests/servers.py).
    ``.url`` is its URL; ``.restart()`` is a crash and a start that replays the AOF."""
    import shutil

    from tests.servers import PrivateRedis, RedisForTests

    require_service("redis-server", shutil.which("redis-server") is not None, "redis-server is not on PATH")
    server = PrivateRedis()
    try:
        server.start()
        yield RedisForTests(server)
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def private_sentinel():
    """A Sentinel group of this module's own (see tests/servers.py), started: tests that fail
    its primary over never touch the shared group of scripts/services.d/redis-sentinel.sh."""
    import shutil

    from tests.servers import PrivateSentinelGroup

    require_service("redis-server", shutil.which("redis-server") is not None, "redis-server is not on PATH")
    group = PrivateSentinelGroup()
    try:
        group.start()
        yield group
    finally:
        group.cleanup()


@pytest.fixture
def private_beanstalkd(tmp_path):
    """A beanstalkd of this test's own (binlog in its tmp folder, free loopback port, see
    tests/servers.py), started. ``.address`` is its (host, port); ``.kill()`` is a ``kill -9``
    and ``.start()`` a start that replays the binlog. One per test: a test that kills it leaves
    nothing behind for the next one."""
    import shutil

    from tests.servers import PrivateBeanstalkd

    require_service("beanstalkd binary", shutil.which("beanstalkd") is not None, "beanstalkd is not on PATH")
    server = PrivateBeanstalkd(tmp_path)
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


# -- Admin tests -----------------------------------------------------------------------------------


@pytest.fixture
def failed_job():
    """Makes a job that failed for good: ``failed_job(runs=3)`` dispatches ``scripted`` with
    action=raise and ``runs - 1`` retries, runs it through the worker ``runs`` times (each retry
    made due at once) and returns its id. Its attempt history holds ``runs`` rows."""
    from django.utils import timezone

    from django_jobs.models import Job
    from django_jobs.worker import QueueWorker
    from tests.testapp.jobs import scripted

    def make(runs: int = 3) -> str:
        job_id = scripted.using(max_retries=runs - 1).dispatch(action="raise")
        worker = QueueWorker("default")
        for _ in range(runs):
            Job.objects.filter(pk=job_id).update(available_at=timezone.now())
            assert worker.process_once().job_id == job_id
        assert Job.objects.get(pk=job_id).status == "failed"
        return job_id

    return make


@pytest.fixture
def staff_client(client, django_user_model):
    """Logs a staff user in with the given ``django_jobs`` permissions and returns the test
    client: ``staff_client("view_job")``; ``is_staff=False`` makes a user who may not enter the
    admin at all."""
    from django.contrib.auth.models import Permission

    def login(*codenames: str, is_staff: bool = True):
        user = django_user_model.objects.create_user(
            "staff", "staff@example.com", "pw-for-tests-only", is_staff=is_staff
        )
        user.user_permissions.set(
            Permission.objects.filter(content_type__app_label="django_jobs", codename__in=codenames)
        )
        assert client.login(username="staff", password="pw-for-tests-only")
        return client

    return login
