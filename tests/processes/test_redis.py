"""Redis-specific behaviour of the Redis backend, against a real Redis server.

The protocol itself (fetch, ack, nack, abandon, fencing, reaping, priority) is covered for
Redis by tests/integration/test_conformance.py. This file covers what only Redis has: real worker
processes sharing one Redis queue, a crashed worker's lease recovered by ``jobs_reap``,
workers surviving a Redis restart, raw bytes pushed into the keys, the failed set and its
admin retry, on-commit dispatch, the django-redis cache option, the missing extra, the
blocking wait and the stats.

Key names always come from ``backend.keys(queue)`` (the product's ``QueueKeys``), and every
key lives under this session's prefix, which the ``redis_up`` fixture clears before each test.
"""

from __future__ import annotations

import importlib
import importlib.resources
import io
import json
import logging
import re
import signal
import sqlite3
import sys
import threading
import time
import uuid
from collections import Counter
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connections, transaction
from django.test import override_settings
from redis.backoff import NoBackoff
from redis.retry import Retry

from django_jobs import Jobs
from django_jobs.backends import get_backend
from django_jobs.backends.redis import QueueKeys, RedisBackend
from django_jobs.backends.redis_limits import LimitKeys
from django_jobs.envelope import Envelope
from django_jobs.idempotency import Claim, IdempotencyGuard
from django_jobs.metrics import get_collector
from django_jobs.models import Job, JobStatus
from django_jobs.operations import retry_jobs
from django_jobs.reaper import Reaper
from django_jobs.worker import QueueWorker
from tests.procs import pid_alive, processes, wait_until, worker_env
from tests.testapp.jobs import scripted
from tests.testapp.models import SideEffect

PG = "postgres"
NO_BACKOFF = {"strategy": "none"}
PROCESS_DB = pytest.mark.django_db(databases=["default", PG], transaction=True)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def effects(key: str, db: str = PG) -> list[SideEffect]:
    return list(SideEffect.objects.using(db).filter(key=key).order_by("id"))


def runs_with_prefix(prefix: str) -> Any:
    return SideEffect.objects.using(PG).filter(key__startswith=prefix + "-")


def zero_stats() -> dict[str, int]:
    return {"pending": 0, "delayed": 0, "in_progress": 0, "failed": 0, "waiting": 0}


@pytest.fixture
def raw(redis_up):
    """A plain redis-py client on the shared test server and DB (``redis_up`` cleared this
    session's keys before the test); the keys this test left are deleted after it too."""
    yield redis_up
    left = list(redis_up.scan_iter(match=f"{settings.REDIS_PREFIX}:*", count=1000))
    if left:
        redis_up.delete(*left)


@pytest.fixture
def backend(raw) -> RedisBackend:
    """The ``redis`` backend of tests/settings.py (this session's prefix, DB 9)."""
    instance = get_backend("redis")
    assert isinstance(instance, RedisBackend)
    return instance


# -- 1. concurrency: three worker processes, one Redis queue ----------------------------------------


@pytest.mark.slow
@pytest.mark.postgres
@PROCESS_DB
def test_three_worker_processes_drain_3000_jobs_exactly_once(postgres_up, backend):
    """The fetch script pops and leases in one atomic step: three competing processes never
    get the same message, and none is left behind."""
    total = 3000
    prefix = unique("rbulk")
    with processes() as procs:
        env = worker_env()
        workers = [procs.worker("--backend", "redis", env=env, wait_started=False) for _ in range(3)]
        for worker in workers:
            worker.wait_started()
        ids = Jobs.bulk(
            [scripted.using(backend="redis").builder(action="ok", key=f"{prefix}-{i}", db=PG) for i in range(total)],
            backend="redis",
        )
        assert len(set(ids)) == total

        def drained() -> bool:
            for worker in workers:
                assert worker.alive(), f"a worker died mid-drain\n{worker.output()}"
            # size() counts leased messages too: 0 means every run was also acked.
            return runs_with_prefix(prefix).count() >= total and backend.size("default") == 0

        wait_until(drained, 75, f"{total} runs and an empty Redis queue", interval=0.2)
        for worker in workers:
            worker.send(signal.SIGTERM)
        codes = [worker.wait(30) for worker in workers]
        assert codes == [0, 0, 0], "\n".join(w.output() for w in workers)

    runs = runs_with_prefix(prefix)
    assert runs.count() == total, "some job ran more than once"
    assert runs.values("key").distinct().count() == total
    acked = [line.split()[1] for worker in workers for line in worker.job_lines("completed")]
    assert sorted(acked) == sorted(ids), "every job acked exactly once across the three processes"
    assert all(worker.job_lines("completed") for worker in workers), "the work was not shared"
    assert len(set(runs.values_list("pid", flat=True))) > 1
    assert backend.size("default") == 0
    assert backend.stats("default") == zero_stats()


# -- 2. a SIGKILLed worker's lease is recovered by jobs_reap ---------------------------------------


@pytest.mark.slow
@pytest.mark.postgres
@PROCESS_DB
def test_sigkilled_worker_lease_is_recovered_by_jobs_reap(postgres_up, backend, raw):
    env = worker_env(lease_timeout=2)
    k = backend.keys("default")
    key = unique("rcrash")
    job_id = scripted.using(backend="redis", max_retries=1, backoff=NO_BACKOFF).dispatch(
        action="sleep", key=key, db=PG, seconds=3
    )
    with processes() as procs:
        # One job at a time: started as it is claimed, its lost lease is a lost run.
        first = procs.worker("--backend", "redis", "--prefetch", "1", env=env)
        [run] = wait_until(lambda: effects(key), 30, "the first run to start")
        # Supervisor and forked worker die together: nobody settles the job or heartbeats it.
        first.send(signal.SIGKILL, group=True)
        assert first.wait(10) == -signal.SIGKILL
        wait_until(lambda: not pid_alive(run.pid), 10, f"worker process {run.pid} to die")

        # Still leased by the dead worker, no run counted yet.
        assert raw.zscore(k.processing, job_id) is not None
        assert raw.hget(k.owners, job_id) is not None
        assert Envelope.from_bytes(raw.hget(k.bodies, job_id)).attempts == 0

        wait_until(
            lambda: raw.zscore(k.processing, job_id) < time.time() * 1000, 10, "the dead worker's lease to expire"
        )
        code, reap = procs.run("jobs_reap", "--backend", "redis", env=env)
        assert code == 0, reap.output()
        assert reap.out == ["reaped 1 expired lease(s)"], reap.output()

        # The lost run is counted in the stored body, and the message is ready again.
        body = Envelope.from_bytes(raw.hget(k.bodies, job_id))
        assert (body.id, body.attempts) == (job_id, 1)
        assert raw.zscore(k.processing, job_id) is None and raw.hget(k.owners, job_id) is None
        # Due now (no backoff): straight back to the waiting zset.
        assert raw.zscore(k.waiting, job_id) is not None and raw.zscore(k.delayed, job_id) is None
        assert raw.hget(k.errors, job_id).decode().startswith("WorkerLost: lease expired")

        # A fresh worker, started only now, completes it as the second run.
        code, second = procs.run("jobs_work", "--backend", "redis", "--once", env=env, timeout=30)
        assert code == 0, second.output()
        [line] = second.job_lines("completed")
        assert job_id in line and "attempt=2" in line, second.output()

    runs = effects(key)
    assert len(runs) == 2
    assert runs[0].pid != runs[1].pid
    assert backend.stats("default") == zero_stats()
    assert not raw.hexists(k.bodies, job_id), "an acked message is forgotten"


@pytest.mark.django_db
def test_reaped_message_without_backoff_is_ready_not_delayed(backend, raw):
    """Like nack(delay=0), a lost run whose policy gives no delay goes straight back to waiting,
    not into the delayed set: the reaper treats it as the database backend's reaper does."""
    k = backend.keys("default")
    for _ in range(20):
        backend.enqueue(scripted.using(max_retries=3, backoff=NO_BACKOFF).builder(action="ok").build())
    past_ms = (time.time() - 5) * 1000
    for _ in range(20):
        lease = backend.fetch("default")
        assert lease is not None
        # The lease expired 5 s ago, as if its worker had died (same as the conformance hook).
        assert raw.zadd(k.processing, {lease.token: past_ms}, xx=True, ch=True) == 1
    raw.delete(k.notify)

    assert backend.reap_expired("default") == 20
    assert backend.stats("default") == {**zero_stats(), "pending": 20}
    assert raw.llen(k.notify) > 0, "blocked workers must be woken for the requeued messages"


# -- 3. workers survive a Redis restart ------------------------------------------------------------


def private_client(server: Any) -> redis.Redis:
    """A client of a private redis-server that never retries: redis-py 6+ retries a failed command
    up to 10 times with backoff, which would turn SHUTDOWN's dropped connection into seconds."""
    return redis.Redis(host=server.host, port=server.port, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0))


def fsync_every_write(server: Any) -> None:
    """``appendfsync always`` (the private server starts with ``everysec``): every write is fsynced
    before Redis answers, so nothing acknowledged can be lost; a restart resets it."""
    with private_client(server) as client:
        client.config_set("appendfsync", "always")


def shutdown_nosave(server: Any) -> int:
    """``SHUTDOWN NOSAVE`` of a private redis-server (no RDB snapshot; the AOF is flushed) and
    wait for it to exit; returns its exit status."""
    with private_client(server) as client:
        client.shutdown(nosave=True)  # redis-py swallows the dropped connection that follows
    return server.popen.wait(20)


@pytest.mark.slow
@pytest.mark.postgres
@PROCESS_DB
def test_workers_survive_a_redis_restart(postgres_up, private_redis, capsys):
    """SHUTDOWN NOSAVE under two busy workers, restart from the same AOF ~2 s later: the
    workers keep running, log the connection error, and every job still runs.

    A short lease (3 s) lets the workers' own reaping recover a fetch whose reply was lost in
    the outage; max_retries leaves room for such a lost run to be retried rather than failed.
    """
    server = private_redis
    fsync_every_write(server)
    total = 200
    prefix = unique("rrestart")
    with processes() as procs:
        jobs = {
            **settings.JOBS,
            "BACKENDS": {
                **settings.JOBS["BACKENDS"],
                "redis": {"ENGINE": "redis", "OPTIONS": {"URL": server.url, "PREFIX": settings.REDIS_PREFIX}},
            },
        }
        with override_settings(JOBS=jobs):
            backend = get_backend("redis")
            assert backend.options["URL"] == server.url
            builders = [
                scripted.using(backend="redis", max_retries=5, backoff=NO_BACKOFF).builder(
                    action="sleep" if i % 2 else "ok", key=f"{prefix}-{i}", db=PG, seconds=0.05
                )
                for i in range(total)
            ]
            ids = Jobs.bulk(builders, backend="redis")
            assert backend.size("default") == total

            env = server.env(lease_timeout=3)
            workers = [procs.worker("--backend", "redis", env=env, wait_started=False) for _ in range(2)]
            for worker in workers:
                worker.wait_started()
            wait_until(lambda: runs_with_prefix(prefix).count() >= 20, 30, "the workers to be busy")

            outage_start = time.monotonic()
            assert shutdown_nosave(server) == 0, f"redis-server's logs are in {server.directory}"
            ran_before = runs_with_prefix(prefix).values("key").distinct().count()
            assert ran_before < total, "the queue drained before the restart: nothing was tested"
            time.sleep(2)  # the outage itself (not a wait for anything)
            for worker in workers:
                assert worker.alive(), f"a worker exited while Redis was down\n{worker.output()}"
            server.start()
            fsync_every_write(server)
            outage = time.monotonic() - outage_start
            backend.close()  # this process's pool: reconnect to the restarted server

            def all_ran() -> bool:
                for worker in workers:
                    assert worker.alive(), f"a worker exited after the restart\n{worker.output()}"
                done = runs_with_prefix(prefix).values("key").distinct().count() == total
                return done and backend.size("default") == 0

            wait_until(all_ran, 60, f"all {total} jobs to run after the restart", interval=0.2)
            stats = backend.stats("default")
            for worker in workers:
                assert worker.alive(), worker.output()
                assert any("ConnectionError" in line or "Connection refused" in line for line in worker.err), (
                    f"the worker did not log the connection error\n{worker.output()}"
                )
            for worker in workers:
                worker.send(signal.SIGTERM)
            codes = [worker.wait(30) for worker in workers]
            assert codes == [0, 0], "\n".join(w.output() for w in workers)

    assert stats == zero_stats(), stats
    per_key = Counter(runs_with_prefix(prefix).values_list("key", flat=True))
    assert set(per_key) == {f"{prefix}-{i}" for i in range(total)}
    duplicated = {k: n for k, n in per_key.items() if n > 1}
    # Only a job in a worker's hands when Redis went away can run twice: when the outage
    # outlasts the worker's settle retries, its ack never lands, the lease expires, and a
    # worker's reaping hands the job out again. So: at most one per worker, at most twice, and
    # each one re-delivered by a reap the workers logged.
    assert len(duplicated) <= len(workers), duplicated
    assert all(n == 2 for n in duplicated.values()), duplicated
    reaped = sum(
        int(line.split()[1]) for w in workers for line in w.err if line.startswith("reaped ") and "expired" in line
    )
    assert reaped >= len(duplicated), ("a job ran twice without a reaped lease", duplicated, reaped)
    with capsys.disabled():
        print(
            f"\n[redis restart] outage {outage:.1f}s; {ran_before}/{total} jobs had run before SHUTDOWN NOSAVE; "
            f"{reaped} lease(s) reaped after it; {len(duplicated)} job(s) ran twice because of the restart "
            f"(in hand when Redis went away): {sorted(duplicated)}"
        )
    assert len(ids) == total


# -- 4. raw bytes pushed into Redis ----------------------------------------------------------------


def _push_raw(raw: Any, k: QueueKeys, job_id: str, body: bytes | None) -> None:
    """What someone with write access to Redis could do: a waiting member, optionally a body.

    The score follows the backend's own layout (priority 0, next FIFO sequence number), so raw
    members interleave with enqueued ones in fetch order.
    """
    if body is not None:
        raw.hset(k.bodies, job_id, body)
    raw.zadd(k.waiting, {job_id: raw.incr(k.sequence)})


@pytest.mark.django_db
def test_garbage_in_redis_is_rejected_counted_and_kept_while_good_jobs_run(backend, raw):
    default, other = backend.keys("default"), backend.keys("other")
    good_key, bad_key = unique("rgood"), unique("rbad")

    def good() -> str:
        return backend.enqueue(scripted.using(backend="redis").builder(action="ok", key=good_key).build())

    def bad_envelope() -> Envelope:
        # Would record a SideEffect under bad_key if it ever ran.
        return scripted.using(backend="redis").builder(action="ok", key=bad_key).build()

    with override_settings(JOBS={**settings.JOBS, "SIGNING_KEY": "an attacker's key, not the workers'"}):
        forged = bad_envelope()
    replayed = bad_envelope()  # validly signed, for queue "default"

    good_ids = [good()]
    garbage = unique("garbage")
    _push_raw(raw, default, garbage, b"\x00\xff{not json at all")
    good_ids.append(good())
    bodiless = unique("bodiless")
    _push_raw(raw, default, bodiless, None)
    good_ids.append(good())
    _push_raw(raw, default, forged.id, forged.to_bytes())
    good_ids.append(good())
    _push_raw(raw, other, replayed.id, replayed.to_bytes())  # replay onto another queue's keys
    good_ids.append(good())

    worker = QueueWorker("redis", ["default", "other"])
    results = {}
    for _ in range(20):
        result = worker.process_once()
        if result.status == "empty":
            break
        results[result.job_id] = result
    else:
        raise AssertionError(f"queues not empty after 20 deliveries: {results}")

    assert set(results) == {*good_ids, garbage, bodiless, forged.id, replayed.id}
    for job_id in good_ids:
        assert results[job_id].status == "acked", results[job_id]
    assert len(effects(good_key, "default")) == len(good_ids)
    assert effects(bad_key, "default") == [], "a rejected message ran"

    expected = {
        garbage: (default, "InvalidPayload"),
        bodiless: (default, "InvalidPayload"),
        forged.id: (default, "BadSignature"),
        replayed.id: (other, "BadSignature"),
    }
    for job_id, (k, exc_name) in expected.items():
        assert results[job_id].status == "rejected", results[job_id]
        assert raw.zscore(k.failed, job_id) is not None, f"{job_id} not kept in the failed set"
        error = raw.hget(k.errors, job_id).decode()
        assert error.startswith(f"rejected: {exc_name}"), error
        assert raw.zscore(k.waiting, job_id) is None and raw.zscore(k.processing, job_id) is None
    assert raw.hget(default.bodies, garbage) == b"\x00\xff{not json at all", "kept as received, for audit"
    assert "no body" in raw.hget(default.errors, bodiless).decode()
    assert "signed for queue 'default', delivered on 'other'" in raw.hget(other.errors, replayed.id).decode()
    # The two that decode also show in the admin as failed, and a rejection is not a run. Neither
    # verifies where it was delivered, so each is kept under a new id of its own, quoting the id
    # it claimed: it can never write the row of the job it names.
    for env in (forged, replayed):
        assert not Job.objects.filter(pk=env.id).exists()
        row = Job.objects.get(last_error__contains=repr(env.id), backend="redis")
        assert (row.status, row.attempts) == (JobStatus.FAILED, 0)
        assert row.last_error.startswith("rejected: BadSignature"), row.last_error

    metrics = get_collector()
    assert metrics.get("jobs_rejected_payload", queue="default") == 2
    assert metrics.get("jobs_rejected_signature", queue="default") == 1
    assert metrics.get("jobs_rejected_signature", queue="other") == 1
    assert metrics.get("jobs_succeeded", queue="default") == len(good_ids)
    assert backend.stats("default") == {**zero_stats(), "failed": 3}
    assert backend.stats("other") == {**zero_stats(), "failed": 1}


# -- 5. the failed set, its Job row and the admin's retry ------------------------------------------


@pytest.mark.django_db
def test_abandon_records_a_failed_job_row_and_admin_retry_redispatches_to_redis(backend, raw):
    k = backend.keys("default")
    key = unique("rflaky")
    # Fails its first run (no retries left: dead-lettered), succeeds when run again.
    # enqueue(), not dispatch(): the test's own transaction would defer dispatch() to a commit
    # that never comes.
    job_id = backend.enqueue(scripted.using(max_retries=0).builder(action="flaky", key=key, fail_times=1).build())
    worker = QueueWorker("redis", ["default"])

    first = worker.process_once()
    assert (first.status, first.job_id) == ("dead-lettered", job_id)
    assert raw.zscore(k.failed, job_id) is not None
    assert raw.hget(k.errors, job_id).decode().startswith("RuntimeError: flaky failure")
    row = Job.objects.get(pk=job_id)
    assert (row.status, row.backend, row.queue, row.attempts) == (JobStatus.FAILED, "redis", "default", 1)
    assert row.handler == "tests.testapp.jobs.scripted"
    assert row.payload == {"args": [], "kwargs": {"action": "flaky", "key": key, "fail_times": 1}}
    assert row.last_error.startswith("RuntimeError: flaky failure"), row.last_error

    outcome = retry_jobs(Job.objects.filter(pk=job_id))
    assert (outcome.retried, outcome.errors) == (1, [])
    assert raw.zscore(k.failed, job_id) is None and raw.hget(k.errors, job_id) is None
    assert raw.zscore(k.waiting, job_id) is not None
    assert Envelope.from_bytes(raw.hget(k.bodies, job_id)).attempts == 0, "a fresh start"
    assert not Job.objects.filter(pk=job_id).exists(), "the audit copy goes; a new failure re-records it"

    again = worker.process_once()
    assert (again.status, again.job_id) == ("acked", job_id)
    assert len(effects(key, "default")) == 2
    assert backend.stats("default") == zero_stats()


# -- 5b. a failed row left unwritten is written by the reaper ----------------------------------------


@contextmanager
def database_gone(alias: str = "default"):
    """The ``alias`` database unreachable for real: its connection closed and its settings
    pointed at a file that cannot be opened, so the next query's connect fails."""
    connection = connections[alias]
    name = connection.settings_dict["NAME"]
    connection.close()
    connection.settings_dict["NAME"] = "/nonexistent-dir/gone.sqlite3"
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict["NAME"] = name


def _fail_for_good(backend: RedisBackend, action: str = "raise") -> str:
    job_id = backend.enqueue(scripted.using(max_retries=0).builder(action=action).build())
    outcome = QueueWorker("redis", ["default"]).process_once()
    assert (outcome.status, outcome.job_id) == ("dead-lettered", job_id)
    return job_id


def _age_unrecorded(raw: Any, k: QueueKeys, seconds: float = 120) -> None:
    """Every id of ``unrecorded`` failed ``seconds`` ago: past the reaper's grace."""
    for member, _ in raw.zrange(k.unrecorded, 0, -1, withscores=True):
        raw.zadd(k.unrecorded, {member: (time.time() - seconds) * 1000}, xx=True)


@pytest.mark.django_db(transaction=True)
def test_a_failed_row_the_database_refused_is_written_by_a_later_reaper_pass(backend, raw, caplog):
    """The database down when a job fails for good: the job is in the failed set, and its
    row is written by the first reaper pass a minute after the failure, from what Redis kept."""
    k = backend.keys("default")
    with database_gone():
        job_id = _fail_for_good(backend)
    assert raw.zscore(k.failed, job_id) is not None
    assert not Job.objects.filter(pk=job_id).exists(), "the database was down: no row yet"
    assert raw.zscore(k.unrecorded, job_id) is not None

    reaper = Reaper(backend)
    reaper.reap_once()
    assert not Job.objects.filter(pk=job_id).exists(), "within the grace the worker may still write it"

    _age_unrecorded(raw, k)
    before = reaper.metrics.get("jobs_failures_recorded_late")
    with caplog.at_level(logging.WARNING, logger="django_jobs.reaper"):
        reaper.reap_once()
    row = Job.objects.get(pk=job_id)
    assert (row.status, row.backend, row.queue, row.attempts) == (JobStatus.FAILED, "redis", "default", 1)
    assert row.last_error.startswith("RuntimeError: scripted failure"), row.last_error
    assert row.handler == "tests.testapp.jobs.scripted"
    assert raw.zscore(k.unrecorded, job_id) is None
    assert reaper.metrics.get("jobs_failures_recorded_late") == before + 1
    assert "recorded 1 failed job(s) whose row had not been written" in caplog.text

    # Its admin retry works as for a row written at once.
    assert retry_jobs(Job.objects.filter(pk=job_id)).retried == 1
    assert raw.zscore(k.waiting, job_id) is not None and raw.zscore(k.failed, job_id) is None
    assert reaper.reap_once() == 0 and not Job.objects.filter(pk=job_id).exists()


@pytest.mark.django_db(transaction=True)
def test_a_row_written_at_once_leaves_nothing_for_the_reaper(backend, raw):
    k = backend.keys("default")
    job_id = _fail_for_good(backend)
    assert Job.objects.get(pk=job_id).status == JobStatus.FAILED
    assert raw.zcard(k.unrecorded) == 0
    assert backend.record_missed_failures() == 0


@pytest.mark.django_db(transaction=True)
def test_the_sweep_skips_jobs_retried_purged_or_undecodable_and_stops_while_the_database_is_down(backend, raw):
    k = backend.keys("default")
    with database_gone():
        retried, purged, garbled, kept, other = (_fail_for_good(backend) for _ in range(5))
    assert raw.zcard(k.unrecorded) == 5
    backend.redispatch(Envelope.from_bytes(raw.hget(k.bodies, retried)))  # what the admin's retry sends
    raw.hset(k.bodies, garbled, b"\xff not json")
    raw.zrem(k.failed, purged)  # as if purged by hand, its unrecorded entry left behind
    _age_unrecorded(raw, k)

    with database_gone():
        assert backend.record_missed_failures() == 0
    # Those needing no row are gone; the first that needed one stopped the pass.
    left = {m.decode() for m in raw.zrange(k.unrecorded, 0, -1)}
    assert {kept, other} >= left and left, left

    assert backend.record_missed_failures() == 2
    assert raw.zcard(k.unrecorded) == 0
    assert set(Job.objects.values_list("pk", flat=True)) == {kept, other}
    assert raw.zscore(k.failed, garbled) is not None, "an undecodable message stays failed, for audit"


@contextmanager
def database_locked(monkeypatch: pytest.MonkeyPatch):
    """Every write to the ``default`` SQLite database by a connection opened in the block waits
    (up to its 30 s busy timeout) until the block ends: another connection holds the write lock.
    (Those connections take the lock at ``BEGIN``, as the workers of these tests do: a
    transaction that read first would be refused at once instead of waiting.)"""
    monkeypatch.setitem(connections["default"].settings_dict["OPTIONS"], "transaction_mode", "IMMEDIATE")
    lock = sqlite3.connect(connections["default"].settings_dict["NAME"], timeout=0, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        lock.execute("ROLLBACK")
        lock.close()


def in_thread(target: Any) -> tuple[threading.Thread, list[Any]]:
    """``target()`` started in a thread of its own (which closes its connections); its result
    lands in the list."""
    results: list[Any] = []

    def run() -> None:
        try:
            results.append(target())
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, results


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("meanwhile", ["retried", "purged"])
def test_a_failed_row_whose_write_outlasted_a_retry_or_purge_is_deleted_again(backend, raw, meanwhile, monkeypatch):
    """The worker's row write waits (the database is slow); meanwhile the job leaves the failed
    set (the admin's retry re-dispatches it; a purge forgets it). The row that lands then would
    show as failed a job that is not: it is deleted again."""
    k = backend.keys("default")
    job_id = backend.enqueue(scripted.using(max_retries=0).builder(action="raise").build())
    with database_locked(monkeypatch):
        worker, outcome = in_thread(QueueWorker("redis", ["default"]).process_once)
        wait_until(lambda: raw.zscore(k.failed, job_id) is not None, 10, "the job in the failed set")
        if meanwhile == "retried":
            backend.redispatch(Envelope.from_bytes(raw.hget(k.bodies, job_id)))
        else:
            assert backend.purge_failed("default") == 1
    worker.join(60)
    assert [(o.status, o.job_id) for o in outcome] == [("dead-lettered", job_id)]
    assert not Job.objects.filter(pk=job_id).exists()
    assert raw.zcard(k.unrecorded) == 0
    assert (raw.zscore(k.waiting, job_id) is not None) == (meanwhile == "retried")


@pytest.mark.django_db(transaction=True)
def test_a_late_row_whose_write_outlasted_a_purge_is_deleted_again(backend, raw, monkeypatch):
    """The same for the reaper's sweep: it read the failed set before a purge and wrote after."""
    k = backend.keys("default")
    with database_gone():
        job_id = _fail_for_good(backend)
    _age_unrecorded(raw, k)
    with database_locked(monkeypatch):
        sweep, created = in_thread(backend.record_missed_failures)
        time.sleep(0.5)  # the sweep has read the failed set and waits to write
        assert backend.purge_failed("default") == 1
    sweep.join(60)
    assert created == [0]  # it wrote one, deleted again at once
    assert not Job.objects.filter(pk=job_id).exists()


@pytest.mark.django_db(transaction=True)
def test_one_pass_writes_every_missing_row_not_only_a_batch(backend, raw, monkeypatch):
    monkeypatch.setattr("django_jobs.backends.redis.REAP_BATCH", 2)
    k = backend.keys("default")
    with database_gone():
        ids = {_fail_for_good(backend) for _ in range(5)}
    _age_unrecorded(raw, k)
    assert backend.record_missed_failures() == 5
    assert set(Job.objects.values_list("pk", flat=True)) == ids
    assert raw.zcard(k.unrecorded) == 0


@pytest.mark.django_db(transaction=True)
def test_a_row_its_worker_wrote_before_dying_is_not_counted_as_late(backend, raw):
    """The worker wrote the row and died before taking the id out: the sweep writes it again
    (the same row) and counts nothing."""
    k = backend.keys("default")
    job_id = _fail_for_good(backend)
    raw.zadd(k.unrecorded, {job_id: (time.time() - 120) * 1000})
    assert backend.record_missed_failures() == 0
    assert raw.zcard(k.unrecorded) == 0
    assert Job.objects.get(pk=job_id).status == JobStatus.FAILED


@pytest.mark.django_db
def test_purge_failed_forgets_unrecorded_ids_too(backend, raw):
    k = backend.keys("default")
    backend.enqueue(scripted.using(backend="redis").builder(action="ok").build())
    lease = backend.fetch("default")
    assert lease is not None
    backend._fail(lease, "test: failed, its row never written", True)
    assert raw.zcard(k.unrecorded) == 1
    assert backend.purge_failed("default") == 1
    assert raw.zcard(k.unrecorded) == 0


@pytest.mark.slow
@pytest.mark.postgres
@PROCESS_DB
def test_worker_killed_between_the_failed_set_and_its_row_gets_the_row_from_jobs_reap(postgres_up, backend, raw):
    """The worker's row write waits on a lock the test holds (its SQLite database), the job
    already in the failed set; the worker is SIGKILLed there. ``jobs_reap`` writes the row."""
    k = backend.keys("default")
    key = unique("runrecorded")
    path = connections["default"].settings_dict["NAME"]
    lock = sqlite3.connect(path, timeout=0, isolation_level=None)
    with processes() as procs:
        worker = procs.worker("--backend", "redis", "--prefetch", "1", env=worker_env())
        lock.execute("BEGIN IMMEDIATE")  # every write to the worker's SQLite database waits now
        try:
            job_id = scripted.using(backend="redis", max_retries=0).dispatch(action="raise", key=key, db=PG)
            wait_until(lambda: raw.zscore(k.failed, job_id) is not None, 30, "the job in the failed set")
            time.sleep(0.3)  # the row's write has begun waiting on the lock
            worker.send(signal.SIGKILL, group=True)
            assert worker.wait(10) == -signal.SIGKILL
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        assert len(effects(key)) == 1
        assert not Job.objects.filter(pk=job_id).exists(), worker.output()
        assert raw.zscore(k.unrecorded, job_id) is not None

        _age_unrecorded(raw, k)
        code, reap = procs.run("jobs_reap", "--backend", "redis", env=worker_env())
        assert code == 0, reap.output()
    row = Job.objects.get(pk=job_id)
    assert (row.status, row.backend, row.attempts) == (JobStatus.FAILED, "redis", 1)
    assert row.last_error.startswith("RuntimeError: scripted failure"), row.last_error
    assert raw.zcard(k.unrecorded) == 0
    assert backend.stats("default") == {**zero_stats(), "failed": 1}


# -- 6. dispatch inside a transaction: pushed on commit only ---------------------------------------


def _dispatch_in_atomic(using: str, backend: RedisBackend, raw: Any, *, commit: bool) -> str:
    k = backend.keys("default")
    seen_inside = []

    class Rollback(Exception):
        pass

    job_id = ""
    try:
        with transaction.atomic(using=using):
            job_id = scripted.using(backend="redis").dispatch(action="ok", key=unique("ratomic"))
            seen_inside = [raw.hexists(k.bodies, job_id), backend.size("default")]
            if not commit:
                raise Rollback
    except Rollback:
        pass
    assert seen_inside == [False, 0], "a worker could see the job before the transaction committed"
    return job_id


@pytest.mark.parametrize("using", ["default", PG])
@pytest.mark.django_db(databases=["default", PG], transaction=True)
def test_dispatch_in_atomic_reaches_redis_only_on_commit(request, using, backend, raw):
    if using == PG:
        request.getfixturevalue("postgres_up")
    k = backend.keys("default")
    job_id = _dispatch_in_atomic(using, backend, raw, commit=True)
    assert raw.zscore(k.waiting, job_id) is not None
    assert backend.size("default") == 1

    lease = backend.fetch("default")
    assert lease is not None and lease.envelope is not None and lease.envelope.id == job_id


@pytest.mark.parametrize("using", ["default", PG])
@pytest.mark.django_db(databases=["default", PG], transaction=True)
def test_dispatch_in_rolled_back_atomic_never_reaches_redis(request, using, backend, raw):
    if using == PG:
        request.getfixturevalue("postgres_up")
    job_id = _dispatch_in_atomic(using, backend, raw, commit=False)
    assert not raw.hexists(backend.keys("default").bodies, job_id)
    assert backend.stats("default") == zero_stats()
    assert list(raw.scan_iter(match=f"{settings.REDIS_PREFIX}:*")) == [], "nothing at all was written"


# -- 7. OPTIONS["CACHE"]: reuse a django-redis cache's connection ----------------------------------


CACHE_ALIAS = "jobs-redis"


@pytest.fixture
def redis_cache_settings(raw):
    """A django-redis cache on the test server, used as the backend's connection and as the
    idempotency cache. Its KEY_PREFIX sits under this session's prefix (cleared per test)."""
    caches = {
        **settings.CACHES,
        CACHE_ALIAS: {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": settings.REDIS_URL,
            "KEY_PREFIX": f"{settings.REDIS_PREFIX}:cache",
        },
    }
    jobs = {
        **settings.JOBS,
        "BACKENDS": {
            **settings.JOBS["BACKENDS"],
            "redis-cache": {"ENGINE": "redis", "OPTIONS": {"CACHE": CACHE_ALIAS, "PREFIX": settings.REDIS_PREFIX}},
        },
        "IDEMPOTENCY_CACHE": CACHE_ALIAS,
    }
    with override_settings(CACHES=caches, JOBS=jobs):
        yield


@pytest.mark.django_db
def test_cache_option_uses_the_django_redis_connection(redis_cache_settings, raw):
    from django_redis import get_redis_connection

    backend = get_backend("redis-cache")
    assert backend.client is get_redis_connection(CACHE_ALIAS)

    key = unique("rcache")
    job_id = backend.enqueue(scripted.using().builder(action="ok", key=key).build())  # dispatch() would wait for commit
    # Written through the cache's connection to the same server the raw client reads.
    assert raw.zscore(backend.keys("default").waiting, job_id) is not None
    result = QueueWorker("redis-cache", ["default"]).process_once()
    assert (result.status, result.job_id) == ("acked", job_id)
    assert len(effects(key, "default")) == 1
    assert backend.stats("default") == zero_stats()


@pytest.mark.django_db
def test_idempotency_on_a_django_redis_cache_skips_a_second_delivery(redis_cache_settings, raw):
    run_key, idem = unique("ridem"), unique("idem-key")
    backend = get_backend("redis-cache")
    first, second = (
        backend.enqueue(scripted.using(idempotency_key=idem).builder(action="ok", key=run_key).build())
        for _ in range(2)
    )
    worker = QueueWorker("redis-cache", ["default"])

    assert [worker.process_once().status for _ in range(2)] == ["acked", "skipped-idempotent"]
    assert len(effects(run_key, "default")) == 1, "the key that succeeded must not run again"
    assert get_collector().get("jobs_skipped_idempotent", queue="default") == 1
    # The marker really lives in Redis (not in a local-memory cache).
    assert list(raw.scan_iter(match=f"{settings.REDIS_PREFIX}:cache:*{idem}")), "no idempotency key in Redis"
    assert first != second


@pytest.mark.django_db
def test_idempotency_claim_on_django_redis_is_atomic(redis_cache_settings):
    """Two deliveries claim one key at the same moment: ``cache.add`` (SET NX) lets one run."""
    key = unique("claim")
    barrier = threading.Barrier(2)
    claims: list[Claim] = []

    def claim(owner: str) -> None:
        guard = IdempotencyGuard()
        barrier.wait(5)
        claims.append(guard.claim(key, owner, 30))

    threads = [threading.Thread(target=claim, args=(f"owner-{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(c.value for c in claims) == ["busy", "run"], claims
    from django_redis.cache import RedisCache

    assert isinstance(IdempotencyGuard().cache, RedisCache)


# -- 8. the redis extra missing ---------------------------------------------------------------------


def test_import_without_the_redis_package_names_the_extra(monkeypatch):
    # monkeypatch restores both entries (and so the real module objects) after the test.
    monkeypatch.setitem(sys.modules, "redis", None)  # `import redis` now raises ImportError
    monkeypatch.delitem(sys.modules, "django_jobs.backends.redis")
    with pytest.raises(ImproperlyConfigured) as excinfo:
        importlib.import_module("django_jobs.backends.redis")
    assert "pip install 'django-reliable-jobs[redis]'" in str(excinfo.value)


# -- 9. the blocking wait ---------------------------------------------------------------------------


def test_wait_for_work_wakes_when_a_job_is_enqueued(raw):
    # Its own connection name, so the test can see this backend's BLPOP in CLIENT LIST.
    name = unique("djt-wait")
    backend = RedisBackend(
        "redis", {"URL": f"{settings.REDIS_URL}?client_name={name}", "PREFIX": settings.REDIS_PREFIX}
    )
    try:
        k = backend.keys("default")
        assert raw.llen(k.notify) == 0
        finished = []
        waiter = threading.Thread(target=lambda: finished.append(backend.wait_for_work(["default"], 5)), daemon=True)
        waiter.start()
        wait_until(
            lambda: any(c.get("name") == name and c.get("cmd") == "blpop" for c in raw.client_list()),
            3,
            "the waiter to block in BLPOP",
        )
        assert waiter.is_alive()
        get_backend("redis").enqueue(scripted.using(backend="redis").builder(action="ok").build())
        waiter.join(timeout=3)  # well under wait_for_work's own 5 s timeout
        assert not waiter.is_alive(), "wait_for_work did not wake on the enqueue"
        assert finished == [True]
    finally:
        backend.close()


def test_delayed_job_is_fetched_after_waiting_with_nothing_pushed(raw):
    backend = RedisBackend("redis", {"URL": settings.REDIS_URL, "PREFIX": settings.REDIS_PREFIX})
    try:
        k = backend.keys("default")
        job_id = backend.enqueue(scripted.using(backend="redis", delay=0.3).builder(action="ok").build())
        assert raw.zscore(k.delayed, job_id) is not None
        assert backend.fetch("default") is None, "not due yet"
        assert raw.llen(k.notify) == 0, "a delayed enqueue wakes nobody"
        fetched = []

        def poll() -> None:
            # A worker's idle loop: fetch, and block on the backend when there is nothing.
            while not fetched:
                lease = backend.fetch("default")
                if lease is not None:
                    fetched.append(lease)
                    return
                backend.wait_for_work(["default"], 5)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        # Below the 5 s timeout: the wait must end at the job's due time, with no push to wake it.
        poller.join(timeout=4)
        assert not poller.is_alive(), "the delayed job was not fetched before wait_for_work's timeout"
        [lease] = fetched
        assert lease.envelope is not None and lease.envelope.id == job_id
        assert raw.zscore(k.processing, job_id) is not None, "promoted from delayed and leased"
    finally:
        backend.close()


# -- 10. stats and size ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_stats_and_size_count_waiting_delayed_in_progress_and_failed(backend):
    def env(**options: Any) -> Envelope:
        return scripted.using(backend="redis", **options).builder(action="ok").build()

    for _ in range(4):
        backend.enqueue(env())
    backend.enqueue(env(delay=600))
    backend.enqueue(env(delay=900))
    held = backend.fetch("default")
    dropped = backend.fetch("default")
    assert held is not None and dropped is not None
    backend.abandon(dropped, "test: failed for good")

    expected = {"pending": 2, "delayed": 2, "in_progress": 1, "failed": 1, "waiting": 0}
    assert backend.stats("default") == expected
    assert backend.size("default") == 5, "waiting + delayed + leased; failed is settled"
    assert backend.stats("other") == zero_stats()

    out = io.StringIO()
    call_command("jobs_stats", "--json", "--backend", "redis", stdout=out)
    rows = {row["queue"]: row for row in json.loads(out.getvalue())}
    assert {c: rows["default"][c] for c in expected} == expected
    assert {c: rows["other"][c] for c in expected} == zero_stats()

    backend.ack(held)
    assert backend.stats("default") == {**expected, "in_progress": 0}


# -- 11. the failed set purged ----------------------------------------------------------------------


@pytest.mark.django_db
def test_purge_failed_forgets_failed_messages_and_keeps_younger_ones(backend, raw):
    k = backend.keys("default")
    ids = [backend.enqueue(scripted.using(backend="redis").builder(action="ok").build()) for _ in range(3)]
    for _ in ids[:2]:
        lease = backend.fetch("default")
        assert lease is not None
        backend.abandon(lease, "test: failed for good")
    failed = {i.decode() for i in raw.zrange(k.failed, 0, -1)}
    assert len(failed) == 2 and failed < set(ids)
    # Failed one hour ago: old enough for a one-minute cut-off, unlike the other one.
    old = min(failed)
    raw.zadd(k.failed, {old: (time.time() - 3600) * 1000}, xx=True)

    assert backend.purge_failed("default", older_than=timedelta(minutes=1)) == 1
    assert not raw.hexists(k.bodies, old) and not raw.hexists(k.errors, old) and not raw.hexists(k.priorities, old)
    assert raw.zscore(k.failed, old) is None
    assert backend.stats("default") == {**zero_stats(), "pending": 1, "failed": 1}

    assert backend.purge_failed("default") == 1
    assert backend.stats("default") == {**zero_stats(), "pending": 1}
    waiting = ({*ids} - failed).pop()
    assert raw.hexists(k.bodies, waiting), "a waiting message is not a failed one"


# -- 12. the scripts' keys and arguments ------------------------------------------------------------

LUA = importlib.resources.files("django_jobs.backends") / "lua"
HEADER_KEY = re.compile(r"^local (\w+)_key = KEYS\[(\d+)\]")
HEADER_ARG = re.compile(r"^local \w+ = (?:tonumber\()?ARGV\[(\d+)\]\)?(?:\s|$)")


def test_common_lua_names_the_keys_in_queue_keys_order():
    """Python passes ``QueueKeys`` as KEYS in field order; common.lua must name them the same."""
    named = [m.groups() for line in (LUA / "common.lua").read_text().splitlines() if (m := HEADER_KEY.match(line))]
    assert [name for name, _ in named] == list(QueueKeys._fields)
    assert [int(index) for _, index in named] == list(range(1, len(QueueKeys._fields) + 1))
    keys = RedisBackend("r", {"PREFIX": "p"}).keys("q")
    assert list(keys) == [f"p:{{q}}:{kind}" for kind in QueueKeys._fields]
    assert (keys.waiting, keys.failed) == ("p:{q}:waiting", "p:{q}:failed")


def test_limit_common_lua_names_the_keys_in_limit_keys_order():
    """A limit's scripts get ``LimitKeys`` as KEYS in field order; limit_common.lua names them so."""
    text = (LUA / "limit_common.lua").read_text()
    named = [m.groups() for line in text.splitlines() if (m := HEADER_KEY.match(line))]
    assert [name for name, _ in named] == list(LimitKeys._fields)
    assert [int(index) for _, index in named] == list(range(1, len(LimitKeys._fields) + 1))


# The preludes, and the keys whose names they give every script of their kind.
PRELUDES = {"common.lua": QueueKeys._fields, "limit_common.lua": LimitKeys._fields}


@pytest.mark.parametrize("script", sorted(path.name for path in LUA.iterdir() if path.name.endswith(".lua")))
def test_every_script_names_its_arguments_once_in_its_header(script):
    """KEYS are read only in the headers of the preludes (common.lua, limit_common.lua), and
    each ARGV once, in order, in the script's own header: the body uses names, never positions."""
    lines = (LUA / script).read_text().splitlines()
    positional = [line for line in lines if "KEYS[" in line]
    assert len(positional) == len(PRELUDES.get(script, ()))
    args = [line for line in lines if "ARGV[" in line]
    assert all(HEADER_ARG.match(line) for line in args), args
    assert [int(HEADER_ARG.match(line).group(1)) for line in args] == list(range(1, len(args) + 1))


# -- 13. capability flags ---------------------------------------------------------------------------


def test_capability_flags_are_the_documented_ones():
    # native_dead_letter is False: failures stay in the `failed` set the scripts maintain, not in a
    # broker mechanism (test_purge_failed_... and the abandon tests above cover that set).
    flags = (
        "supports_delay",
        "supports_priority",
        "native_lease",
        "native_dead_letter",
        "pipelines_ack_fetch",
        "supports_retry",
        "persistent",
        "transactional",
        "audit_failures",
    )
    assert {flag: getattr(RedisBackend, flag) for flag in flags} == {
        "supports_delay": True,
        "supports_priority": True,
        "native_lease": False,
        "native_dead_letter": False,
        "pipelines_ack_fetch": True,
        "supports_retry": True,
        "persistent": True,
        "transactional": False,
        "audit_failures": True,
    }
