"""The database backend through PgBouncer in transaction pooling mode (scripts/services starts
it; the ``pgbouncer`` alias is the ``postgres`` test database through it): what a pooler that
keeps no session state between transactions changes, and what it must not.

The conformance suite runs through the pooler as well (tests/backend_params.py PG_POOLED).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from io import StringIO

import psycopg
import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connections, transaction
from django.test import override_settings

from django_jobs.backends import db_listen, get_backend
from django_jobs.backends.database import DatabaseBackend
from django_jobs.models import Job
from django_jobs.scheduler import Scheduler
from django_jobs.schedules import parse_entry
from tests.backend_params import ALL_DATABASES
from tests.testapp.jobs import scripted

POOLED = "pgbouncer"
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(databases=ALL_DATABASES, transaction=True),
    pytest.mark.usefixtures("pgbouncer_up"),
]


def backends(**pooled_options: str) -> override_settings:
    """JOBS with the backend ``pooled`` through the pooler (with these options)."""
    config = {"ENGINE": "database", "OPTIONS": {"DATABASE": POOLED, **pooled_options}}
    return override_settings(JOBS={**settings.JOBS, "BACKENDS": {**settings.JOBS["BACKENDS"], "pooled": config}})


@pytest.fixture
def pooled() -> Iterator[DatabaseBackend]:
    with backends():
        backend = get_backend("pooled")
        assert isinstance(backend, DatabaseBackend)
        yield backend
        backend.close()


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    """Each test finds out anew whether a LISTEN is held (a process remembers it)."""
    db_listen._HELD.clear()
    yield
    db_listen._HELD.clear()


def dispatch(count: int, backend: str = "pooled") -> list[str]:
    return [scripted.using(backend=backend).dispatch(action="ok") for _ in range(count)]


def work(*argv: str) -> str:
    out = StringIO()
    call_command("jobs_work", "--backend", "pooled", *argv, stdout=out)
    return out.getvalue()


def test_a_bounded_run_after_another_in_the_same_process_runs_its_jobs(pooled):
    # The ack-and-claim statement is prepared on the first run's connection. The second run's
    # connection is new, and the pooler hands it the server session that has it already (it
    # reuses the one used last): its PREPARE finds the statement there.
    dispatch(6)
    work("--once")
    connections[POOLED].close()
    # --max-time: a run that cannot reach the database would go on retrying; this one returns.
    work("--max", "5", "--max-time", "20")

    assert Job.objects.using(POOLED).filter(status="completed").count() == 6


def test_an_execute_that_reaches_another_server_session_runs_the_plain_statement(pooled, caplog, pgbouncer_console):
    # The pool's server sessions that earlier tests prepared the statement on are closed first:
    # any session the next EXECUTE may reach has never seen its PREPARE, but the one it is made on.
    pgbouncer_console(f'RECONNECT "{connections[POOLED].settings_dict["NAME"]}"')
    dispatch(3)
    following = pooled.ack_and_fetch(pooled.fetch("default"), "default")  # prepared on the session it got
    assert following is not None and pooled.prepare
    db = connections[POOLED].settings_dict
    # Another client holds that session in a transaction (the pooler hands out the one used
    # last): the next EXECUTE reaches a session that never saw the PREPARE.
    with psycopg.connect(host=db["HOST"], port=db["PORT"], user=db["USER"], dbname=db["NAME"]) as other:
        other.execute("SELECT 1")
        last = pooled.ack_and_fetch(following, "default")
        assert last is not None
        pooled.ack(last)

    assert not pooled.prepare and "no longer preparing" in caplog.text
    assert Job.objects.using(POOLED).filter(status="completed").count() == 3


def test_asynchronous_commit_stays_in_the_statements_own_transaction(pooled):
    dispatch(3)
    work("--max", "3", "--max-time", "30")
    # Server sessions are shared: a SET (not SET LOCAL) would leak into whoever comes next.
    with connections[POOLED].cursor() as cursor:
        for _ in range(5):
            cursor.execute("SHOW synchronous_commit")
            assert cursor.fetchone()[0] == "on"


def test_a_dispatch_in_the_callers_transaction_commits_or_rolls_back_with_it(pooled):
    jobs = Job.objects.using(POOLED)
    with pytest.raises(RuntimeError), transaction.atomic(using=POOLED):
        [gone] = dispatch(1)
        assert jobs.filter(pk=gone).exists()  # inside it, the caller sees its own row
        raise RuntimeError("roll back")
    with transaction.atomic(using=POOLED):
        [kept] = dispatch(1)

    assert not jobs.filter(pk=gone).exists()
    assert jobs.get(pk=kept).status == "pending"


def test_a_listen_through_the_pooler_is_found_not_held_and_idle_workers_poll(pooled, fresh_probe, caplog):
    caplog.set_level(logging.INFO, logger="django_jobs.backends.database")

    assert pooled.wait_for_work(["default"], 5) is False  # at once: the worker sleeps its poll instead
    assert pooled.listener.connection is None
    assert "is not held" in caplog.text and "LISTEN_DATABASE" in caplog.text
    caplog.clear()
    assert pooled.wait_for_work(["default"], 5) is False
    assert caplog.text == ""  # found out once


def test_jobs_work_says_at_its_start_that_idle_workers_will_poll(pooled, fresh_probe, caplog):
    dispatch(1)
    work("--once")  # it runs the job at once: it never waits for work

    assert "is not held" in caplog.text


def test_listen_database_wakes_idle_workers_through_a_direct_connection(fresh_probe, caplog):
    caplog.set_level(logging.INFO, logger="django_jobs.backends.database")
    with backends(LISTEN_DATABASE="postgres"):
        backend = get_backend("pooled")
        assert isinstance(backend, DatabaseBackend)
        try:
            assert backend.wait_for_work(["default"], 0) is True  # listening from now on
            assert "wake on NOTIFY, listening on database 'postgres'" in caplog.text
            threading.Timer(0.3, dispatch, [1]).start()  # dispatched through the pooler
            start = time.monotonic()
            assert backend.wait_for_work(["default"], 30) is True
            assert time.monotonic() - start < 25  # woken by the dispatch, not by the timeout
        finally:
            backend.close()


@pytest.mark.parametrize("alias", ["nope", "default"])
def test_listen_database_must_be_a_postgresql_alias(alias):
    with backends(LISTEN_DATABASE=alias), pytest.raises(ImproperlyConfigured, match="LISTEN_DATABASE"):
        get_backend("pooled")


def test_schedulers_through_the_pooler_dispatch_each_tick_once(pooled, settings):
    settings.DATABASE_ROUTERS = ["tests.routers.SchedulesThroughPgBouncer"]
    start = datetime(2030, 1, 1, 3, 10, tzinfo=UTC)
    now = [start]
    entry = parse_entry("pooled-tick", {"job": "tests.testapp.jobs.noop", "every": 1, "backend": "pooled"})
    # Each claims a tick with an INSERT in the transaction that dispatches its job.
    schedulers = [Scheduler({entry.name: entry}, clock=lambda: now[0]) for _ in range(2)]
    for scheduler in schedulers:
        scheduler.sync(start)
    for _ in range(10):
        now[0] += timedelta(seconds=0.5)
        for scheduler in schedulers:
            scheduler.run_pass()

    keys = Counter(
        Job.objects.using(POOLED)
        .filter(idempotency_key__startswith="schedule:pooled-tick:")
        .values_list("idempotency_key", flat=True)
    )
    assert len(keys) == 5 and set(keys.values()) == {1}, keys  # one job a second, each once
    assert sum(scheduler.dispatched for scheduler in schedulers) == 5
