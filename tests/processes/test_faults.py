"""Fault injection: the worker keeps its promises after routine faults, reproduced for real.

Each test drives real ``jobs_work`` / ``jobs_reap`` processes, or the worker in this process,
against servers of the module's own (a private PostgreSQL and a private Redis on free loopback
ports): they are restarted, killed, disconnected and frozen here, and the shared servers the
rest of the suite uses are never touched.

- The heartbeat reconnects after a database restart, a killed session or a Redis restart, so a
  job longer than its lease is never reaped while its worker lives (a restart while idle too).
- A hard timeout kills the attempt whatever the backend's health.
- A job's forked child that unwinds out of the job exits: it never becomes a second worker.
- An error in the worker's own code after the handler was called (a job error whose ``__str__``
  raises, a ``KeyboardInterrupt`` from a job) settles the job at once as a failed run with the
  real error; an idempotency cache that fails before the start defers the job, uncounted.
- A worker that stalls between the claim and the handler keeps its lease through the stall (the
  guards run under the heartbeat), and a handler never starts on a lease that was lost.

Malformed and hostile input (backoff overflow, forged broker messages, long idempotency keys)
is in tests/integration/test_faults_hostile.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from bench.chaos.workers import group_pids
from django_jobs.metrics import InMemoryMetricsCollector
from django_jobs.models import Job, JobStatus
from django_jobs.reaper import Reaper
from django_jobs.worker import QueueWorker
from tests.procs import pid_alive, processes, wait_until
from tests.testapp.jobs import scripted
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.slow

PG = "postgres"
LEASE = 2.0  # seconds: jobs below run several leases long, so only heartbeats keep them
PG_WORKER = ("--backend", "pg")
REAP_LOOP = ("jobs_reap", "--backend", "pg", "--loop", "--interval", "0.3")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


# -- helpers for the private PostgreSQL ----------------------------------------------------------


def dispatch(pg: Any, procs: Any, **kwargs: Any) -> str:
    """Dispatch ``scripted`` onto the private PostgreSQL (backend "pg") from a subprocess."""
    options = {"backend": "pg", "max_retries": kwargs.pop("max_retries", 0)}
    if "timeout" in kwargs:
        options["timeout"] = kwargs.pop("timeout")
    kwargs.setdefault("db", PG)  # side effects go to the same private database
    code = f"from tests.testapp.jobs import scripted; print(scripted.using(**{options!r}).dispatch(**{kwargs!r}))"
    rc, proc = procs.run("shell", "-c", code, env=pg.env(), timeout=60)
    assert rc == 0, proc.output()
    return proc.out[-1].strip()


def row(pg: Any, job_id: str) -> tuple[str, int, str]:
    """(status, attempts, last_error) of a job on the private PostgreSQL; retried across restarts."""

    def read() -> tuple[str, int, str] | None:
        try:
            with pg.connect() as conn:
                found = conn.execute(
                    "SELECT status, attempts, last_error FROM django_jobs_job WHERE id = %s", [job_id]
                ).fetchone()
        except Exception:  # noqa: BLE001 - the server is restarting: read again
            return None
        assert found is not None, f"job {job_id} is not in the table"
        return found

    return wait_until(read, 60, f"a readable row for job {job_id}", interval=0.2)


def runs(pg: Any, key: str) -> int:
    with pg.connect() as conn:
        return conn.execute("SELECT count(*) FROM testapp_sideeffect WHERE key = %s", [key]).fetchone()[0]


def settled(pg: Any, job_id: str, timeout: float = 60) -> tuple[str, int, str]:
    def done() -> tuple[str, int, str] | None:
        found = row(pg, job_id)
        return found if found[0] in (JobStatus.COMPLETED, JobStatus.FAILED) else None

    return wait_until(done, timeout, f"job {job_id} to be settled", interval=0.2)


def assert_ran_once_and_completed(pg: Any, job_id: str, key: str, worker: Any) -> None:
    status, attempts, error = settled(pg, job_id)
    assert (status, attempts) == (JobStatus.COMPLETED, 1), (
        f"the job was reaped while its worker lived: {status}, {attempts} run(s), {error!r}\n{worker.output()}"
    )
    assert runs(pg, key) == 1, f"the job ran {runs(pg, key)} times\n{worker.output()}"
    assert worker.alive(), worker.output()


# -- 1. the heartbeat reconnects ------------------------------------------------------------------


def test_heartbeat_reconnects_after_a_database_restart_while_the_worker_was_idle(private_postgres):
    """One restart while idle used to break the heartbeat thread's connection for good: every
    later job longer than its lease was then reaped while it ran and recorded failed."""
    pg = private_postgres
    with processes() as procs:
        worker = procs.worker(*PG_WORKER, env=pg.env(LEASE))
        procs.start(*REAP_LOOP, env=pg.env(LEASE))
        # A first job longer than one beat interval: the heartbeat thread opens its connection.
        warm_key = unique("warm")
        warm = dispatch(pg, procs, action="sleep", seconds=1.5, key=warm_key)
        assert_ran_once_and_completed(pg, warm, warm_key, worker)

        pg.restart()  # while the worker is idle

        key = unique("long")
        job_id = dispatch(pg, procs, action="sleep", seconds=3 * LEASE + 1, key=key)
        assert_ran_once_and_completed(pg, job_id, key, worker)


# A restart makes the database unreachable for a second or more (longer on a loaded machine):
# its lease must outlast the outage itself, or the expiry is real. A killed session is instant.
@pytest.mark.parametrize(("fault", "lease"), [("terminate_backends", LEASE), ("restart", 3 * LEASE)])
def test_heartbeat_reconnects_when_the_database_fails_during_a_long_job(private_postgres, fault, lease):
    pg = private_postgres
    with processes() as procs:
        worker = procs.worker(*PG_WORKER, env=pg.env(lease))
        procs.start(*REAP_LOOP, env=pg.env(lease))
        key = unique(fault)
        job_id = dispatch(pg, procs, action="sleep", seconds=3 * lease, key=key)
        wait_until(lambda: runs(pg, key) == 1, 30, "the long job to start")
        time.sleep(lease / 2)  # a beat or two on the heartbeat's own connection

        if fault == "restart":
            pg.restart()
        else:
            assert pg.terminate_backends() > 0  # the worker's, the heartbeat's and the reaper's sessions

        assert_ran_once_and_completed(pg, job_id, key, worker)


@pytest.mark.parametrize("prefetch", ["1", "100"], ids=["one-at-a-time", "batches"])
def test_a_success_that_ends_in_an_outage_is_completed_not_reaped(private_postgres, prefetch):
    """A job that succeeded while the database was down was settled with 3 s of retries, then
    forgotten: its worker reaped it after the outage, and it was failed ``WorkerLost`` though it
    had completed (a red team, 10 s outages, ``LEASE_TIMEOUT`` 3 s, with ``jobs_reap --loop``
    beside it). The settle is kept and written first once the database answers, while the
    reapers still hold back."""
    pg = private_postgres
    lease = 3.0
    with processes() as procs:
        worker = procs.worker(*PG_WORKER, "--prefetch", prefetch, env=pg.env(lease))
        procs.start("jobs_reap", "--backend", "pg", "--loop", "--interval", "4", env=pg.env(lease))
        key = unique("outage")
        job_id = dispatch(pg, procs, action="sleep", seconds=1.5, key=key)
        wait_until(lambda: runs(pg, key) == 1, 30, "the job to start")
        pg.restart(outage=7.0)  # the job ends 1.5 s into it; its settle's retries end 3 s later

        status, attempts, error = settled(pg, job_id)
        assert (status, attempts, error) == (JobStatus.COMPLETED, 1, ""), worker.output()
        time.sleep(lease)  # a reap after the return would find nothing to take
        assert row(pg, job_id)[0] == JobStatus.COMPLETED, worker.output()
        assert runs(pg, key) == 1, worker.output()


@pytest.mark.postgres
@pytest.mark.django_db(databases=["default", PG], transaction=True)
def test_heartbeat_keeps_a_redis_lease_through_a_redis_restart(private_redis, postgres_up):
    from django_jobs.backends import get_backend

    key = unique("redis-long")
    env = private_redis.env(LEASE)
    jobs = {
        **settings.JOBS,
        "BACKENDS": {
            **settings.JOBS["BACKENDS"],
            "redis": {"ENGINE": "redis", "OPTIONS": {"URL": private_redis.url, "PREFIX": settings.REDIS_PREFIX}},
        },
    }
    with override_settings(JOBS=jobs), processes() as procs:
        backend = get_backend("redis")
        job_id = scripted.using(backend="redis").dispatch(action="sleep", seconds=4 * LEASE, key=key, db=PG)
        worker = procs.worker("--backend", "redis", env=env)
        procs.start("jobs_reap", "--backend", "redis", "--loop", "--interval", "0.3", env=env)
        wait_until(lambda: SideEffect.objects.using(PG).filter(key=key).exists(), 30, "the long job to start")
        time.sleep(LEASE / 2)

        private_redis.restart()
        backend.close()

        wait_until(lambda: backend.size("default") == 0, 60, "the job to be settled", interval=0.2)
        assert SideEffect.objects.using(PG).filter(key=key).count() == 1, worker.output()
        assert backend.stats("default")["failed"] == 0, worker.output()
        assert not Job.objects.filter(pk=job_id).exists(), "the job was recorded failed"
        assert worker.alive(), worker.output()
        backend.close()


# -- 2. hard timeouts whatever the backend's health ---------------------------------------------


def test_a_hard_timeout_during_a_database_outage_still_kills_the_attempt(private_postgres):
    """The job masks every signal (as a C call would), so only the hard limit can end it; the
    database is down at that moment. The attempt is killed anyway, and the next job's hard limit
    works too (the heartbeat thread survived)."""
    pg = private_postgres
    with processes() as procs:
        worker = procs.worker(*PG_WORKER, env=pg.env(LEASE))
        first_key, second_key = unique("stuck"), unique("stuck-again")
        first = dispatch(pg, procs, action="hang_masked", timeout=2, key=first_key)
        wait_until(lambda: runs(pg, first_key) == 1, 30, "the stuck job to start")
        killed_pid = _side_effect_pid(pg, first_key)

        pg.kill()  # down before the hard limit (2 s + 2 s grace) fires, and for longer than
        time.sleep(10)  # a settle's retries could wait
        pg.start()

        # The stuck process was killed and replaced, though the settle could not reach the database.
        wait_until(lambda: not pid_alive(killed_pid), 30, f"the stuck worker process {killed_pid} to be killed")
        status, attempts, error = settled(pg, first, timeout=60)  # reaped: its settle was impossible
        assert (status, attempts) == (JobStatus.FAILED, 1), error

        second = dispatch(pg, procs, action="hang_masked", timeout=2, key=second_key)
        status, attempts, error = settled(pg, second, timeout=60)
        assert (status, attempts) == (JobStatus.FAILED, 1)
        assert "JobTimeout" in error, error
        assert runs(pg, second_key) == 1
        assert worker.alive(), worker.output()


def _side_effect_pid(pg: Any, key: str) -> int:
    with pg.connect() as conn:
        return conn.execute("SELECT pid FROM testapp_sideeffect WHERE key = %s", [key]).fetchone()[0]


# -- 3. a forking job -------------------------------------------------------------------------------


def test_a_forked_child_that_unwinds_out_of_a_job_exits_and_never_becomes_a_worker(private_postgres):
    pg = private_postgres
    with processes() as procs:
        worker = procs.worker(*PG_WORKER, env=pg.env(LEASE))
        fork_key = unique("fork")
        forked = dispatch(pg, procs, action="fork", key=fork_key)
        status, attempts, _ = settled(pg, forked)
        assert (status, attempts) == (JobStatus.COMPLETED, 1), worker.output()
        worker_pid = _side_effect_pid(pg, fork_key)

        bystanders = {unique("bystander"): None for _ in range(6)}
        for key in bystanders:
            bystanders[key] = dispatch(pg, procs, action="sleep", seconds=0.2, key=key)
        for key, job_id in bystanders.items():
            status, attempts, error = settled(pg, job_id)
            assert (status, attempts) == (JobStatus.COMPLETED, 1), error
            assert runs(pg, key) == 1
            # Every bystander ran in the worker process itself, none in a rogue child.
            assert _side_effect_pid(pg, key) == worker_pid

        assert worker.stop() == 0, worker.output()
        leftovers = group_pids(worker.pid)
        assert leftovers == [], f"processes of the worker's group survived its stop: {leftovers}"
        assert len(worker.job_lines()) == 1 + len(bystanders), worker.output()


# -- 4. errors in the worker's own code settle the job at once ------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(databases=["default", PG], transaction=True)
@pytest.mark.parametrize(
    ("action", "expected"),
    [("bad_str", "_Unprintable: <unprintable _Unprintable"), ("interrupt", "KeyboardInterrupt")],
)
def test_a_job_error_the_worker_cannot_describe_or_an_interrupt_is_a_failed_run(postgres_up, action, expected):
    job_id = scripted.using(backend="pg").dispatch(action=action)
    result = QueueWorker("pg").process_once()

    assert (result.status, result.attempt) == ("dead-lettered", 1)
    job = Job.objects.using(PG).get(pk=job_id)
    assert (job.status, job.attempts) == (JobStatus.FAILED, 1)
    assert job.last_error.startswith(expected), job.last_error
    assert "WorkerLost" not in job.last_error


@pytest.mark.postgres
@pytest.mark.django_db(databases=["default", PG], transaction=True)
def test_an_idempotency_cache_that_fails_defers_the_job_uncounted_and_says_so(postgres_up, caplog):
    """The guard's cache is down before the start: no run happened, so none is counted (a
    ``max_retries=0`` job is not failed). The job is deferred, the error logged with its class
    and counted; once the cache answers, the job runs once."""
    broken = {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": "redis://127.0.0.1:1/0"}
    key = unique("cache-down")
    worker = QueueWorker("pg", metrics=InMemoryMetricsCollector(), busy_delay=0)
    with override_settings(
        CACHES={**settings.CACHES, "broken": broken}, JOBS={**settings.JOBS, "IDEMPOTENCY_CACHE": "broken"}
    ):
        job_id = scripted.using(backend="pg", idempotency_key=key, max_retries=0).dispatch(action="ok", key=key, db=PG)
        result = worker.process_once()

    assert (result.status, result.label, result.attempt) == ("requeued", "deferred", 0)
    assert "ConnectionError" in (result.error or "").partition("\n")[0], result.error
    job = Job.objects.using(PG).get(pk=job_id)
    assert (job.status, job.attempts) == (JobStatus.PENDING, 0)
    assert not SideEffect.objects.using(PG).filter(key=key).exists(), "ran without its idempotency guard"
    assert worker.metrics.get("jobs_backend_errors") == 1
    assert "error before it started" in caplog.text

    assert worker.process_once().status == "acked"  # the default cache answers
    assert SideEffect.objects.using(PG).filter(key=key).count() == 1


def _in_thread(worker: QueueWorker, results: list[Any]) -> None:
    from django.db import connections

    try:
        results.append(worker.process_once())
    finally:
        connections.close_all()


# -- 5. the claim-to-run gap ------------------------------------------------------------------------


def test_a_stall_between_claim_and_run_keeps_the_lease_and_runs_the_job_once(private_postgres, private_redis):
    """The idempotency cache freezes (SIGSTOP) for three leases right after the claim: the
    guards run under the heartbeat, so the job is not reaped meanwhile and runs exactly once."""
    pg = private_postgres
    env = pg.env(LEASE, JOBS_TEST_IDEMPOTENCY_REDIS=private_redis.url)
    with processes() as procs:
        key = unique("frozen-cache")
        os.kill(private_redis.popen.pid, signal.SIGSTOP)
        try:
            worker = procs.worker(*PG_WORKER, env=env)
            procs.start(*REAP_LOOP, env=env)
            code = (
                "from tests.testapp.jobs import scripted; "
                f"print(scripted.using(backend='pg', idempotency_key={key!r}).dispatch(action='ok', key={key!r}, db='postgres'))"
            )
            rc, proc = procs.run("shell", "-c", code, env=pg.env(), timeout=60)
            assert rc == 0, proc.output()
            job_id = proc.out[-1].strip()
            wait_until(lambda: row(pg, job_id)[0] == JobStatus.IN_PROGRESS, 30, "the claim")
            time.sleep(3 * LEASE)  # the worker is stuck in cache.add
        finally:
            os.kill(private_redis.popen.pid, signal.SIGCONT)
        assert_ran_once_and_completed(pg, job_id, key, worker)


@pytest.mark.postgres
@pytest.mark.django_db(databases=["default", PG], transaction=True)
def test_a_handler_never_starts_on_a_lease_that_was_reaped_during_a_stall(private_redis, postgres_up):
    """No heartbeat runs here (process_once outside run()), the cache freezes past the lease,
    the reaper fails the job (max_retries=0): when the cache answers, the job must not run."""
    key = unique("reaped-in-stall")
    caches = {
        **settings.CACHES,
        "idem": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": private_redis.url,
            "OPTIONS": {"socket_timeout": 60},
        },
    }
    with override_settings(CACHES=caches, JOBS={**settings.JOBS, "IDEMPOTENCY_CACHE": "idem", "LEASE_TIMEOUT": 1}):
        job_id = scripted.using(backend="pg", idempotency_key=key).dispatch(action="ok", key=key, db=PG)
        worker = QueueWorker("pg")
        results: list[Any] = []
        os.kill(private_redis.popen.pid, signal.SIGSTOP)
        try:
            thread = threading.Thread(target=_in_thread, args=(worker, results))
            thread.start()
            wait_until(lambda: Job.objects.using(PG).get(pk=job_id).status == JobStatus.IN_PROGRESS, 10, "the claim")
            time.sleep(1.5)  # past the 1 s lease
            assert Reaper("pg").reap_once() == 1
        finally:
            os.kill(private_redis.popen.pid, signal.SIGCONT)
        thread.join(30)

    assert [r.status for r in results] == ["lease-lost"]
    assert worker.metrics.get("jobs_lease_lost", queue="default") == 1  # type: ignore[attr-defined]
    assert not SideEffect.objects.using(PG).filter(key=key).exists(), "the handler ran on a reaped lease"
    job = Job.objects.using(PG).get(pk=job_id)
    assert (job.status, job.attempts) == (JobStatus.FAILED, 1)
    assert job.last_error.startswith("WorkerLost")
