"""A backend that cannot be reached: the worker says so in one line per try, naming the backend
and its address; a bounded run that never reached it exits ``EXIT_UNREACHABLE`` (69); a dispatch
raises ``BackendUnavailable``, whatever the backend. The addresses are closed loopback ports."""

from __future__ import annotations

from unittest import mock

import pytest
from django.conf import settings
from django.db import connections
from django.test import override_settings

from django_jobs import Jobs
from django_jobs.exceptions import BackendUnavailable
from django_jobs.worker import EXIT_UNREACHABLE
from tests.procs import processes, worker_env

CLOSED = "127.0.0.1:1"  # nothing listens on port 1
UNREACHABLE = {
    "redis": {"ENGINE": "redis", "OPTIONS": {"URL": f"redis://{CLOSED}/0"}},
    "beanstalk": {"ENGINE": "beanstalk", "OPTIONS": {"HOST": "127.0.0.1", "PORT": 1}},
}


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("options", "tries"),
    [(("--max-time", "3"), (2, 4)), (("--once",), (1, 1)), (("--max-time", "3", "--concurrency", "2"), (4, 8))],
    ids=["max-time", "once", "pool"],
)
def test_a_bounded_run_that_never_reaches_redis_says_so_briefly_and_exits_69(options, tries):
    env = worker_env(JOBS_TEST_REDIS_URL=f"redis://{CLOSED}/0")
    with processes() as procs:
        code, worker = procs.run("jobs_work", "--backend", "redis", *options, env=env, timeout=30)

    assert code == EXIT_UNREACHABLE, worker.output()
    assert not any("Traceback" in line for line in worker.err), worker.output()
    failed = [line for line in worker.err if line.startswith("worker: backend 'redis'")]
    assert tries[0] <= len(failed) <= tries[1], worker.output()
    assert all(f"(redis at {CLOSED}) failed: ConnectionError" in line for line in failed), failed
    assert worker.err[-1].startswith("CommandError: never reached backend 'redis' (redis at 127.0.0.1:1)")
    assert len(worker.err) <= 2 * tries[1] + 1, "one line per try (and per reaping pass), not a traceback"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_verbosity_2_adds_each_tries_traceback():
    env = worker_env(JOBS_TEST_REDIS_URL=f"redis://{CLOSED}/0")
    with processes() as procs:
        code, worker = procs.run("jobs_work", "--backend", "redis", "--once", "-v", "2", env=env, timeout=30)

    assert code == EXIT_UNREACHABLE, worker.output()
    assert any("Traceback" in line for line in worker.err), worker.output()


@pytest.mark.parametrize("name", ["redis", "beanstalk"])
def test_a_dispatch_to_an_unreachable_broker_raises_backend_unavailable(name):
    jobs = {**settings.JOBS, "BACKENDS": {**settings.JOBS["BACKENDS"], name: UNREACHABLE[name]}}
    with override_settings(JOBS=jobs), pytest.raises(BackendUnavailable) as raised:
        Jobs.define("command", "check").dispatch(backend=name)
    assert_unavailable(raised.value, name)


@pytest.mark.postgres
@pytest.mark.django_db(databases=["default", "postgres"])
def test_a_dispatch_to_an_unreachable_database_raises_backend_unavailable(postgres_up):
    connection = connections["postgres"]
    connection.close()
    with mock.patch.dict(connection.settings_dict, {"PORT": "1"}), pytest.raises(BackendUnavailable) as raised:
        Jobs.define("command", "check").dispatch(backend="pg")
    connection.close()
    assert_unavailable(raised.value, "pg")


def assert_unavailable(error: BackendUnavailable, name: str) -> None:
    assert isinstance(error, ConnectionError)  # code that catches the builtin still does
    assert error.__cause__ is not None, "the client's own error is chained"
    assert str(error).startswith(f"backend {name!r} (") and "is unreachable: " in str(error), str(error)
