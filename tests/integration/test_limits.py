"""Rate and concurrency limits, enforced by the backend at the start of each run: the protocol
(``acquire``, ``release_limits``, ``limit_usage``) driven by hand, then through the worker.

Parametrized over the backends that enforce limits. The database backend keeps the leases'
times in its own clock, so a test that moves the limits' clock (``clock``) never makes a job due
earlier or later: it only changes what the limits see."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from django_jobs import Jobs, limits
from django_jobs.backends import base
from django_jobs.backends.base import Hold, Lease, QueueBackend
from django_jobs.backends.redis import RedisBackend
from django_jobs.checks import check_settings
from django_jobs.exceptions import LimitsNotSupported
from django_jobs.metrics import InMemoryMetricsCollector
from django_jobs.models import Job, JobAttempt
from django_jobs.pipeline import JobContext
from django_jobs.worker import QueueWorker, WorkerResult
from tests.api_support import jobs_settings, runs
from tests.backend_params import ALL_DATABASES, _db_expire, _redis_expire
from tests.testapp.jobs import scripted

pytestmark = [pytest.mark.django_db(databases=["default", "postgres"]), pytest.mark.usefixtures("clean_state")]

QUEUE_KEY = "queue:emails"
HANDLER = "tests.testapp.jobs.scripted"
HANDLER_KEY = f"handler:{HANDLER}"
LEASE_TIMEOUT = 60
# How each backend's lease is made to expire now (as a crashed worker's would).
EXPIRE = {"default": _db_expire, "pg": _db_expire, "pgbouncer": _db_expire, "redis": _redis_expire}


@pytest.fixture(
    params=[
        "default",
        "pg",
        # Through PgBouncer in transaction mode, in autocommit as a worker runs (its own
        # transactions take the limits' row locks, each on whatever server session it gets).
        pytest.param("pgbouncer", marks=pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)),
        "redis",
    ]
)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, settings: Any) -> str:
    """The database backend on SQLite, on PostgreSQL direct and through PgBouncer, and Redis."""
    if request.param == "pg":
        request.getfixturevalue("postgres_up")
    if request.param == "pgbouncer":
        request.getfixturevalue("pgbouncer_up")
        settings.JOBS = {
            **settings.JOBS,
            "BACKENDS": {**settings.JOBS["BACKENDS"], "pgbouncer": settings.PGBOUNCER_BACKEND},
        }
    if request.param == "redis":
        request.getfixturevalue("redis_up")
        # Pushed at once: the test's own transaction never commits to run on_commit callbacks.
        monkeypatch.setattr(base, "atomic_alias", lambda: None)
    return str(request.param)


class Clock:
    """The limits' clock, moved by hand."""

    def __init__(self, start: float) -> None:
        self.time = start

    def __call__(self) -> float:
        return self.time

    def advance(self, seconds: float) -> None:
        self.time += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fixed = Clock(limits.now())
    monkeypatch.setattr(limits, "now", fixed)
    return fixed


@pytest.fixture
def limit(settings: Any) -> Callable[[dict[str, Any]], None]:
    """Call it with the ``JOBS["LIMITS"]`` to use (and a known lease timeout)."""

    def apply(table: dict[str, Any]) -> None:
        settings.JOBS = {**settings.JOBS, "LIMITS": table, "LEASE_TIMEOUT": LEASE_TIMEOUT}

    return apply


def queue_of(backend: str) -> QueueBackend:
    return Jobs.backend(backend)


def dispatch(backend: str, count: int = 1, queue: str = "emails", **options: Any) -> list[str]:
    return [
        scripted.using(backend=backend, queue=queue, **options).dispatch(action="ok", key=None) for _ in range(count)
    ]


def take(backend: str, queue: str = "emails") -> Lease:
    lease = queue_of(backend).fetch(queue)
    assert lease is not None, f"nothing ready on {queue}"
    return lease


def acquire(backend: str, lease: Lease) -> Hold | None:
    assert lease.envelope is not None
    return queue_of(backend).acquire(lease, limits.limits_for(lease.envelope.handler, lease.queue))


def defer(backend: str, lease: Lease, hold: Hold) -> None:
    """What the worker does with a hold: requeue without a run, then (parked) look for room."""
    queue_of(backend).nack(lease, hold.delay, count_run=False)
    if hold.parked:
        queue_of(backend).release_limits(lease)


def finish(backend: str, lease: Lease) -> None:
    queue_of(backend).ack(lease)
    queue_of(backend).release_limits(lease)


def usage(backend: str, key: str = QUEUE_KEY) -> Any:
    limit = limits.configured()[key]
    return queue_of(backend).limit_usage(limit)


def db(backend: str) -> str:
    """Where the backend's ``Job`` rows are: its own (database) or the router's (Redis: failed
    jobs only, and the attempt history)."""
    return getattr(queue_of(backend), "alias", "default")


def record(backend: str, job_id: str) -> tuple[str, int, str]:
    """(status, attempts, last error) of a job: its row, or (Redis) the live message."""
    queue = queue_of(backend)
    if isinstance(queue, RedisBackend):
        live = queue.peek(job_id)
        if live is not None:
            error = queue.client.hget(queue.keys(live.envelope.queue).errors, job_id) or b""
            return live.state, live.envelope.attempts, error.decode()
    found = Job.objects.using(db(backend)).get(pk=job_id)
    return found.status, found.attempts, found.last_error


def due_at(backend: str, job_id: str, queue: str = "emails") -> float:
    """When a waiting job is due (epoch seconds)."""
    found = queue_of(backend)
    if isinstance(found, RedisBackend):
        return float(found.client.zscore(found.keys(queue).delayed, job_id)) / 1000
    return Job.objects.using(db(backend)).get(pk=job_id).available_at.timestamp()


def ready_ids(backend: str, queue: str = "emails") -> set[str]:
    """The ids of the jobs ready now on ``queue`` (each is leased by looking)."""
    found = set()
    while (lease := queue_of(backend).fetch(queue)) is not None:
        found.add(lease.token)
    return found


# -- concurrency ---------------------------------------------------------------------------------


def test_concurrency_grants_up_to_the_limit_then_parks_the_next(backend, limit):
    limit({QUEUE_KEY: {"concurrency": 2}})
    dispatch(backend, 3)
    first, second, third = take(backend), take(backend), take(backend)

    assert acquire(backend, first) is None
    assert acquire(backend, second) is None
    assert acquire(backend, third) == Hold(LEASE_TIMEOUT, QUEUE_KEY, parked=True)
    assert usage(backend)[:1] == (2,) and usage(backend).parked == 1


def test_a_release_wakes_the_oldest_parked_job_only(backend, limit):
    limit({QUEUE_KEY: {"concurrency": 1}})
    _, parked, later = dispatch(backend, 3)
    lease = take(backend)
    assert acquire(backend, lease) is None
    for waiting in (take(backend), take(backend)):
        hold = acquire(backend, waiting)
        assert hold is not None and hold.parked
        defer(backend, waiting, hold)
    assert ready_ids(backend) == set()  # both wait, a lease timeout away

    finish(backend, lease)

    assert ready_ids(backend) == {parked}
    assert due_at(backend, later) > timezone.now().timestamp() + LEASE_TIMEOUT / 2
    assert usage(backend).parked == 1


def test_a_parked_job_released_before_its_requeue_wakes_itself_once_requeued(backend, limit):
    limit({QUEUE_KEY: {"concurrency": 1}})
    _, waiting = dispatch(backend, 2)
    first, second = take(backend), take(backend)
    assert acquire(backend, first) is None
    hold = acquire(backend, second)
    assert hold is not None and hold.parked

    finish(backend, first)  # the parked job is still on its way back: nobody to wake yet
    defer(backend, second, hold)  # back in the queue, it finds room and wakes itself

    assert ready_ids(backend) == {waiting}


def test_a_slot_frees_when_its_crashed_workers_lease_is_reaped(backend, limit):
    limit({QUEUE_KEY: {"concurrency": 1}})
    dispatch(backend, 2)
    crashed, other = take(backend), take(backend)
    assert acquire(backend, crashed) is None
    assert acquire(backend, other) is not None

    EXPIRE[backend](queue_of(backend), crashed)
    assert queue_of(backend).reap_expired("emails") == 1

    assert acquire(backend, other) is None
    assert usage(backend).running == 1


def test_a_lost_lease_is_refused_a_slot(backend, limit):
    limit({QUEUE_KEY: {"concurrency": 1}})
    dispatch(backend)
    lease = take(backend)
    queue_of(backend).nack(lease, 0, count_run=False)  # settled elsewhere: no longer ours

    with pytest.raises(Exception, match="no longer leased"):
        acquire(backend, lease)
    assert usage(backend).running == 0


# -- rate ----------------------------------------------------------------------------------------


def test_a_rate_grants_its_starts_then_reserves_the_next_free_one(backend, limit, clock):
    limit({QUEUE_KEY: {"rate": "2/m"}})
    dispatch(backend, 4)
    a, b, c, d = (take(backend) for _ in range(4))
    assert acquire(backend, a) is None
    clock.advance(10)
    assert acquire(backend, b) is None

    assert acquire(backend, c) == Hold(50.0, QUEUE_KEY, parked=False)  # a's start + 60 s
    assert acquire(backend, d) == Hold(60.0, QUEUE_KEY, parked=False)  # b's start + 60 s
    assert (usage(backend).starts, usage(backend).reserved) == (2, 2)


def test_a_reserved_start_is_honoured_without_asking_again(backend, limit, clock):
    limit({QUEUE_KEY: {"rate": "1/m"}})
    dispatch(backend, 3)
    a, b, c = (take(backend) for _ in range(3))
    assert acquire(backend, a) is None
    assert acquire(backend, b) == Hold(60.0, QUEUE_KEY, parked=False)

    clock.advance(60)
    assert acquire(backend, c) == Hold(60.0, QUEUE_KEY, parked=False)  # b's start is taken
    clock.advance(1)  # b comes back a little late: its start is still its own
    assert acquire(backend, b) is None
    assert (usage(backend).starts, usage(backend).reserved) == (1, 1)  # a left the window


def test_a_job_back_before_its_reserved_start_waits_for_it(backend, limit, clock):
    limit({QUEUE_KEY: {"rate": "1/m"}})
    dispatch(backend, 2)
    a, b = take(backend), take(backend)
    assert acquire(backend, a) is None
    assert acquire(backend, b) == Hold(60.0, QUEUE_KEY, parked=False)

    clock.advance(45)

    assert acquire(backend, b) == Hold(15.0, QUEUE_KEY, parked=False)
    assert usage(backend).reserved == 1  # the same reservation


def test_a_reservation_lapses_when_its_job_comes_back_too_late(backend, limit, clock):
    limit({QUEUE_KEY: {"rate": "1/m"}})
    dispatch(backend, 3)
    a, b, c = (take(backend) for _ in range(3))
    assert acquire(backend, a) is None
    assert acquire(backend, b) == Hold(60.0, QUEUE_KEY, parked=False)
    assert acquire(backend, c) == Hold(120.0, QUEUE_KEY, parked=False)

    clock.advance(60 + limits.RESERVATION_GRACE + 1)  # b missed its start

    assert acquire(backend, b) == Hold(114.0, QUEUE_KEY, parked=False)  # a minute after c's start
    assert acquire(backend, c) == Hold(54.0, QUEUE_KEY, parked=False)  # c's own is not yet due


def test_a_job_refused_by_one_limit_takes_nothing_from_the_others(backend, limit, clock):
    limit({QUEUE_KEY: {"concurrency": 1}, HANDLER_KEY: {"rate": "1/m"}})
    dispatch(backend, 2)
    a, b = take(backend), take(backend)
    assert acquire(backend, a) is None

    assert acquire(backend, b) == Hold(LEASE_TIMEOUT, QUEUE_KEY, parked=True)
    assert (usage(backend, HANDLER_KEY).starts, usage(backend, HANDLER_KEY).reserved) == (1, 0)


def test_a_job_held_by_a_rate_holds_no_concurrency_slot(backend, limit, clock):
    limit({QUEUE_KEY: {"concurrency": 5}, HANDLER_KEY: {"rate": "1/m"}})
    dispatch(backend, 2)
    a, b = take(backend), take(backend)
    assert acquire(backend, a) is None

    assert acquire(backend, b) == Hold(60.0, HANDLER_KEY, parked=False)
    assert usage(backend).running == 1


# -- through the worker --------------------------------------------------------------------------


def test_a_job_deferred_by_a_limit_is_not_counted_as_a_run(backend, limit):
    limit({QUEUE_KEY: {"concurrency": 1}})
    _, job_id = dispatch(backend, 2)
    holder = take(backend)
    assert acquire(backend, holder) is None
    metrics = InMemoryMetricsCollector()

    result = QueueWorker(backend, ["emails"], metrics=metrics).process_once()

    assert (result.status, result.label, result.job_id, result.attempt) == ("requeued", "deferred", job_id, 0)
    assert result.hold == Hold(LEASE_TIMEOUT, QUEUE_KEY, parked=True)
    assert record(backend, job_id) == ("pending", 0, "")
    assert not JobAttempt.objects.using(db(backend)).filter(job_id=job_id).exists()
    assert metrics.get("jobs_limit_wait_seconds", limit=QUEUE_KEY) == 1
    assert metrics.get("jobs_requeued") == 0

    finish(backend, holder)
    done = QueueWorker(backend, ["emails"]).process_once()
    assert (done.status, done.job_id, done.attempt) == ("acked", job_id, 1)


def park_behind_a_crash(backend: str, queue: str) -> str:
    """A job parked on a full limit of one, whose slot holder's worker then crashed (its lease
    reaped, so the slot is free, but nobody was woken). Returns the parked job's id."""
    dispatch(backend, queue=queue)
    crashed = take(backend, queue)
    assert acquire(backend, crashed) is None
    parked_id = dispatch(backend, queue=queue)[0]
    parked = take(backend, queue)
    hold = acquire(backend, parked)
    assert hold is not None and hold.parked
    defer(backend, parked, hold)
    EXPIRE[backend](queue_of(backend), crashed)  # it had no retry left: the reaper fails it
    assert queue_of(backend).reap_expired(queue) == 1
    assert ready_ids(backend, queue) == set()
    return parked_id


@pytest.mark.parametrize(
    ("action", "max_retries", "status"),
    [("ok", 0, "acked"), ("raise", 1, "requeued"), ("raise", 0, "dead-lettered")],
)
def test_the_worker_releases_its_slot_however_the_run_ends(backend, limit, action, max_retries, status):
    """The next run's release wakes the parked job, whatever the run's ending."""
    limit({HANDLER_KEY: {"concurrency": 1}})
    parked_id = park_behind_a_crash(backend, "other")
    scripted.using(backend=backend, queue="emails", max_retries=max_retries).dispatch(action=action)

    assert QueueWorker(backend, ["emails"]).process_once().status == status

    assert ready_ids(backend, "other") == {parked_id}


def loses_its_lease(context: JobContext) -> None:
    """A ``JOBS["HANDLERS"]`` handler whose lease expires and is reaped while it runs."""
    name = context.payload["backend"]
    EXPIRE[name](queue_of(name), context.lease)
    queue_of(name).reap_expired(context.lease.queue)


def test_the_worker_releases_its_slot_when_it_lost_the_lease(backend, settings):
    table = {"queue:other": {"concurrency": 1}}
    handlers = {"loses-its-lease": f"{__name__}.loses_its_lease"}
    settings.JOBS = {**settings.JOBS, "LIMITS": table, "HANDLERS": handlers, "LEASE_TIMEOUT": LEASE_TIMEOUT}
    parked_id = park_behind_a_crash(backend, "other")
    Jobs.define("loses-its-lease", {"backend": backend}).queue("other").dispatch(backend=backend)

    assert QueueWorker(backend, ["other"]).process_once().status == "lease-lost"

    assert ready_ids(backend, "other") == {parked_id}


def test_a_prefetching_worker_runs_a_limited_batch_one_at_a_time(backend, limit):
    limit({HANDLER_KEY: {"concurrency": 1, "rate": "100/m"}})
    ids = dispatch(backend, 5)
    worker = QueueWorker(backend, ["emails"], prefetch=10)
    results: list[WorkerResult] = []

    worker.run(max_jobs=5, max_time=30, reap=False, on_result=results.append)

    assert sorted((result.job_id, result.label, result.attempt) for result in results) == [
        (job_id, "completed", 1) for job_id in sorted(ids)
    ]
    assert queue_of(backend).size("emails") == 0
    assert usage(backend, HANDLER_KEY).running == 0


# -- what cannot be enforced, and bad settings ---------------------------------------------------


def test_a_worker_whose_backend_cannot_enforce_limits_fails_the_job_unrun(backend, limit, monkeypatch):
    limit({QUEUE_KEY: {"concurrency": 1}})
    job_id = scripted.using(backend=backend, queue="emails", max_retries=3).dispatch(action="ok", key="unlimited")
    monkeypatch.setattr(queue_of(backend), "supports_limits", False)

    result = QueueWorker(backend, ["emails"]).process_once()

    assert result.status == "dead-lettered"
    assert result.error is not None and result.error.startswith("LimitsNotSupported: job is limited (queue:emails")
    assert record(backend, job_id)[:2] == ("failed", 0)
    assert runs("unlimited") == 0


def test_a_limited_job_is_refused_at_dispatch_by_a_backend_without_limits(limit):
    limit({QUEUE_KEY: {"concurrency": 1}})
    with pytest.raises(LimitsNotSupported, match=r"limited \(queue:emails \(concurrency 1\)\).*'sync'"):
        scripted.using(backend="sync", queue="emails").dispatch(action="ok")
    scripted.using(backend="sync", queue="other").dispatch(action="ok")  # not limited there


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"queue:emails": {"rate": "10/week"}}, "LIMITS['queue:emails']: bad rate '10/week'"),
        ({"queue:emails": {"concurrency": 0}}, "concurrency must be an int >= 1"),
        ({"emails": {"concurrency": 1}}, "bad limit key 'emails'"),
        ({"queue:emails": {"concurency": 1}}, "unknown key(s) 'concurency'"),
        ({"queue:emails": {}}, "is empty"),
    ],
)
def test_bad_limits_are_a_system_check_error_and_refused_at_use(setting, message):
    with jobs_settings(LIMITS=setting):
        [error] = [found for found in check_settings() if found.id == "django_jobs.E015"]
        assert message in error.msg
        with pytest.raises(ImproperlyConfigured, match="JOBS\\['LIMITS'\\] is wrong"):
            limits.limits_for(HANDLER, "emails")


def test_a_limit_the_default_backend_cannot_enforce_is_a_system_check_error():
    def errors() -> list[str]:  # (other test modules may declare limits of their own @job)
        return [found.msg for found in check_settings() if found.id == "django_jobs.E015" and QUEUE_KEY in found.msg]

    with jobs_settings(LIMITS={QUEUE_KEY: {"concurrency": 1}}, DEFAULT_BACKEND="sync"):
        assert errors() == [
            "limit queue:emails (concurrency 1) cannot be enforced by backend 'sync', where its jobs go"
        ]
    with jobs_settings(LIMITS={QUEUE_KEY: {"concurrency": 1}}):
        assert errors() == []
