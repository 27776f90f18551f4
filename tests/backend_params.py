"""The backends the conformance suite runs against, one ``pytest.param`` entry each.

A new backend joins ``tests/integration/test_conformance.py`` (whose ``queue_backend``
fixture is parametrized over this list) by adding one entry to ``BACKEND_PARAMS``:
its ``JOBS["BACKENDS"]`` name (tests/settings.py), the fixtures that bring its service up,
and — where the test harness can do it — two hooks:

- ``expire(backend, lease)`` makes a fetched lease expire *now*, so ``reap_expired`` has
  something to recover without sleeping for a lease timeout;
- ``record(backend, job_id)`` returns the stored ``Job`` row (status, attempts, last_error),
  or ``None`` when the job has no row.

Tests skip on capabilities only — the backend's flags (``persistent``, ``supports_delay``,
``supports_priority``, ``native_lease``, ...) or a missing hook — never on a backend's name.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import connections
from django.test import override_settings
from django.utils import timezone

from django_jobs.backends import get_backend
from django_jobs.backends.base import Lease, QueueBackend
from django_jobs.models import Job
from tests.fake_servicebus import LIVE_ENV, SDK_INSTALLED, expire_lock

# Every conformance test may touch both databases: the PG entry keeps its queue in `postgres`,
# and the worker tests count side effects and look up failed rows in either alias. A test may
# still override this mark with its own (e.g. transaction=True): the decorator's mark wins.
DB = pytest.mark.django_db(databases=["default", "postgres"])


def _pgbouncer_listens() -> bool:
    """Does anything accept connections on the test PgBouncer's port?"""
    try:
        socket.create_connection(("127.0.0.1", int(settings.PGBOUNCER_PORT)), timeout=1).close()
    except OSError:
        return False
    return True


# Tests that carry their own mark (transaction=True) list every database a param may use; the
# MariaDB one only where its driver is installed, the PgBouncer one only where the pooler
# listens (a test in a transaction opens a connection to each; the param skips, or fails under
# CI, otherwise).
ALL_DATABASES = (
    ["default", "postgres"]
    + (["mariadb"] if importlib.util.find_spec("MySQLdb") else [])
    + (["pgbouncer"] if os.environ.get("CI") == "true" or _pgbouncer_listens() else [])
    + ["postgres_pool"]
)


@dataclass(frozen=True)
class BackendCase:
    name: str  # key of JOBS["BACKENDS"] in tests/settings.py
    fixtures: tuple[str, ...] = ()  # service fixtures (skip locally / fail under CI when down)
    expire: Callable[[QueueBackend, Lease], None] | None = None
    record: Callable[[QueueBackend, str], Job | None] | None = None
    # Database alias where scripted jobs of this case record SideEffect rows.
    side_effect_db: str = "default"
    # A JOBS["BACKENDS"] entry to add for this case only (kept out of the shared test settings,
    # so commands that visit every backend do not reach this one's database).
    config: dict[str, Any] | None = None


def _db_expire(backend: Any, lease: Lease) -> None:
    # Same effect as a worker that stopped heartbeating LEASE_TIMEOUT seconds ago.
    past = timezone.now() - timedelta(seconds=5)
    updated = Job.objects.using(backend.alias).filter(pk=lease.token).update(leased_until=past)
    assert updated == 1, f"no row {lease.token} to expire"


def _db_record(backend: Any, job_id: str) -> Job | None:
    return Job.objects.using(backend.alias).filter(pk=job_id).first()


def _redis_expire(backend: Any, lease: Lease) -> None:
    processing = backend.keys(lease.queue)[2]
    past_ms = (timezone.now() - timedelta(seconds=5)).timestamp() * 1000
    assert backend.client.zadd(processing, {lease.token: past_ms}, xx=True, ch=True) == 1


# The servicebus_fake fixture recognises this very object and points the backend at the namespace
# of JOBS_TEST_SERVICEBUS_CONNECTION_STRING instead of the in-memory one (no expire hook there).
SERVICEBUS_LIVE = BackendCase("servicebus", fixtures=("servicebus_fake",))


def _postgres_through(alias: str, case_id: str, fixture: str, databases: list[str]) -> Any:
    """The case of the database backend on the ``postgres`` test database through ``alias``
    (its own connection, not wrapped in the test's transaction: its tests run with
    ``transaction=True``). The backend is named after the alias."""
    return pytest.param(
        BackendCase(
            alias,
            fixtures=(fixture,),
            expire=_db_expire,
            record=_db_record,
            side_effect_db="postgres",
            config={"ENGINE": "database", "OPTIONS": {"DATABASE": alias}},
        ),
        id=case_id,
        marks=[pytest.mark.postgres, pytest.mark.django_db(databases=databases, transaction=True)],
    )


# Through PgBouncer in transaction pooling mode (the ``pgbouncer`` alias), every default on. It
# runs in autocommit as a worker does: claims, batches, prepared statements and asynchronous
# commits take the paths a caller's transaction would turn off.
PG_POOLED = _postgres_through("pgbouncer", "database-pgbouncer", "pgbouncer_up", ALL_DATABASES)

# Through Django's connection pool (the ``postgres_pool`` alias; Django 5.1 and later): each
# thread's connection taken from its process's pool and handed back to it on close.
PG_DJANGO_POOL = _postgres_through("postgres_pool", "database-postgres-django-pool", "postgres_up", ALL_DATABASES)

BACKEND_PARAMS = [
    pytest.param(
        BackendCase("default", expire=_db_expire, record=_db_record),
        id="database-sqlite",
        marks=[DB],
    ),
    pytest.param(
        BackendCase("pg", fixtures=("postgres_up",), expire=_db_expire, record=_db_record, side_effect_db="postgres"),
        id="database-postgres",
        marks=[DB, pytest.mark.postgres],
    ),
    pytest.param(
        BackendCase(
            "maria",
            fixtures=("mariadb_up",),
            expire=_db_expire,
            record=_db_record,
            config={"ENGINE": "database", "OPTIONS": {"DATABASE": "mariadb"}},
        ),
        id="database-mariadb",
        marks=[pytest.mark.django_db(databases=ALL_DATABASES)],
    ),
    PG_POOLED,
    PG_DJANGO_POOL,
    pytest.param(BackendCase("sync"), id="sync", marks=[DB]),
    pytest.param(BackendCase("redis", fixtures=("redis_up",), expire=_redis_expire), id="redis", marks=[DB]),
    pytest.param(
        BackendCase(
            "redis_cluster", fixtures=("redis_cluster_up",), expire=_redis_expire, config=settings.REDIS_CLUSTER
        ),
        id="redis-cluster",
        marks=[DB],
    ),
    # The same backend through the Sentinel group of scripts/services.d/redis-sentinel.sh.
    pytest.param(
        BackendCase(
            "redis_sentinel", fixtures=("sentinel_up",), expire=_redis_expire, config=settings.SENTINEL_BACKEND
        ),
        id="redis-sentinel",
        marks=[DB],
    ),
    pytest.param(BackendCase("beanstalk", fixtures=("beanstalk_up",)), id="beanstalk", marks=[DB]),
    # Azure Service Bus, on the in-memory namespace of tests/fake_servicebus.py (real backend, fake SDK
    # clients); the live case runs the same tests against a real namespace when one is configured.
    pytest.param(
        BackendCase("servicebus", fixtures=("servicebus_fake",), expire=expire_lock),
        id="servicebus",
        marks=[DB, pytest.mark.skipif(not SDK_INSTALLED, reason="azure-servicebus is not installed")],
    ),
    pytest.param(
        SERVICEBUS_LIVE,
        id="servicebus-live",
        marks=[DB, pytest.mark.skipif(not (SDK_INSTALLED and os.environ.get(LIVE_ENV)), reason=f"no {LIVE_ENV}")],
    ),
]


# The database backend on PostgreSQL with server-side binding (``postgres_ssb``): a statement
# takes at most 65,535 parameters.
PG_SERVER_SIDE_BINDING = _postgres_through(
    "postgres_ssb", "database-postgres-server-side-binding", "postgres_up", [*ALL_DATABASES, "postgres_ssb"]
)


def ready_case(request: pytest.FixtureRequest) -> BackendCase:
    """The ``BackendCase`` a parametrized fixture was given, its services' fixtures requested."""
    found: BackendCase = request.param
    for name in found.fixtures:
        request.getfixturevalue(name)
    return found


@contextmanager
def backend_of(case: BackendCase) -> Iterator[QueueBackend]:
    """The backend instance configured as ``case.name`` (with the case's own ``config`` added
    to ``JOBS["BACKENDS"]`` while it is in use)."""
    if case.config is None:
        yield get_backend(case.name)
        return
    backends_config = {**settings.JOBS["BACKENDS"], case.name: case.config}
    with override_settings(JOBS={**settings.JOBS, "BACKENDS": backends_config}):
        yield get_backend(case.name)


def close_pool(alias: str) -> None:
    """Close Django's connection pool of database ``alias``, if it has one: the pool keeps
    threads of its own, which a later test's fork would copy in the middle of their work."""
    if settings.DATABASES[alias].get("OPTIONS", {}).get("pool"):
        connections[alias].close()
        connections[alias].close_pool()


def holds_messages(backend: QueueBackend) -> bool:
    """Whether enqueued messages wait to be fetched. A non-persistent backend (sync) runs
    each job inline at enqueue, so fetch/ack/nack/lease semantics do not apply to it."""
    return backend.persistent


def require_queue(backend: QueueBackend) -> None:
    if not holds_messages(backend):
        pytest.skip("backend runs jobs at enqueue: it has no queue to fetch from")


def require_hook(case: BackendCase, hook: str) -> Callable[..., Any]:
    fn = getattr(case, hook)
    if fn is None:
        pytest.skip(f"the test harness cannot {hook} for this backend")
    return fn
