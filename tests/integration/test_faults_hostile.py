"""Hostile and oversized input (issue 8, items 6-8), reproduced against real services.

6. A backoff (or delay) so large that date arithmetic overflows: refused at dispatch; a row
   written straight into the PostgreSQL table with such options is recovered by the reaper with
   the global policy (its options are not signed), a signed one has its delay clamped to the
   maximum, a row whose update fails is skipped and counted, and the worker keeps working.
7. A badly signed envelope pushed straight into Redis or beanstalkd with the id of an existing
   job: rejected, the existing row untouched, the forgery kept under a new id of its own, and
   the admin's retry refuses to re-send it.
8. An idempotency key (or a handler name, for single-instance locks) longer than Django's
   ``DatabaseCache`` keys may be, on PostgreSQL: the job runs once and a repeat is skipped,
   instead of being requeued as "busy" forever.

Only the worker's public surface is used: ``QueueWorker(backend, queues)``, ``process_once()``
and ``run(max_jobs=..., max_time=...)``, and each result's ``status``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import greenstalk
import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connections
from django.test import override_settings
from django.utils import timezone

from django_jobs import Jobs, signing
from django_jobs.backends import get_backend
from django_jobs.backends.redis import KINDS
from django_jobs.envelope import Envelope
from django_jobs.metrics import get_collector
from django_jobs.models import Job, JobStatus
from django_jobs.operations import retry_jobs
from django_jobs.worker import QueueWorker
from tests.testapp.jobs import scripted
from tests.testapp.models import SideEffect

PG = "postgres"
YEAR = 365 * 24 * 3600  # the longest delay a job may be given
HUGE_BACKOFF = {"strategy": "fixed", "base": 1e14, "max": 1e14}  # 3 million years
PG_DB = pytest.mark.django_db(databases=["default", PG])


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def runs(key: str, db: str = PG) -> int:
    return SideEffect.objects.using(db).filter(key=key).count()


def payload(key: str, db: str = PG) -> dict[str, Any]:
    """A ``scripted`` payload that records a SideEffect under ``key`` when it runs."""
    return {"args": [], "kwargs": {"action": "ok", "key": key, "db": db}}


def forged(job_id: str, key: str, queue: str = "default", db: str = "default") -> Envelope:
    """What a writer without the signing key can push: any id, any payload, a wrong MAC."""
    env = Envelope(id=job_id, handler=scripted.key, payload=payload(key, db), queue=queue)
    with override_settings(JOBS={**settings.JOBS, "SIGNING_KEY": "an attacker's key, not the workers'"}):
        env.signature = signing.sign(env)
    return env


# -- 6. a backoff that overflows date arithmetic ---------------------------------------------------


@pytest.mark.parametrize(
    "define",
    [
        pytest.param(lambda b: b.backoff(**HUGE_BACKOFF), id="backoff-fixed-1e14"),
        pytest.param(lambda b: b.backoff(strategy="exponential", base=5, max=float("inf")), id="backoff-max-inf"),
        pytest.param(lambda b: b.backoff(strategy="fixed", base=float("nan")), id="backoff-base-nan"),
        pytest.param(lambda b: b.backoff(strategy="fixed", base=YEAR + 1), id="backoff-base-over-a-year"),
        pytest.param(lambda b: b.delay(1e14), id="delay-1e14"),
        pytest.param(lambda b: b.delay(float("inf")), id="delay-inf"),
        pytest.param(lambda b: b.delay(timedelta(days=400)), id="delay-400-days"),
        pytest.param(lambda b: b.scheduled_at(timezone.now() + timedelta(days=800)), id="scheduled-in-800-days"),
    ],
)
def test_a_delay_or_backoff_beyond_a_year_is_refused_when_the_job_is_defined(define):
    with pytest.raises(ValueError, match=r"too long|too far ahead|finite|NaN"):
        define(Jobs.define("command", "check"))


@pytest.mark.postgres
@PG_DB
def test_dispatch_with_a_huge_backoff_is_refused_and_writes_nothing(postgres_up):
    with pytest.raises(ValueError, match=r"backoff base of \S+ seconds is too long: at most 31536000"):
        scripted.using(backend="pg", backoff=HUGE_BACKOFF).dispatch(action="ok")
    assert not Job.objects.using(PG).exists()
    # The limit itself is accepted: a year.
    job_id = scripted.using(backend="pg", backoff={"strategy": "fixed", "base": YEAR, "max": YEAR}).dispatch()
    assert Job.objects.using(PG).get(pk=job_id).options["backoff"]["base"] == YEAR


def _lost(job_id: str, attempts: int = 0) -> None:
    """The row's worker died a minute ago: in progress, lease expired."""
    past = timezone.now() - timedelta(seconds=60)
    updated = (
        Job.objects.using(PG)
        .filter(pk=job_id)
        .update(
            status=JobStatus.IN_PROGRESS,
            owner_token=uuid.uuid4().hex,
            leased_until=past,
            attempts=attempts,
        )
    )
    assert updated == 1


def _unsigned_lost_row(key: str, **fields: Any) -> str:
    """A row written straight into the table (no signing key): a huge backoff in its options."""
    job_id = uuid.uuid4().hex
    Job.objects.using(PG).create(
        id=job_id,
        queue="default",
        handler=scripted.key,
        payload=payload(key),
        options={"backoff": HUGE_BACKOFF},
        signature="0" * 64,
        max_retries=3,
        backend="pg",
        available_at=timezone.now() - timedelta(minutes=5),
        **fields,
    )
    _lost(job_id, fields.get("attempts", 0))
    return job_id


def _signed_lost_row(key: str) -> str:
    """A validly signed job whose own backoff is huge (dispatched before delays were checked)."""
    env = Envelope(
        id=uuid.uuid4().hex,
        handler=scripted.key,
        payload=payload(key),
        queue="default",
        max_retries=3,
        options={"backoff": HUGE_BACKOFF},
    )
    env.signature = signing.sign(env)
    get_backend("pg").enqueue(env)
    _lost(env.id)
    return env.id


@pytest.mark.postgres
@PG_DB
def test_reaper_recovers_an_unsigned_huge_backoff_row_and_isolates_a_failing_one(postgres_up):
    backend = get_backend("pg")
    bad_key, lost_key, good_key = unique("forged"), unique("lost"), unique("good")
    unsigned = _unsigned_lost_row(bad_key)
    signed_huge = _signed_lost_row(unique("huge"))
    lost = scripted.using(backend="pg", max_retries=1).dispatch(action="ok", key=lost_key, db=PG)
    _lost(lost)
    # attempts + 1 overflows PostgreSQL's integer column: this row's update fails.
    broken = _unsigned_lost_row(unique("broken"))
    Job.objects.using(PG).filter(pk=broken).update(attempts=2**31 - 1, max_retries=2**31 - 1)

    before = timezone.now()
    assert backend.reap_expired("default") == 3  # the pass went on past the row that failed
    after = timezone.now()

    rows = {row.pk: row for row in Job.objects.using(PG).all()}
    # Unsigned: recovered as a lost run, with the global policy (no backoff: due at once).
    assert (rows[unsigned].status, rows[unsigned].attempts) == (JobStatus.PENDING, 1)
    assert rows[unsigned].available_at <= after
    assert rows[unsigned].last_error.startswith("WorkerLost"), rows[unsigned].last_error
    # Signed: its own backoff applies, clamped to the maximum delay instead of overflowing.
    assert rows[signed_huge].status == JobStatus.PENDING
    assert before + timedelta(seconds=YEAR - 5) <= rows[signed_huge].available_at <= after + timedelta(seconds=YEAR)
    assert (rows[lost].status, rows[lost].attempts) == (JobStatus.PENDING, 1)
    # The failing row is left as it was, and counted.
    assert rows[broken].status == JobStatus.IN_PROGRESS
    assert get_collector().get("jobs_reap_errors", queue="default") == 1

    # The worker still serves the queue: the good jobs and the recovered one run, the unsigned
    # row is rejected (it never runs), the signed one waits for its (clamped) delay.
    good = [scripted.using(backend="pg").dispatch(action="ok", key=good_key, db=PG) for _ in range(3)]
    results = []
    worker = QueueWorker("pg", ["default"])
    for _ in range(10):
        result = worker.process_once()
        if result.status == "empty":
            break
        results.append(result)
    statuses = {r.job_id: r.status for r in results}
    assert statuses == {**dict.fromkeys(good, "acked"), lost: "acked", unsigned: "rejected"}, results
    assert (runs(good_key), runs(lost_key), runs(bad_key)) == (3, 1, 0)


@pytest.mark.postgres
@PG_DB
def test_worker_run_keeps_processing_jobs_when_an_expired_row_carries_a_huge_backoff(postgres_up):
    """The worker's own reaper meets the row first: before the fix every pass raised
    OverflowError and run() retried the reap forever without fetching a job."""
    bad_key, good_key = unique("forged"), unique("good")
    unsigned = _unsigned_lost_row(bad_key)
    signed_huge = _signed_lost_row(unique("huge"))
    good = [scripted.using(backend="pg").dispatch(action="ok", key=good_key, db=PG) for _ in range(3)]

    QueueWorker("pg", ["default"]).run(max_jobs=4, max_time=10)  # 3 good jobs + the rejected row

    assert runs(good_key) == 3
    assert runs(bad_key) == 0
    rows = {row.pk: row for row in Job.objects.using(PG).all()}
    assert {rows[pk].status for pk in good} == {JobStatus.COMPLETED}
    assert rows[unsigned].status == JobStatus.FAILED
    assert rows[unsigned].last_error.startswith("rejected: BadSignature"), rows[unsigned].last_error
    assert rows[signed_huge].status == JobStatus.PENDING


# -- 7. a forged broker message naming an existing job -----------------------------------------------


@pytest.fixture
def redis_backend(redis_up):
    backend = get_backend("redis")
    yield backend
    left = list(redis_up.scan_iter(match=f"{settings.REDIS_PREFIX}:*", count=1000))
    if left:
        redis_up.delete(*left)


def _push_to_redis(backend: Any, env: Envelope, queue: str = "default") -> None:
    """Raw writes, as anyone with access to the Redis server could make them."""
    keys = dict(zip(KINDS, backend.keys(queue), strict=True))
    client = backend.client
    client.hset(keys["bodies"], env.id, env.to_bytes())
    client.zadd(keys["waiting"], {env.id: client.incr(keys["sequence"])})


def _push_to_beanstalk(address: tuple[str, int], backend: Any, env: Envelope, queue: str = "default") -> None:
    tube = backend.tube_name(queue)
    with greenstalk.Client(address, encoding=None, use=tube, watch=tube) as client:
        client.put(env.to_bytes(), ttr=60)


def _snapshot(job_id: str) -> dict[str, Any]:
    return (
        Job.objects.filter(pk=job_id)
        .values(
            "status",
            "payload",
            "signature",
            "backend",
            "attempts",
            "last_error",
            "handler",
            "options",
            "updated_at",
        )
        .get()
    )


def _assert_forgery_kept_apart(victim: str, victim_before: dict[str, Any], broker: str, evil_key: str) -> Job:
    """The victim row is untouched; the forgery has its own failed row, which cannot be retried."""
    assert _snapshot(victim) == victim_before, "an unverified message changed an existing row"
    audit = Job.objects.exclude(pk=victim).get(backend=broker)
    assert audit.status == JobStatus.FAILED
    assert audit.last_error.startswith("rejected: BadSignature"), audit.last_error
    assert victim in audit.last_error, "the id it claimed is kept in the error text"
    assert audit.payload == payload(evil_key, "default"), "kept as received, for audit"

    outcome = retry_jobs(Job.objects.filter(pk=audit.pk))
    assert outcome.retried == 0
    assert len(outcome.errors) == 1 and audit.pk in outcome.errors[0] and "signature" in outcome.errors[0]
    assert Job.objects.get(pk=audit.pk).status == JobStatus.FAILED
    return audit


@pytest.mark.django_db
def test_forged_redis_message_with_an_existing_job_id_leaves_that_row_alone(redis_backend):
    victim_key, evil_key = unique("victim"), unique("evil")
    victim = scripted.dispatch(action="ok", key=victim_key, db="default")  # pending, database backend
    before = _snapshot(victim)
    _push_to_redis(redis_backend, forged(victim, evil_key))

    result = QueueWorker("redis", ["default"]).process_once()
    assert (result.status, result.job_id) == ("rejected", victim)

    _assert_forgery_kept_apart(victim, before, "redis", evil_key)
    assert redis_backend.size("default") == 0, "the admin's retry re-sent nothing"
    # The real job is still there and runs; the forgery never did.
    assert QueueWorker("default", ["default"]).process_once().status == "acked"
    assert (runs(victim_key, "default"), runs(evil_key, "default")) == (1, 0)


@pytest.mark.django_db
def test_signed_copy_replayed_into_redis_does_not_overwrite_the_database_job(redis_backend):
    """Verified but replayed (another queue, another backend): still not that job's record."""
    victim_key = unique("victim")
    victim = scripted.dispatch(action="ok", key=victim_key, db="default")
    before = _snapshot(victim)
    row = Job.objects.get(pk=victim)
    copy = Envelope(
        id=row.id,
        handler=row.handler,
        payload=row.payload,
        queue=row.queue,
        max_retries=row.max_retries,
        name=row.name,
        options=row.options,
        signature=row.signature,
    )
    _push_to_redis(redis_backend, copy, queue="other")

    result = QueueWorker("redis", ["other"]).process_once()
    assert (result.status, result.job_id) == ("rejected", victim)
    assert _snapshot(victim) == before
    audit = Job.objects.exclude(pk=victim).get(backend="redis")
    assert audit.status == JobStatus.FAILED and victim in audit.last_error
    assert QueueWorker("default", ["default"]).process_once().status == "acked"
    assert runs(victim_key, "default") == 1


@pytest.mark.django_db
def test_forged_beanstalk_message_with_an_existing_job_id_leaves_that_row_alone(beanstalk_up):
    backend = get_backend("beanstalk")
    victim_key, evil_key = unique("victim"), unique("evil")
    victim = scripted.dispatch(action="ok", key=victim_key, db="default")
    before = _snapshot(victim)
    _push_to_beanstalk(beanstalk_up, backend, forged(victim, evil_key))

    result = QueueWorker("beanstalk", ["default"]).process_once()
    assert (result.status, result.job_id) == ("rejected", victim)

    _assert_forgery_kept_apart(victim, before, "beanstalk", evil_key)
    assert backend.stats("default")["pending"] == 0, "the admin's retry re-sent nothing"
    assert QueueWorker("default", ["default"]).process_once().status == "acked"
    assert (runs(victim_key, "default"), runs(evil_key, "default")) == (1, 0)


# -- 8. keys longer than DatabaseCache allows ---------------------------------------------------------


class CacheOnPostgres:
    """Puts Django's DatabaseCache table in the PostgreSQL test database."""

    def _route(self, model: Any, **hints: Any) -> str | None:
        return PG if model._meta.app_label == "django_cache" else None

    db_for_read = db_for_write = _route

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return db == PG if app_label == "django_cache" else None


def record_single_run(context: Any) -> None:
    """A ``JOBS["HANDLERS"]`` function handler: records its run."""
    SideEffect.objects.using(PG).create(key=context.payload["key"])


LONG_HANDLER = "reports." + "monthly_reconciliation_of_every_ledger_" * 6 + "handler"  # 249 characters


@pytest.fixture
def database_cache(postgres_up) -> Iterator[str]:
    """``IDEMPOTENCY_CACHE`` is a DatabaseCache whose table lives in PostgreSQL (created inside
    the test's transaction, so it is gone after the test)."""
    table = f"jobs_cache_{uuid.uuid4().hex[:8]}"
    caches_setting = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "jobs": {"BACKEND": "django.core.cache.backends.db.DatabaseCache", "LOCATION": table},
    }
    jobs = {**settings.JOBS, "IDEMPOTENCY_CACHE": "jobs", "HANDLERS": {LONG_HANDLER: f"{__name__}.record_single_run"}}
    with override_settings(CACHES=caches_setting, DATABASE_ROUTERS=[f"{__name__}.CacheOnPostgres"], JOBS=jobs):
        call_command("createcachetable", database=PG, verbosity=0)
        yield table


def _cache_keys(table: str) -> list[str]:
    with connections[PG].cursor() as cursor:
        cursor.execute(f"SELECT cache_key FROM {table}")
        return [row[0] for row in cursor.fetchall()]


@pytest.mark.postgres
@PG_DB
def test_a_240_character_idempotency_key_works_on_database_cache(database_cache):
    key = "invoice-" + "x" * 232
    assert len(key) == 240
    run_key = unique("idem")
    first = scripted.using(backend="pg", idempotency_key=key).dispatch(action="ok", key=run_key, db=PG)
    second = scripted.using(backend="pg", idempotency_key=key).dispatch(action="ok", key=run_key, db=PG)
    worker = QueueWorker("pg", ["default"])

    assert (worker.process_once().status, runs(run_key)) == ("acked", 1)
    result = worker.process_once()
    assert (result.status, result.job_id) == ("skipped-idempotent", second)
    assert worker.process_once().status == "empty"
    assert runs(run_key) == 1
    assert Job.objects.using(PG).get(pk=first).status == JobStatus.COMPLETED
    # The marker really is in the PostgreSQL table, under a key the table can hold.
    stored = _cache_keys(database_cache)
    assert len(stored) == 1 and "sha256:" in stored[0] and len(stored[0]) < 200, stored


@pytest.mark.postgres
@PG_DB
def test_a_single_instance_job_with_a_long_handler_name_runs_on_database_cache(database_cache):
    assert len(LONG_HANDLER) == 249
    run_key = unique("single")
    Jobs.define(LONG_HANDLER, {"key": run_key}).single_instance().dispatch(backend="pg")

    result = QueueWorker("pg", ["default"]).process_once()
    assert result.status == "acked", result
    assert runs(run_key) == 1
