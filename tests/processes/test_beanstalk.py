"""beanstalkd-specific behaviour of the beanstalk backend, against a real beanstalkd.

The protocol itself (fetch, ack, nack, abandon, priority, concurrency) is covered for beanstalk
by tests/integration/test_conformance.py. This file covers what only beanstalkd has: leases that are
reservations (TTR, ``touch``, release when a connection dies), the ``reserves`` count turned
into lost runs, ``bury`` as the dead letter, a beanstalkd ``kill -9`` + binlog restart under
running workers, raw bytes ``put`` straight into a tube, the priority/delay mapping, the
``stats-tube`` figures, ``jobs_purge`` of buried jobs and the missing extra.

What beanstalkd holds is always read back with a separate raw connection
(tests/beanstalk_support.py), never through the backend under test. Tubes are named
``<session prefix>.<queue>`` (``backend.tube_name``); the ``beanstalk_up`` fixture empties
this session's tubes before each test. Process tests drive ``manage.py jobs_work`` through
tests/procs.py and count runs by their ``SideEffect`` rows in PostgreSQL.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import importlib
import io
import json
import signal
import sys
import time
import uuid
from collections import Counter
from dataclasses import replace
from datetime import timedelta
from typing import Any

import greenstalk
import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone

from django_jobs import Jobs, signing
from django_jobs.backends import get_backend
from django_jobs.backends.beanstalk import PRIORITY_ZERO, BeanstalkBackend
from django_jobs.envelope import Envelope
from django_jobs.exceptions import LeaseLost
from django_jobs.metrics import get_collector
from django_jobs.models import Job, JobStatus
from django_jobs.worker import QueueWorker
from tests.beanstalk_support import count_writes, job_state, raw_tube, tube_counts
from tests.procs import pid_alive, processes, wait_until, worker_env
from tests.testapp.jobs import scripted
from tests.testapp.models import SideEffect

PG = "postgres"
NO_BACKOFF = {"strategy": "none"}
ZERO = {"pending": 0, "delayed": 0, "in_progress": 0, "failed": 0}
WORKER = ("--backend", "beanstalk")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def effects(key: str, db: str = PG) -> list[SideEffect]:
    return list(SideEffect.objects.using(db).filter(key=key).order_by("id"))


def jobs_with(**overrides: Any) -> dict[str, Any]:
    """settings.JOBS with some keys changed (override_settings replaces the whole dict)."""
    return {**settings.JOBS, **overrides}


def dispatch(action: str, *, key: str, lease_timeout: float | None = None, **options: Any) -> str:
    """One scripted job on the beanstalk backend that records its runs in PostgreSQL.

    The TTR is fixed by ``put``, from the *dispatching* process's LEASE_TIMEOUT: it is set to
    the workers' value here so the job's TTR and the workers' heartbeat agree.
    """
    kwargs: dict[str, Any] = {"action": action, "key": key, "db": PG}
    for name in ("seconds", "fail_times"):
        if name in options:
            kwargs[name] = options.pop(name)
    jobs = jobs_with(LEASE_TIMEOUT=lease_timeout) if lease_timeout else settings.JOBS
    with override_settings(JOBS=jobs):
        try:
            return scripted.using(backend="beanstalk", backoff=NO_BACKOFF, **options).dispatch(**kwargs)
        finally:
            get_backend("beanstalk").close()  # the instance built under the override


def envelope(**options: Any) -> Envelope:
    """A signed envelope for the beanstalk backend, recording runs under ``key`` in ``default``."""
    kwargs = {k: options.pop(k) for k in ("action", "key", "seconds") if k in options}
    return scripted.using(backend="beanstalk", **options).builder(**{"action": "ok", **kwargs}).build()


@pytest.fixture
def backend(beanstalk_up) -> BeanstalkBackend:
    """The ``beanstalk`` backend of tests/settings.py (this session's tube prefix), tubes emptied."""
    instance = get_backend("beanstalk")
    assert isinstance(instance, BeanstalkBackend)
    return instance


class RawTubes:
    """One raw greenstalk connection per queue's tube, to read beanstalkd's own view."""

    def __init__(self, address: tuple[str, int], backend: BeanstalkBackend) -> None:
        self.address = address
        self.backend = backend
        self.clients: dict[str, greenstalk.Client] = {}

    def __getitem__(self, queue: str) -> greenstalk.Client:
        if queue not in self.clients:
            tube = self.backend.tube_name(queue)
            self.clients[queue] = greenstalk.Client(self.address, encoding=None, use=tube, watch=tube)
        return self.clients[queue]

    def counts(self, queue: str) -> dict[str, int]:
        return tube_counts(self[queue], self.backend.tube_name(queue))

    def job(self, queue: str, job_id: int) -> dict[str, Any]:
        return job_state(self[queue], job_id)

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


@pytest.fixture
def raw(beanstalk_up, backend):
    tubes = RawTubes(beanstalk_up, backend)
    yield tubes
    tubes.close()


def only_ready_job(raw: RawTubes, queue: str = "default") -> int:
    """The beanstalk id of the single job waiting in ``queue``'s tube."""
    assert raw.counts(queue) == {**ZERO, "pending": 1}, raw.counts(queue)
    return raw[queue].peek_ready().id


def run_once(procs: Any, env: dict[str, str]) -> Any:
    """``jobs_work --backend beanstalk --once`` to completion; returns its Proc."""
    code, proc = procs.run("jobs_work", *WORKER, "--once", env=env, timeout=30)
    assert code == 0, proc.output()
    return proc


# -- 1. a dead or stalled worker's reservation comes back by itself ---------------------------------

# Process tests: worker processes record runs in PostgreSQL and failed audit rows in the SQLite
# test file, so both databases are used with transaction=True (committed, visible to them).


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.django_db(databases=["default", PG], transaction=True)
@pytest.mark.usefixtures("postgres_up", "beanstalk_up")
def test_sigkilled_worker_job_returns_to_the_tube_and_a_fresh_worker_completes_it(raw):
    """SIGKILL mid-job (supervisor and forked worker at once): no jobs_reap anywhere, beanstalkd
    itself puts the reservation back; its ``reserves`` count makes the next delivery attempt 2."""
    env = worker_env(lease_timeout=2)
    key = unique("bcrash")
    job_id = dispatch("sleep", key=key, seconds=3, max_retries=1, lease_timeout=2)
    bs_id = only_ready_job(raw)
    assert raw.job("default", bs_id)["ttr"] == 2, "TTR = ceil(LEASE_TIMEOUT)"
    with processes() as procs:
        first = procs.worker(*WORKER, env=env)
        [run] = wait_until(lambda: effects(key), 30, "the first run to start")
        first.send(signal.SIGKILL, group=True)
        assert first.wait(10) == -signal.SIGKILL
        wait_until(lambda: not pid_alive(run.pid), 10, f"worker process {run.pid} to die")

        # Back in the tube by itself. The dead connection released it (``timeouts`` stays 0:
        # beanstalkd did not even need the TTR); the reservation still counts in ``reserves``.
        state = wait_until(
            lambda: (s := raw.job("default", bs_id))["state"] == "ready" and s, 10, "the job to be ready again"
        )
        assert (state["reserves"], state["timeouts"]) == (1, 0), state
        assert raw.counts("default") == {**ZERO, "pending": 1}

        second = run_once(procs, env)
        # attempt=2: the lost run counted.
        [line] = second.job_lines("completed")
        assert job_id in line and "attempt=2" in line, second.output()

    runs = effects(key)
    assert len(runs) == 2
    assert runs[0].pid != runs[1].pid
    assert raw.job("default", bs_id) == {"state": "gone"}, "an acked job is deleted"
    assert raw.counts("default") == ZERO
    assert not Job.objects.filter(pk=job_id).exists(), "no failure, no audit row"


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.django_db(databases=["default", PG], transaction=True)
@pytest.mark.usefixtures("postgres_up", "beanstalk_up")
def test_sigkilled_run_spends_the_budget_of_a_job_without_retries(raw):
    """max_retries=0 and one lost run: the next fetch sees attempts 1 and fails the job (buried +
    failed audit row, as the reaper does for the other backends) WITHOUT running it again."""
    env = worker_env(lease_timeout=2)
    key = unique("bspent")
    job_id = dispatch("sleep", key=key, seconds=3, max_retries=0, lease_timeout=2)
    bs_id = only_ready_job(raw)
    with processes() as procs:
        first = procs.worker(*WORKER, env=env)
        wait_until(lambda: effects(key), 30, "the first run to start")
        first.send(signal.SIGKILL, group=True)
        assert first.wait(10) == -signal.SIGKILL
        wait_until(lambda: raw.job("default", bs_id)["state"] == "ready", 10, "the job to be ready again")

        second = run_once(procs, env)
        assert second.job_lines() == [], "settled by the fetch, never handed to the worker"
        assert any(f"job {job_id}" in line and "failed permanently" in line for line in second.err), second.output()

    assert len(effects(key)) == 1, "the lost run spent the only run the job had"
    row = Job.objects.get(pk=job_id)  # the audit copy, in the default database
    assert (row.status, row.backend, row.queue, row.attempts) == (JobStatus.FAILED, "beanstalk", "default", 1)
    assert row.last_error.startswith("WorkerLost: beanstalkd handed it out 1 time(s)"), row.last_error
    assert raw.job("default", bs_id)["state"] == "buried", "beanstalkd's own dead letter"
    assert raw.counts("default") == {**ZERO, "failed": 1}


# -- 2. a job that kills its worker every time -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.django_db(databases=["default", PG], transaction=True)
@pytest.mark.usefixtures("postgres_up", "beanstalk_up")
def test_job_that_kills_its_worker_every_time_is_buried_after_max_retries_plus_one_deliveries(raw):
    """``os._exit`` in the job: each death releases the reservation, ``reserves`` grows, and the
    fourth delivery arrives with attempts 3 > max_retries 2: the fetch buries it without running."""
    key = unique("bexit")
    job_id = dispatch("exit", key=key, max_retries=2, lease_timeout=1)
    bs_id = only_ready_job(raw)
    with processes() as procs:
        worker = procs.worker(*WORKER, env=worker_env(lease_timeout=1))
        wait_until(
            lambda: raw.job("default", bs_id)["state"] == "buried" and Job.objects.filter(pk=job_id).exists(),
            40,
            "the job to be buried and recorded as failed",
            interval=0.1,
        )
        # The supervisor survived three dead worker processes and still stops cleanly.
        assert worker.alive(), worker.output()
        assert worker.stop(signal.SIGTERM) == 0, worker.output()

    runs = effects(key)
    assert len(runs) == 3, "exactly max_retries + 1 deliveries ran"
    assert len({r.pid for r in runs}) == 3, "each delivery killed its process; a new one took over"
    assert sum("died with status 3" in line for line in worker.err) == 3, worker.output()
    assert worker.job_lines() == [], "no delivery ever completed a run"
    assert any(f"job {job_id}" in line and "failed permanently" in line for line in worker.err), worker.output()
    row = Job.objects.get(pk=job_id)
    assert (row.status, row.backend, row.attempts) == (JobStatus.FAILED, "beanstalk", 3)
    assert row.last_error.startswith("WorkerLost: beanstalkd handed it out 3 time(s)"), row.last_error
    state = raw.job("default", bs_id)
    assert (state["state"], state["reserves"]) == ("buried", 4), state
    assert raw.counts("default") == {**ZERO, "failed": 1}


# -- 3. beanstalkd kill -9 and restart from its binlog under two busy workers -------------------------


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.django_db(databases=["default", PG], transaction=True)
def test_workers_survive_a_beanstalkd_kill_and_binlog_restart_and_no_job_is_lost(
    postgres_up, private_beanstalkd, capsys
):
    """kill -9 a private beanstalkd (never the shared one) under two busy workers, restart it
    ~1 s later on the same port with the same binlog: the workers keep running, log the
    connection error, and every one of the 300 jobs runs; the tube ends empty.

    max_retries leaves room for the reservations the kill broke: beanstalkd counts each in
    ``reserves`` (a lost run) while the workers were still connected.
    """
    server = private_beanstalkd
    total = 300
    prefix = unique("brestart")
    with processes() as procs:
        host, port = server.address
        beanstalk = {
            "ENGINE": "beanstalk",
            "OPTIONS": {"HOST": host, "PORT": port, "PREFIX": settings.BEANSTALK_PREFIX},
        }
        with override_settings(JOBS=jobs_with(BACKENDS={**settings.JOBS["BACKENDS"], "beanstalk": beanstalk})):
            backend = get_backend("beanstalk")
            try:
                assert backend.address == (host, port)
                builders = [
                    scripted.using(backend="beanstalk", max_retries=5, backoff=NO_BACKOFF).builder(
                        action="sleep" if i % 2 else "ok", key=f"{prefix}-{i}", db=PG, seconds=0.05
                    )
                    for i in range(total)
                ]
                ids = Jobs.bulk(builders, backend="beanstalk")
                assert backend.stats("default") == {**ZERO, "pending": total}

                env = worker_env(JOBS_TEST_BEANSTALK=f"{host}:{port}")
                workers = [procs.worker(*WORKER, env=env, wait_started=False) for _ in range(2)]
                for worker in workers:
                    worker.wait_started()

                def runs() -> Any:
                    return SideEffect.objects.using(PG).filter(key__startswith=prefix + "-")

                wait_until(lambda: runs().count() >= 20, 30, "the workers to be busy")
                server.kill()
                assert server.popen.returncode == -signal.SIGKILL
                ran_before = runs().values("key").distinct().count()
                assert ran_before < total, "the queue drained before the kill: nothing was tested"
                time.sleep(1)  # the outage itself (not a wait for anything)
                for worker in workers:
                    assert worker.alive(), f"a worker exited while beanstalkd was down\n{worker.output()}"
                server.start()
                # This process's own connection died with the server (see the reconnect test below).
                backend.close()

                def all_ran() -> bool:
                    for worker in workers:
                        assert worker.alive(), f"a worker exited after the restart\n{worker.output()}"
                    done = runs().values("key").distinct().count() == total
                    return done and backend.size("default") == 0

                wait_until(all_ran, 60, f"all {total} jobs to run after the restart", interval=0.2)
                stats = backend.stats("default")
                for worker in workers:
                    assert worker.alive(), worker.output()
                    assert any(
                        name in line
                        for line in worker.err
                        for name in (
                            "ConnectionError",
                            "ConnectionRefusedError",
                            "BrokenPipeError",
                            "ConnectionResetError",
                        )
                    ), f"the worker did not log the connection error\n{worker.output()}"
                for worker in workers:
                    worker.send(signal.SIGTERM)
                codes = [worker.wait(30) for worker in workers]
                assert codes == [0, 0], "\n".join(w.output() for w in workers)
            finally:
                backend.close()

    assert stats == ZERO, f"the tube must end empty (nothing buried, reserved or waiting): {stats}"
    assert not Job.objects.filter(pk__in=ids).exists(), "no job was dead-lettered"
    per_key = Counter(runs().values_list("key", flat=True))
    assert set(per_key) == {f"{prefix}-{i}" for i in range(total)}, "a job was lost"
    duplicated = {k: n for k, n in per_key.items() if n > 1}
    # Only a job in a worker's hands at the kill can run twice: its delete could not reach
    # beanstalkd, and the other worker reserved it after the restart first. At most one per
    # worker, and at most twice.
    assert len(duplicated) <= len(workers), duplicated
    assert all(n == 2 for n in duplicated.values()), duplicated
    with capsys.disabled():
        print(
            f"\n[beanstalkd kill -9] {ran_before}/{total} jobs had run before the kill; "
            f"{len(duplicated)} job(s) ran twice because of it: {sorted(duplicated)}"
        )


@pytest.mark.django_db
def test_dispatching_process_reconnects_after_a_beanstalkd_restart(private_beanstalkd):
    """A web process dispatches, beanstalkd restarts: dispatching must work again without a
    process restart (one failed call at the moment of the outage is tolerated)."""
    server = private_beanstalkd
    host, port = server.address
    backend = BeanstalkBackend("beanstalk", {"HOST": host, "PORT": port, "PREFIX": settings.BEANSTALK_PREFIX})
    try:
        backend.enqueue(envelope())
        server.kill()
        server.start()
        errors = []
        for _ in range(3):
            try:
                backend.enqueue(envelope())
                break
            except Exception as exc:  # noqa: BLE001 (recorded for the assertion message)
                errors.append(f"{type(exc).__name__}: {exc}")
        assert len(errors) <= 1, f"enqueue never recovered: {errors}"
        with raw_tube(server.address, backend.tube_name("default")) as client:
            assert tube_counts(client, backend.tube_name("default"))["pending"] == 2
    finally:
        backend.close()


# -- 4. raw bytes put straight into a tube -------------------------------------------------------------


@pytest.mark.django_db
def test_garbage_put_into_the_tubes_is_buried_counted_and_never_run(backend, raw):
    good_key, bad_key = unique("bgood"), unique("bbad")

    def good() -> str:
        return backend.enqueue(envelope(key=good_key))

    def put(queue: str, body: bytes) -> int:
        # The backend's own priority for priority 0, so raw and good jobs interleave FIFO.
        return raw[queue].put(body, priority=PRIORITY_ZERO, ttr=60)

    forged = envelope(key=bad_key)  # would record a SideEffect under bad_key if it ever ran
    forged.signature = hmac.new(
        b"an attacker's key, not the workers'", signing.canonical(forged.signed_fields()), hashlib.sha256
    ).hexdigest()
    replayed = envelope(key=bad_key)  # validly signed, for queue "default"

    good_ids = [good()]
    not_json = b"\x00\xff{not json at all"
    bad = {"not-json": ("default", put("default", not_json), "InvalidPayload")}
    good_ids.append(good())
    bad["empty"] = ("default", put("default", b""), "InvalidPayload")
    good_ids.append(good())
    bad["not-an-envelope"] = ("default", put("default", b'{"v": 1, "id": "x"}'), "InvalidPayload")
    good_ids.append(good())
    bad["forged"] = ("default", put("default", forged.to_bytes()), "BadSignature")
    good_ids.append(good())
    bad["replayed"] = ("other", put("other", replayed.to_bytes()), "BadSignature")  # another queue's tube
    good_ids.append(good())

    worker = QueueWorker("beanstalk", ["default", "other"])
    results = []
    for _ in range(20):
        result = worker.process_once()
        if result.status == "empty":
            break
        results.append(result)
    else:
        raise AssertionError(f"tubes not empty after 20 deliveries: {results}")

    # FIFO within the one priority: good and bad deliveries alternate as they were put.
    # ("default" is drained before "other": the worker's queues are tried in order.)
    assert [r.status for r in results] == ["acked", "rejected"] * 4 + ["acked", "acked", "rejected"], results
    assert [r.job_id for r in results if r.status == "acked"] == good_ids
    assert len(effects(good_key, "default")) == len(good_ids)
    assert effects(bad_key, "default") == [], "a rejected message ran"

    by_token = {r.job_id: r for r in results if r.status == "rejected"}
    for name, (queue, bs_id, exc_name) in bad.items():
        token = {"forged": forged.id, "replayed": replayed.id}.get(name, str(bs_id))
        assert by_token[token].error.startswith(f"rejected: {exc_name}"), (name, by_token[token])
        assert raw.job(queue, bs_id)["state"] == "buried", name
    assert raw["default"].peek(bad["not-json"][1]).body == not_json, "kept as received, for audit"
    assert "delivered on 'other'" in by_token[replayed.id].error

    # Decodable envelopes also get their failed audit row, under a new id of its own that quotes
    # the id they claimed (neither verifies where it was delivered); undecodable bytes have nothing
    # to record.
    for env in (forged, replayed):
        assert not Job.objects.filter(pk=env.id).exists()
        row = Job.objects.get(last_error__contains=repr(env.id), backend="beanstalk")
        assert (row.status, row.attempts) == (JobStatus.FAILED, 0)
        assert row.last_error.startswith("rejected: BadSignature"), row.last_error

    metrics = get_collector()
    assert metrics.get("jobs_rejected_payload", queue="default") == 3
    assert metrics.get("jobs_rejected_signature", queue="default") == 1
    assert metrics.get("jobs_rejected_signature", queue="other") == 1
    assert metrics.get("jobs_succeeded", queue="default") == len(good_ids)
    assert raw.counts("default") == {**ZERO, "failed": 4}
    assert raw.counts("other") == {**ZERO, "failed": 1}


# -- 5. priority and delay mapping -----------------------------------------------------------------------


@pytest.mark.django_db
def test_higher_priority_is_reserved_first_and_fifo_within_a_priority(backend, raw):
    priorities = [0, 5, -3, 5, 10, 0, 2**31 - 1, -(2**31) + 1]
    envs = [envelope(priority=p) for p in priorities]
    for env in envs:
        backend.enqueue(env)

    leases = [backend.fetch("default") for _ in envs]
    assert backend.fetch("default") is None
    fetched = [lease.envelope for lease in leases]
    expected = sorted(envs, key=lambda e: -e.priority)  # a stable sort: FIFO among equals
    assert [e.id for e in fetched] == [e.id for e in expected]
    # beanstalkd's pri: 0 is the most urgent of 2**32, so django-jobs priority p is 2**31 - p.
    pris = [raw.job("default", lease.raw.id)["pri"] for lease in leases]
    assert pris == [PRIORITY_ZERO - e.priority for e in fetched], pris
    assert pris == sorted(pris) and 1 <= pris[0] and pris[-1] <= 2**32 - 1
    for lease in leases:
        backend.ack(lease)
    assert raw.counts("default") == ZERO


@pytest.mark.django_db
def test_the_lowest_integer_field_priority_can_be_enqueued_and_comes_last(backend):
    lowest, low = envelope(priority=-(2**31)), envelope(priority=-(2**31) + 1)
    normal = envelope(priority=0)
    for env in (low, lowest, normal):
        backend.enqueue(env)
    order = [backend.fetch("default").envelope.id for _ in range(3)]
    assert order == [normal.id, low.id, lowest.id]


@pytest.mark.django_db
def test_a_refused_put_leaves_the_connection_usable(backend, raw):
    # Dispatch refuses such a delay; a message built by hand (as another producer could) reaches
    # the backend, and beanstalkd refuses a put delay over 2**32 - 1 s.
    far = replace(envelope(), available_at=timezone.now() + timedelta(days=365 * 200))
    with contextlib.suppress(Exception):  # refusing it is fine; what follows must still work
        backend.enqueue(far)
    good = envelope()
    assert backend.enqueue(good) == good.id
    lease = backend.fetch("default")
    assert lease is not None and lease.envelope is not None and lease.envelope.id == good.id
    assert raw.counts("default")["in_progress"] == 1


@pytest.mark.django_db
def test_delay_is_a_put_delay_the_job_is_reserved_only_when_due(backend, raw):
    job_id = backend.enqueue(envelope(delay=1))
    assert raw.counts("default") == {**ZERO, "delayed": 1}
    bs_id = raw["default"].peek_delayed().id
    assert raw.job("default", bs_id)["delay"] == 1
    assert backend.fetch("default") is None, "not reservable before its delay"

    lease = wait_until(lambda: backend.fetch("default"), 5, "the delayed job to become reservable")
    assert lease.envelope is not None and lease.envelope.id == job_id
    assert lease.raw.id == bs_id
    backend.ack(lease)
    assert raw.counts("default") == ZERO


# -- 6. nack, extend (touch) and fencing by reservation ---------------------------------------------------


@pytest.mark.django_db
def test_nack_puts_a_fresh_copy_with_one_more_attempt_and_deletes_the_original(backend, raw):
    original = envelope(priority=7, max_retries=3)
    backend.enqueue(original)
    lease = backend.fetch("default")
    old_id = lease.raw.id

    backend.nack(lease, 0, error="RuntimeError: try again")
    with pytest.raises(greenstalk.NotFoundError):
        raw["default"].peek(old_id)  # the original beanstalk job is gone
    copy = raw["default"].peek_ready()
    assert copy.id != old_id
    body = Envelope.from_bytes(copy.body)
    assert (body.id, body.attempts) == (original.id, 1)
    signing.verify(body)  # attempts is outside the MAC: the copy still verifies
    assert raw.job("default", copy.id)["pri"] == PRIORITY_ZERO - 7, "a retried job keeps its priority"
    assert raw.counts("default") == {**ZERO, "pending": 1}

    # The copy is a new beanstalk job (reserves 1): its attempts come from the body alone.
    again = backend.fetch("default")
    assert (again.raw.id, again.envelope.attempts) == (copy.id, 1)
    backend.nack(again, 30)
    delayed = raw["default"].peek_delayed()
    assert Envelope.from_bytes(delayed.body).attempts == 2
    assert raw.job("default", delayed.id)["delay"] == 30, "nack(delay) is a put-delay"
    assert raw.counts("default") == {**ZERO, "delayed": 1}


@pytest.mark.django_db
def test_extend_touches_the_reservation_past_its_ttr(raw):
    with override_settings(JOBS=jobs_with(LEASE_TIMEOUT=2)):
        backend = get_backend("beanstalk")
        try:
            backend.enqueue(envelope())
            lease = backend.fetch("default")
            assert raw.job("default", lease.raw.id)["ttr"] == 2
            end = time.monotonic() + 3  # 1.5 TTRs
            while time.monotonic() < end:
                backend.extend(lease, 2)
                time.sleep(0.5)  # the heartbeat's cadence, not an assertion
            backend.extend(lease, 2)
            state = raw.job("default", lease.raw.id)
            # The touch restarted the TTR: without touches time-left would be negative by now.
            assert (state["state"], state["timeouts"], state["reserves"]) == ("reserved", 0, 1), state
            assert state["time-left"] >= 1, state
            backend.ack(lease)
            assert raw.job("default", lease.raw.id) == {"state": "gone"}
        finally:
            backend.close()


@pytest.mark.django_db
def test_a_reservation_lost_with_its_connection_is_fenced_once_another_worker_holds_it(beanstalk_up, raw):
    """Only the connection holding a reservation can touch, delete or bury the job: a worker
    whose connection dropped (network blip, broker restart) reconnects holding nothing."""
    first = get_backend("beanstalk")
    second = BeanstalkBackend("beanstalk", dict(first.options))  # another worker's connection
    try:
        job_id = first.enqueue(envelope(max_retries=1))
        stale = first.fetch("default")
        first.close()  # the connection drops: beanstalkd releases the reservation at once
        wait_until(lambda: raw.job("default", stale.raw.id)["state"] == "ready", 5, "the job to be released")
        fresh = second.fetch("default")
        assert (fresh.raw.id, fresh.envelope.attempts) == (stale.raw.id, 1), "the lost run counts"

        for settle in (
            lambda: first.extend(stale, 60),
            lambda: first.ack(stale),
            lambda: first.nack(stale, 0),
            lambda: first.abandon(stale, "stale"),
        ):
            with pytest.raises(LeaseLost):
                settle()
        assert raw.job("default", fresh.raw.id)["state"] == "reserved"
        assert raw.counts("default") == {**ZERO, "in_progress": 1}, "a refused nack put no copy"
        assert not Job.objects.filter(pk=job_id).exists(), "a refused abandon recorded nothing"
        second.ack(fresh)
        assert raw.counts("default") == ZERO
    finally:
        first.close()
        second.close()


# -- 7. stats and size from stats-tube ---------------------------------------------------------------------


@pytest.mark.django_db
def test_stats_and_size_come_from_stats_tube(backend, raw):
    for _ in range(4):
        backend.enqueue(envelope())
    backend.enqueue(envelope(delay=600))
    backend.enqueue(envelope(delay=900))
    held = backend.fetch("default")
    dropped = backend.fetch("default")
    backend.abandon(dropped, "test: failed for good")

    expected = {"pending": 2, "delayed": 2, "in_progress": 1, "failed": 1}
    assert raw.counts("default") == expected, "beanstalkd's own figures"
    assert backend.stats("default") == expected
    assert backend.size("default") == 5, "ready + delayed + reserved; buried is settled"
    assert backend.stats("other") == ZERO

    out = io.StringIO()
    call_command("jobs_stats", "--json", "--backend", "beanstalk", stdout=out)
    rows = {row["queue"]: row for row in json.loads(out.getvalue())}
    assert {c: rows["default"][c] for c in expected} == expected
    assert {c: rows["other"][c] for c in expected} == ZERO

    backend.ack(held)
    assert backend.stats("default") == {**expected, "in_progress": 0}
    assert backend.size("default") == 4


# -- 8. jobs_purge --status failed deletes buried jobs ------------------------------------------------------


def _bury(backend: BeanstalkBackend, queue: str) -> str:
    env = envelope(queue=queue)
    backend.enqueue(env)
    lease = backend.fetch(queue)
    assert lease.envelope.id == env.id
    backend.abandon(lease, "test: failed for good")
    return env.id


# Only the backends these tests use: purge visits every configured backend, and the others'
# services (Redis, PostgreSQL) are not this file's business.
PURGE_JOBS = {"default": settings.JOBS["BACKENDS"]["default"], "beanstalk": settings.JOBS["BACKENDS"]["beanstalk"]}


@pytest.mark.django_db
def test_jobs_purge_failed_deletes_buried_jobs_and_their_audit_rows(beanstalk_up, raw):
    with override_settings(JOBS=jobs_with(BACKENDS=PURGE_JOBS)):
        backend = get_backend("beanstalk")
        try:
            in_default = [_bury(backend, "default") for _ in range(2)]
            in_other = _bury(backend, "other")
            assert raw.counts("default")["failed"] == 2 and raw.counts("other")["failed"] == 1
            assert Job.objects.filter(status=JobStatus.FAILED, backend="beanstalk").count() == 3

            out = io.StringIO()
            call_command("jobs_purge", "--status", "failed", "--queue", "other", stdout=out)
            assert out.getvalue().strip() == "deleted 1 failed job(s)"
            assert raw.counts("other") == ZERO
            assert raw.counts("default")["failed"] == 2, "--queue limits the purge"
            assert not Job.objects.filter(pk=in_other).exists()

            out = io.StringIO()
            call_command("jobs_purge", "--status", "failed", stdout=out)
            assert out.getvalue().strip() == "deleted 2 failed job(s)"
            assert raw.counts("default") == ZERO
            assert not Job.objects.filter(pk__in=in_default).exists()
        finally:
            backend.close()


@pytest.mark.django_db
def test_jobs_purge_before_keeps_a_just_buried_job(beanstalk_up, raw):
    with override_settings(JOBS=jobs_with(BACKENDS=PURGE_JOBS)):
        backend = get_backend("beanstalk")
        try:
            job_id = _bury(backend, "default")
            out = io.StringIO()
            call_command("jobs_purge", "--status", "failed", "--before", "1d", stdout=out)
            assert out.getvalue().strip() == "deleted 0 failed job(s)"
            assert Job.objects.filter(pk=job_id).exists(), "the audit row is younger than a day"
            assert raw.counts("default")["failed"] == 1, "so is the buried job"
        finally:
            backend.close()


# -- 9. a reservation taken while a worker stops ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.django_db(databases=["default", PG], transaction=True)
@pytest.mark.usefixtures("postgres_up", "beanstalk_up")
def test_a_job_reserved_while_the_worker_stops_is_not_counted_as_a_run(raw):
    key = unique("bstash")
    with processes() as procs:
        # --sleep 10: an idle worker blocks in beanstalkd's reserve (wait_for_work) for 10 s.
        worker = procs.worker(*WORKER, "--sleep", "10", env=worker_env())
        tube = get_backend("beanstalk").tube_name("default")
        wait_until(
            lambda: raw["default"].stats_tube(tube)["current-waiting"] == 1, 10, "the worker to block in reserve"
        )
        # A clean stop asked while it waits (to the group, as ^C: the worker process gets it
        # directly), then a job arrives before the reserve returns.
        worker.send(signal.SIGTERM, group=True)
        job_id = dispatch("ok", key=key, max_retries=0)
        assert worker.wait(30) == 0, worker.output()
        assert worker.job_lines() == [], "the stopping worker ran nothing"

        second = run_once(procs, worker_env())
        [line] = second.job_lines()
        assert line.startswith("completed") and job_id in line and "attempt=1" in line, second.output()
    assert len(effects(key)) == 1


@pytest.mark.django_db
def test_a_job_reserved_by_wait_for_work_goes_back_at_its_priority_when_the_backend_closes(backend, raw):
    backend.enqueue(envelope(priority=5))
    assert backend.wait_for_work(["default"], 1) is True
    backend.close()
    job_id = raw["default"].peek_ready().id
    state = raw.job("default", job_id)
    assert (state["reserves"], state["releases"]) == (1, 1), "released: not a lost run"
    assert state["pri"] == PRIORITY_ZERO - 5


# -- 10. one round trip a job: the ack and the next fetch written together -----------------------------------


def lose_once(address: tuple[str, int], tube: str) -> int:
    """Another worker reserves the next ready job and dies (its connection closes): beanstalkd
    puts it back, its ``reserves`` one higher. Returns its beanstalk id."""
    with raw_tube(address, tube) as other:
        return other.reserve(timeout=0).id


@pytest.mark.django_db
def test_an_ack_and_the_next_fetch_cost_one_round_trip_and_lost_runs_still_count(beanstalk_up, backend, raw):
    first, second, third = (envelope(backoff=NO_BACKOFF, max_retries=3) for _ in range(3))
    for env in (first, second, third):
        backend.enqueue(env)
    writes = count_writes(backend._tube("default").client)

    lease = backend.fetch("default")  # nothing shown yet: reserve, then the job's stats-job
    assert lease.envelope.id == first.id
    assert writes.writes == 2
    following = backend.ack_and_fetch(lease, "default")
    assert raw.job("default", lease.raw.id) == {"state": "gone"}
    assert (following.envelope.id, following.envelope.attempts) == (second.id, 0)
    assert writes.writes == 3

    lost_id = lose_once(beanstalk_up, backend.tube_name("default"))
    wait_until(lambda: raw.job("default", lost_id)["state"] == "ready", 5, "the lost job to come back")
    last = backend.ack_and_fetch(following, "default")
    assert (last.envelope.id, last.envelope.attempts) == (third.id, 1), "its lost run counts"
    assert writes.writes == 4
    assert backend.ack_and_fetch(last, "default") is None
    assert writes.writes == 5
    assert raw.counts("default") == ZERO


@pytest.mark.django_db
def test_a_job_taken_by_another_worker_meanwhile_costs_a_second_round_trip_for_its_own_counts(
    beanstalk_up, backend, raw
):
    first, second, third = (envelope(backoff=NO_BACKOFF, max_retries=3) for _ in range(3))
    for env in (first, second, third):
        backend.enqueue(env)
    other = BeanstalkBackend("beanstalk", dict(backend.options))
    try:
        lease = backend.fetch("default")  # shows `second` next
        taken = other.fetch("default")
        assert taken.envelope.id == second.id
        lost_id = lose_once(beanstalk_up, backend.tube_name("default"))
        wait_until(lambda: raw.job("default", lost_id)["state"] == "ready", 5, "the lost job to come back")
        writes = count_writes(backend._tube("default").client)

        following = backend.ack_and_fetch(lease, "default")

        assert (following.envelope.id, following.envelope.attempts) == (third.id, 1), "its own lost run"
        assert writes.writes == 2
        other.ack(taken)
        backend.ack(following)
    finally:
        other.close()
    assert raw.counts("default") == ZERO


@pytest.mark.django_db
def test_an_ack_that_finds_its_lease_lost_keeps_the_job_reserved_with_it_for_the_next_fetch(backend, raw):
    first, second = envelope(), envelope()
    backend.enqueue(first)
    backend.enqueue(second)
    lease = backend.fetch("default")
    stale = replace(lease, raw=greenstalk.Job(lease.raw.id + 10**9, b""))  # no such reservation

    with pytest.raises(LeaseLost):
        backend.ack_and_fetch(stale, "default")

    following = backend.fetch("default")
    assert (following.envelope.id, following.envelope.attempts) == (second.id, 0)
    assert raw.job("default", following.raw.id)["reserves"] == 1, "reserved once, by the failed ack"
    backend.ack(lease)
    backend.ack(following)
    assert raw.counts("default") == ZERO


# -- 11. the beanstalk extra missing ------------------------------------------------------------------------


def test_import_without_greenstalk_names_the_extra(monkeypatch):
    # monkeypatch restores both entries (and so the real module objects) after the test.
    monkeypatch.setitem(sys.modules, "greenstalk", None)  # `import greenstalk` now raises ImportError
    monkeypatch.delitem(sys.modules, "django_jobs.backends.beanstalk")
    with pytest.raises(ImproperlyConfigured) as excinfo:
        importlib.import_module("django_jobs.backends.beanstalk")
    assert "pip install 'django-reliable-jobs[beanstalk]'" in str(excinfo.value)
    assert "greenstalk" in str(excinfo.value)
