"""Edge cases found in review: locks outliving long jobs, error history, key rotation, bad options."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_jobs import Jobs, signing
from django_jobs.backends.base import Lease
from django_jobs.exceptions import BadSignature
from django_jobs.heartbeat import Heartbeat
from django_jobs.models import Job
from django_jobs.worker import QueueWorker
from tests.testapp.jobs import scripted


class _CountingBackend:
    def __init__(self) -> None:
        self.extended = 0

    def extend(self, lease: Lease, seconds: float) -> None:
        self.extended += 1


def _wait_until(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_heartbeat_keeps_the_jobs_locks_alive_with_its_lease():
    # An idempotency key or single-instance lock must live as long as the lease it guards,
    # or a second delivery could run a long job concurrently.
    backend = _CountingBackend()
    kept = threading.Event()
    heartbeat = Heartbeat(backend, lease_seconds=0.3)  # type: ignore[arg-type]
    heartbeat.start()
    try:
        lease = Lease(token="t", owner_token="o", expires_at=None, queue="default")  # type: ignore[arg-type]
        heartbeat.watch(lease, [kept.set])
        assert kept.wait(10), "keep-alive callbacks never ran"
        assert backend.extended >= 1
    finally:
        heartbeat.stop()


@pytest.mark.django_db
def test_a_requeue_without_a_run_keeps_the_last_error():
    job_id = scripted.using(max_retries=2, backoff={"strategy": "none"}).dispatch(action="raise")
    worker = QueueWorker("default")
    assert worker.process_once().status == "requeued"
    backend = Jobs.backend("default")
    lease = backend.fetch("default")
    backend.nack(lease, 0, count_run=False)  # e.g. its idempotency key was busy elsewhere
    row = Job.objects.get(pk=job_id)
    assert row.attempts == 1
    assert row.last_error.startswith("RuntimeError: scripted failure")


@pytest.mark.django_db
def test_rotating_secret_key_keeps_queued_jobs_valid_through_secret_key_fallbacks():
    env = scripted.using().builder(action="ok").build()
    with override_settings(SECRET_KEY="a-brand-new-secret-key", SECRET_KEY_FALLBACKS=[settings.SECRET_KEY]):
        signing.verify(env)  # signed with the old key, still accepted
    with (
        override_settings(SECRET_KEY="a-brand-new-secret-key", SECRET_KEY_FALLBACKS=[]),
        pytest.raises(BadSignature),
    ):
        signing.verify(env)


def test_backoff_refuses_unknown_options():
    with pytest.raises(TypeError, match="maximum"):
        Jobs.define("command", "check").backoff(maximum=5)


@pytest.mark.parametrize("argv", [["jobs_work", "nosuchqueue", "--once"], ["jobs_work", "--concurrency", "0"]])
def test_jobs_work_refuses_bad_options(argv):
    with pytest.raises(CommandError):
        call_command(*argv)


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
def test_a_job_longer_than_its_lease_is_heartbeated_and_never_reaped(postgres_up):
    from django.db import connections

    from django_jobs.reaper import Reaper

    results = []
    with override_settings(JOBS={**settings.JOBS, "LEASE_TIMEOUT": 0.6}):
        job_id = scripted.using(backend="pg").dispatch(action="sleep", seconds=2.5, key="long", db="postgres")
        stop = threading.Event()
        reaped = []

        def reap_constantly() -> None:
            # A reaper that runs all the time: only a live heartbeat keeps the lease from it.
            try:
                while not stop.is_set():
                    reaped.append(Reaper("pg").reap_once())
                    time.sleep(0.05)
            finally:
                connections.close_all()

        reaper = threading.Thread(target=reap_constantly)
        reaper.start()
        try:
            QueueWorker("pg").run(max_jobs=1, on_result=results.append, reap=False)
        finally:
            stop.set()
            reaper.join(10)
    assert [r.status for r in results] == ["acked"]
    assert sum(reaped) == 0
    row = Job.objects.using("postgres").get(pk=job_id)
    assert (row.status, row.attempts) == ("completed", 1)


@pytest.mark.django_db
def test_a_job_without_payload_runs_with_an_empty_object():
    seen = []

    class Handler:
        def handle(self, context):
            seen.append(context.payload)

    from django_jobs import registry

    registry.register("tests.no-payload", Handler())
    job_id = Jobs.define("tests.no-payload").dispatch()
    assert QueueWorker("default").process_once().status == "acked"
    assert seen == [{}] and Job.objects.get(pk=job_id).payload == {}


def test_the_message_cap_applies_to_the_whole_envelope_at_dispatch():
    from django_jobs.exceptions import InvalidPayload

    # The payload alone fits; with the envelope's fields and signature it does not.
    with (
        override_settings(JOBS={**settings.JOBS, "MAX_MESSAGE_BYTES": 400}),
        pytest.raises(InvalidPayload, match="message of"),
    ):
        Jobs.define("command", "x" * 300).build()


@pytest.mark.django_db(transaction=True)
def test_a_failure_record_survives_a_connection_broken_under_it():
    """A broker's worker touches the database only to record failures: a connection broken by
    a database restart must not lose that record, nor every later one."""
    from django.db import connection

    from django_jobs.audit import record_failure

    env = scripted.using(backend="redis").builder(action="raise").build()
    connection.ensure_connection()
    connection.connection.close()  # the driver's connection dies; Django does not know yet

    record_failure(env, "RuntimeError: boom", "redis", 1)

    row = Job.objects.get(pk=env.id)
    assert (row.status, row.backend, row.last_error) == ("failed", "redis", "RuntimeError: boom")


@pytest.mark.django_db
def test_the_reaper_holds_back_for_a_lease_after_a_backend_error():
    """Leases that expired while the backend was unreachable may belong to live workers whose
    beats could not get through either: they get one lease timeout to beat again."""
    from datetime import timedelta

    from django.utils import timezone

    from django_jobs.reaper import Reaper

    job_id = scripted.dispatch(action="ok")
    Job.objects.filter(pk=job_id).update(
        status="in_progress", owner_token="gone", leased_until=timezone.now() - timedelta(seconds=5)
    )
    reaper = Reaper("default")
    reaper.grace = 0.3
    reaper.backend_failed()
    assert reaper.reap_once() == 0
    assert Job.objects.get(pk=job_id).status == "in_progress"
    time.sleep(0.35)
    assert reaper.reap_once() == 1
    assert Job.objects.get(pk=job_id).last_error.startswith("WorkerLost")


@pytest.mark.django_db(transaction=True)
def test_a_worker_whose_beats_failed_holds_its_reaping_back(monkeypatch):
    """A worker that ran a long job through an outage saw the backend only through its
    heartbeat's failed beats. Once its job ended, its reaper found another worker's lease that
    expired in the same outage (that worker's beats failed too, and its next one was due) and
    reaped it: a live job ran again, or was failed as lost (a chaos run's database restart behind
    PgBouncer). A failed beat holds reaping back for a lease timeout, as a failed settle does."""
    from datetime import timedelta

    from django.db import OperationalError
    from django.utils import timezone

    other = scripted.dispatch(action="ok")
    worker = QueueWorker("default", ["default"], prefetch=1)
    worker.lease_seconds = worker.heartbeat.lease_seconds = 0.6
    worker.heartbeat.interval = 0.1

    def unreachable(lease: Lease, seconds: float) -> None:
        raise OperationalError("server login has been failing, try again later")

    monkeypatch.setattr(worker.backend, "extend", unreachable)
    # The other worker's job: claimed, its lease expired during the outage.
    Job.objects.filter(pk=other).update(
        status="in_progress", owner_token="alive", leased_until=timezone.now() + timedelta(seconds=0.2)
    )
    scripted.dispatch(action="sleep", seconds=1.0)
    scripted.dispatch(action="ok")
    assert worker.run(max_jobs=2, reap_at_start=False) == 2  # its reap was due after the long job
    row = Job.objects.get(pk=other)
    assert (row.status, row.owner_token, row.last_error) == ("in_progress", "alive", "")


def reap_loop_through_an_outage(
    monkeypatch: pytest.MonkeyPatch, back: float, beat: float, stop: float
) -> tuple[int, list[str]]:
    """``jobs_reap --loop``'s ``Reaper.run`` (``LEASE_TIMEOUT`` 1.5 s, ``--interval`` 2.5 s)
    against a database down (every reap and probe fails) until ``back`` seconds from now, while a
    live worker's lease has expired in the outage; its holder's beat gets through at ``beat``.
    Returns how many leases that beat extended (0: reaped first) and the reaper's calls."""
    from datetime import timedelta

    from django.db import OperationalError
    from django.utils import timezone

    from django_jobs.reaper import Reaper

    alive = scripted.dispatch(action="ok")
    Job.objects.filter(pk=alive).update(
        status="in_progress", owner_token="alive", leased_until=timezone.now() - timedelta(seconds=1)
    )
    reaper = Reaper("default")
    reaper.grace = 1.5  # LEASE_TIMEOUT; its holders beat every 0.5 s
    start = time.monotonic()
    calls: list[str] = []

    def down(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            calls.append(name)
            if time.monotonic() < start + back:
                raise OperationalError("the database is down")
            return real(*args)

        return call

    monkeypatch.setattr(reaper.backend, "reap_expired", down("reap", reaper.backend.reap_expired))
    monkeypatch.setattr(reaper.backend, "ping", down("ping", reaper.backend.ping))
    thread = threading.Thread(
        target=reaper.run, args=(2.5,), kwargs={"should_stop": lambda: time.monotonic() > start + stop}
    )
    thread.start()
    while time.monotonic() < start + beat:
        time.sleep(0.02)
    extended = Job.objects.filter(pk=alive, owner_token="alive", status="in_progress").update(
        leased_until=timezone.now() + timedelta(seconds=30)
    )
    thread.join(10)
    row = Job.objects.get(pk=alive)
    assert (row.status, row.owner_token, row.last_error) == ("in_progress", "alive", ""), calls
    return extended, calls


@pytest.mark.django_db(transaction=True)
def test_jobs_reap_loop_still_holds_back_when_the_backend_returns_just_before_its_next_pass(monkeypatch):
    """The hold-back counts from the last error. ``jobs_reap --loop`` with an interval longer
    than the lease timeout failed once, its hold-back ran out during the outage, and its next
    pass came just after the backend returned: it reaped the live workers' leases before their
    next beats got through (a red team, 8 of 9 live jobs failed ``WorkerLost``). During an
    outage it now tries again every third of a lease timeout, so its hold-back outlasts the
    outage's end."""
    extended, _ = reap_loop_through_an_outage(monkeypatch, back=2.3, beat=2.9, stop=3.3)
    assert extended == 1, "the live worker's lease was reaped before its beat got through"


@pytest.mark.django_db(transaction=True)
def test_jobs_reap_loop_probes_the_backend_while_it_holds_back(monkeypatch):
    """A pass that came during the hold-back used to do nothing, not even meet the outage, and
    the next came a whole ``--interval`` later: the outage's last error it met could be more
    than a lease timeout before the backend returned, and that next pass reaped live leases
    before their beats got through (a red team, ``LEASE_TIMEOUT`` 2 to 3 s, ``--interval`` 4 and
    5 s: 15 of 15 live jobs failed ``WorkerLost``). While it holds back it now probes the backend
    every third of a lease timeout, and each error moves the hold-back's end."""
    # Passes at 0 (fails), 0.5 (held back), then one --interval later, at 3.0: just after the return.
    extended, calls = reap_loop_through_an_outage(monkeypatch, back=2.9, beat=3.3, stop=3.7)
    assert extended == 1, f"the live worker's lease was reaped before its beat got through ({calls})"
    assert calls[0] == "reap" and calls.count("ping") >= 5, calls  # probed through the outage


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("backend", ["redis", "beanstalk", "default"])
def test_a_message_at_the_size_cap_is_retried_not_rejected(backend, request):
    """The brokers carry a retry as a message encoded again, with its ``attempts`` and
    ``available_at``: a message that just fit ``MAX_MESSAGE_BYTES`` at dispatch outgrew it by
    10 bytes on its first retry, and was rejected unrun with all its retries left (a red team,
    Redis). A dispatch keeps room below the cap for what a retry adds."""
    from django_jobs.envelope import RETRY_ROOM
    from django_jobs.exceptions import InvalidPayload
    from tests.api_support import jobs_settings, runs

    request.getfixturevalue({"redis": "redis_up", "beanstalk": "beanstalk_up", "default": "db"}[backend])
    job = scripted.using(backend=backend, max_retries=1)
    with jobs_settings(MAX_MESSAGE_BYTES=20_000):  # under beanstalkd's 65,535-byte jobs

        def fits(pad: int) -> bool:
            try:
                job.builder(action="flaky", key="big", fail_times=1, pad="x" * pad).build()
            except InvalidPayload:
                return False
            return True

        low, high = 0, 20_000  # the largest pad a dispatch accepts
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(middle) else (low, middle - 1)
        job_id = job.dispatch(action="flaky", key="big", fail_times=1, pad="x" * low)
        size = len(job.builder(action="flaky", key="big", fail_times=1, pad="x" * low).build().to_bytes())
        assert 20_000 - RETRY_ROOM - 10 < size <= 20_000 - RETRY_ROOM
        worker = QueueWorker(backend, ["default"], prefetch=1)
        first, second = worker.process_once(), worker.process_once()

    assert (first.status, first.job_id) == ("requeued", job_id), first.error
    assert (second.status, second.job_id) == ("acked", job_id), second.error
    assert runs("big") == 2


def test_ping_raises_while_the_backend_is_unreachable(redis_up):
    """What the reaper's probe relies on: an unreachable server raises, it is not taken for an
    answer."""
    import redis

    from django_jobs.backends import get_backend
    from tests.servers import free_port

    down = {"ENGINE": "redis", "OPTIONS": {"URL": f"redis://127.0.0.1:{free_port()}/0"}}
    backends = {**settings.JOBS["BACKENDS"], "down": down}
    with override_settings(JOBS={**settings.JOBS, "BACKENDS": backends}), pytest.raises(redis.ConnectionError):
        get_backend("down").ping()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("prefetch", [1, 100], ids=["one-at-a-time", "batches"])
def test_a_success_that_ends_in_an_outage_is_acked_once_the_backend_is_back(private_redis, prefetch, caplog):
    """A job that succeeded while the backend was down was settled with 3 s of retries, then
    forgotten: after the outage its own worker reaped it, and it ran again (a red team, 10 s
    outages, ``LEASE_TIMEOUT`` 3 s: 3 of 3 jobs, with a batch's acks too; with no retry left it
    was failed ``WorkerLost`` though it had succeeded). The settle is now kept and tried again
    first once the backend answers, while the reapers still hold back."""
    from django_jobs.models import Job
    from tests.api_support import jobs_settings, runs
    from tests.procs import wait_until

    backends = {**settings.JOBS["BACKENDS"], "private": {"ENGINE": "redis", "OPTIONS": {"URL": private_redis.url}}}
    with jobs_settings(BACKENDS=backends, LEASE_TIMEOUT=3):
        job_id = scripted.using(backend="private", max_retries=0).dispatch(action="sleep", seconds=1.5, key="ok")
        worker = QueueWorker("private", ["default"], prefetch=prefetch)
        thread = threading.Thread(target=worker.run, kwargs={"max_time": 14.0})
        thread.start()
        try:
            wait_until(lambda: runs("ok") == 1, 10, "the job to start")
            private_redis.kill()  # the job ends 1.5 s into the outage; its settle's retries end at 4.5 s
            time.sleep(7.0)
            private_redis.start()
        finally:
            thread.join(20)
        leftover = Jobs.backend("private").size("default")

    assert runs("ok") == 1, "the job ran again"
    assert not Job.objects.filter(pk=job_id).exists(), Job.objects.get(pk=job_id).last_error
    assert leftover == 0, "the job is still in the queue"
    assert not worker.pipeline.unsettled
    # Each try of a kept settle said so at ERROR, every 0.1 to 0.25 s (a red team): once now.
    kept = [r for r in caplog.records if "could not settle it" in r.getMessage() and r.levelno >= logging.ERROR]
    assert len(kept) <= 1
    logged = [r for r in caplog.records if r.name == "django_jobs.worker" and r.levelno >= logging.WARNING]
    assert len(logged) < 25, [r.getMessage() for r in logged]
    assert not [r for r in logged if r.exc_info], "a traceback at default verbosity"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("prefetch", [1, 100], ids=["one-at-a-time", "batches"])
def test_a_lease_outlives_an_outage_that_flaps_in_step_with_its_tries(private_redis, prefetch):
    """A link to the backend that flapped, down 0.7 s of every second, kept out every try of the
    worker: its beats and its settle's tries came every second (every third of ``LEASE_TIMEOUT``
    3 s), each in the down part. Another process's reaper, which met no error, then reaped the
    live job (a red team: 1 to 3 jobs of 3, in each of 3 runs). A failed beat, batch write or
    kept settle is now tried again within a quarter second, at random, and gets through."""
    from django_jobs.models import Job
    from tests.api_support import jobs_settings, runs
    from tests.flapping import FlappingProxy
    from tests.procs import wait_until

    with FlappingProxy((private_redis.host, private_redis.port)) as link:
        backends = {
            **settings.JOBS["BACKENDS"],
            "private": {"ENGINE": "redis", "OPTIONS": {"URL": link.url()}},
            "direct": {"ENGINE": "redis", "OPTIONS": {"URL": private_redis.url}},
        }
        with jobs_settings(BACKENDS=backends, LEASE_TIMEOUT=3):
            job_id = scripted.using(backend="private", max_retries=0).dispatch(action="sleep", seconds=4.0, key="flap")
            worker = QueueWorker("private", ["default"], prefetch=prefetch)
            thread = threading.Thread(target=worker.run, kwargs={"max_time": 15.0})
            thread.start()
            reaped = 0
            try:
                started = wait_until(lambda: runs("flap") == 1 and time.monotonic(), 10, "the job to start")
                # Its beats are due 1, 2, 3 s after its start, and it ends after 4 s: each in
                # the middle of a down part.
                link.flap(first_down=started + 0.65, period=1.0, down=0.7, until=started + 11.0)
                for moment in (5.0, 7.0, 9.0, 12.0):
                    time.sleep(max(started + moment - time.monotonic(), 0))
                    reaped += Jobs.backend("direct").reap_expired("default")
            finally:
                thread.join(20)
            leftover = Jobs.backend("direct").size("default")

    assert reaped == 0, "a live job's lease lapsed in the flapping outage"
    assert runs("flap") == 1, "the job ran again"
    assert not Job.objects.filter(pk=job_id).exists(), Job.objects.get(pk=job_id).last_error
    assert leftover == 0, "the job is still in the queue"
    assert not worker.pipeline.unsettled


@pytest.mark.django_db(transaction=True)
def test_an_ack_whose_answer_was_lost_is_not_only_said_to_be_reaped(monkeypatch, caplog):
    """An ack made, its answer lost with a cut connection, then tried again, finds the lease
    gone. The log said only that the lease was lost (a red team); it now says that the try
    before may have settled it."""
    import logging

    from django.db import OperationalError

    job_id = scripted.dispatch(action="ok", key="answer")
    worker = QueueWorker("default", ["default"], prefetch=1)
    real_ack, tries = worker.pipeline.ack, []

    def ack(lease: Lease, **kwargs: Any) -> None:
        tries.append(lease.token)
        real_ack(lease, **kwargs)
        if len(tries) == 1:
            raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(worker.pipeline, "ack", ack)
    with caplog.at_level(logging.WARNING, logger="django_jobs.worker"):
        worker.process_once()

    assert tries == [job_id, job_id]
    assert Job.objects.get(pk=job_id).status == "completed"
    lost = [r.getMessage() for r in caplog.records if "lease was lost" in r.getMessage()]
    said = f"job {job_id} lost: its lease was lost before it could be settled as completed"
    assert lost == [f"{said}; a try before, whose answer was lost, may have settled it"]


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
@pytest.mark.parametrize("alias", ["pg", "redis"])
def test_a_job_claimed_by_a_try_whose_answer_was_lost_goes_back_uncounted(alias, request, monkeypatch):
    """With ``PREFETCH = 1`` an ack goes with the claim of the next job. When its answer was lost
    (a cut connection), the try again found the first job acked, and the job claimed by the lost
    try was held by no one: the reaper counted a lost run, and a ``max_retries=0`` job that no
    handler had seen was failed ``WorkerLost`` (a red team, Redis and PostgreSQL: 18 jobs of 40
    in a flapping outage). The next claim now hands such a claim to the reaper as unrun: it goes
    back uncounted, and runs."""
    import redis
    from django.db import OperationalError

    from django_jobs.models import Job
    from tests.api_support import jobs_settings, runs

    request.getfixturevalue("postgres_up" if alias == "pg" else "redis_up")
    answers_lost = []
    with jobs_settings(LEASE_TIMEOUT=1.5):
        ids = [scripted.using(backend=alias, max_retries=0).dispatch(action="ok", key=f"lost{i}") for i in range(3)]
        worker = QueueWorker(alias, ["default"], prefetch=1)
        backend = worker.backend
        if alias == "redis":
            real_run = backend._run

            def run(name: str, *args: Any) -> Any:
                reply = real_run(name, *args)
                if name == "ack_fetch" and not answers_lost:
                    answers_lost.append(name)
                    raise redis.ConnectionError("Connection closed by server.")
                return reply

            monkeypatch.setattr(backend, "_run", run)
        else:
            real_execute = backend._execute_queue

            def execute(sql: str, *args: Any, **kwargs: Any) -> Any:
                reply = real_execute(sql, *args, **kwargs)
                if sql.startswith("WITH done AS") and not answers_lost:
                    answers_lost.append(sql)
                    raise OperationalError("server closed the connection unexpectedly")
                return reply

            monkeypatch.setattr(backend, "_execute_queue", execute)
        worker.run(max_time=6.0)
        left = backend.size("default")

    assert len(answers_lost) == 1
    assert [runs(f"lost{i}") for i in range(3)] == [1, 1, 1], "a job never ran, or ran twice"
    rows = Job.objects.using("postgres" if alias == "pg" else "default").filter(pk__in=ids)
    assert not rows.exclude(status="completed").exists(), list(rows.values_list("status", "last_error"))
    assert left == 0


@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
@pytest.mark.parametrize("alias", ["pg", "redis"])
def test_a_batch_write_whose_answer_was_lost_does_not_only_say_its_acks_were_reaped(
    alias, request, monkeypatch, caplog
):
    """A batch's acks written with its next claim, the answer lost: the acks went back for the
    next write, which found the leases gone, and said only that they were reaped and may run
    again (a red team: 57 such warnings in 30 s of flapping, 2 with the caveat; every job had
    run once and completed). It now says that the write before may have settled them."""
    import redis
    from django.db import OperationalError

    from django_jobs.exceptions import MAYBE_SETTLED
    from tests.api_support import jobs_settings, runs

    request.getfixturevalue("postgres_up" if alias == "pg" else "redis_up")
    answers_lost = []
    error = redis.ConnectionError("Connection closed by server.") if alias == "redis" else OperationalError("gone")
    with jobs_settings(LEASE_TIMEOUT=1.5):
        for i in range(6):
            scripted.using(backend=alias, max_retries=0).dispatch(action="ok", key=f"batch{i}")
        worker = QueueWorker(alias, ["default"], prefetch=2)
        real_settle = worker.backend.settle_many_and_fetch

        def settle_many_and_fetch(acks: list[Lease], *args: Any) -> Any:
            reply = real_settle(acks, *args)
            if acks and not answers_lost:
                answers_lost.append(acks)
                raise error
            return reply

        monkeypatch.setattr(worker.backend, "settle_many_and_fetch", settle_many_and_fetch)
        with caplog.at_level(logging.WARNING, logger="django_jobs.worker"):
            worker.run(max_time=6.0)

    assert len(answers_lost) == 1
    assert [runs(f"batch{i}") for i in range(6)] == [1] * 6
    said = [r.getMessage() for r in caplog.records if "lease lost before its ack was written" in r.getMessage()]
    assert said, "the acks of the lost answer were not found lost again"
    assert all(message.endswith(MAYBE_SETTLED) for message in said), said


@pytest.mark.django_db(transaction=True)
def test_a_settle_that_fails_for_another_reason_than_an_outage_is_not_kept(monkeypatch):
    """Only an outage's settle is kept for later: an error that would come back every time (a
    bug, a refused write) would hold the worker, trying it again before every job. The lease is
    left to the reaper, and the next job runs."""
    from tests.api_support import runs

    first = scripted.dispatch(action="ok", key="refused")
    second = scripted.dispatch(action="ok", key="next")
    worker = QueueWorker("default", ["default"], prefetch=1)
    real_ack, refused = worker.pipeline.ack, []

    def ack(lease: Lease, **kwargs: Any) -> None:
        if lease.token == first:
            refused.append(lease.token)
            raise ValueError("this write is refused")
        real_ack(lease, **kwargs)

    monkeypatch.setattr(worker.pipeline, "ack", ack)
    monkeypatch.setattr(worker.backend, "pipelines_ack_fetch", False)
    worker.run(max_time=6.0, reap=False)  # the settle's own retries take 4 s

    assert refused == [first] * 4 and not worker.pipeline.unsettled
    assert (runs("refused"), runs("next")) == (1, 1)
    assert Job.objects.get(pk=second).status == "completed"
    assert Job.objects.get(pk=first).status == "in_progress"  # left to the reaper


def test_an_idle_worker_in_an_outage_tries_again_within_a_third_of_its_lease(monkeypatch):
    """An idle worker backs off 1, 2, 4 ... s during an outage; past a third of its lease
    timeout, its hold-back (a lease timeout from its last error) could run out before the
    backend returned, and its first try after reaped live leases (a red team, with
    ``LEASE_TIMEOUT`` 3 s: 4 of 4 live jobs failed ``WorkerLost``)."""
    worker = QueueWorker("default", ["default"], prefetch=1)
    worker.lease_seconds = 3.0
    pauses: list[float] = []
    monkeypatch.setattr(worker, "_sleep", lambda pause, deadline: pauses.append(pause))
    monkeypatch.setattr(worker.backend, "reset_connection", lambda: None)
    monkeypatch.setattr(worker.backend, "close", lambda: None)
    for failures in range(1, 8):
        worker._outage(ConnectionError("down"), failures, None)
    assert pauses == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    worker.lease_seconds = 300.0
    pauses.clear()
    for failures in range(1, 8):
        worker._outage(ConnectionError("down"), failures, None)
    assert pauses == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
