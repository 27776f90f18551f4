"""Backend conformance: the worker and backend protocol, run against every backend in BACKEND_PARAMS.

Queue semantics (fetch, leases, ack/nack/abandon/extend, fencing, reaping, priority) apply to
backends that hold messages; the sync backend runs each job inline at enqueue, so those tests
skip on its capabilities. What applies to every backend — one run per delivery, failures never
raising to the caller, rejection of tampered messages, idempotency — is tested for all of them.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, replace
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import connections, transaction
from django.db.models.signals import post_save
from django.test import override_settings
from django.utils import timezone

from django_jobs import Jobs, history, operations, signing
from django_jobs.api import JobFunction
from django_jobs.backends import get_backend
from django_jobs.backends.base import Lease, QueueBackend, Requeue
from django_jobs.batches import Batches
from django_jobs.envelope import Envelope
from django_jobs.exceptions import AbortNotSupported, LeaseLost
from django_jobs.history import attempts_of
from django_jobs.metrics import get_collector
from django_jobs.models import Job, JobAttempt
from django_jobs.reaper import recover_claims
from django_jobs.signals import job_reaped, job_started, job_succeeded
from django_jobs.worker import QueueWorker
from tests.backend_params import (
    ALL_DATABASES,
    BACKEND_PARAMS,
    BackendCase,
    backend_of,
    holds_messages,
    ready_case,
    require_hook,
    require_queue,
)
from tests.testapp.jobs import scripted, scripted_async
from tests.testapp.models import SideEffect

# -- fixtures: one test per entry of BACKEND_PARAMS --


@pytest.fixture(params=BACKEND_PARAMS)
def backend_case(request: pytest.FixtureRequest) -> BackendCase:
    """The parametrized entry; ``queue_backend`` builds the backend it names."""
    return ready_case(request)


@pytest.fixture
def queue_backend(backend_case: BackendCase) -> Iterator[QueueBackend]:
    """The backend instance configured as ``backend_case.name``, with DB access granted.

    ``get_backend`` builds it for the current settings (its cache is dropped whenever JOBS
    changes); queue state lives in the test databases, which roll back after each test.
    """
    with backend_of(backend_case) as backend:
        yield backend


# -- helpers --


def unique(prefix: str = "k") -> str:
    # The idempotency cache (LocMemCache) outlives each test's rollback: keys must not repeat.
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def make_env(
    case: BackendCase,
    *,
    action: str = "ok",
    key: str | None = None,
    queue: str = "default",
    function: JobFunction[..., Any] = scripted,
    **options: Any,
) -> Envelope:
    """A signed envelope for the scripted test job (or its ``async def`` twin), built through
    the public @job API."""
    # Backoff "none" keeps retries due immediately, so tests drive retries without waiting.
    options.setdefault("backoff", {"strategy": "none"})
    return function.using(queue=queue, **options).builder(action=action, key=key, db=case.side_effect_db).build()


def runs(case: BackendCase, key: str) -> int:
    """How many times the scripted job with ``key`` really executed."""
    return SideEffect.objects.using(case.side_effect_db).filter(key=key).count()


def enqueue(backend: QueueBackend, case: BackendCase, **kwargs: Any) -> Envelope:
    env = make_env(case, **kwargs)
    assert backend.enqueue(env) == env.id
    return env


def fetch(backend: QueueBackend, queue: str = "default") -> Lease:
    lease = backend.fetch(queue)
    assert lease is not None, f"expected a message on {queue!r}"
    assert lease.envelope is not None, lease.error
    return lease


def drain(backend: QueueBackend, queue: str = "default", limit: int = 20) -> list[str]:
    """Process deliveries until the queue is empty; the statuses in order."""
    worker = QueueWorker(backend, [queue])
    statuses = []
    for _ in range(limit):
        result = worker.process_once()
        if result.status == "empty":
            return statuses
        statuses.append(result.status)
    raise AssertionError(f"queue {queue!r} not empty after {limit} deliveries: {statuses}")


def record(case: BackendCase, backend: QueueBackend, job_id: str) -> Job:
    row = require_hook(case, "record")(backend, job_id)
    assert row is not None, f"no stored row for job {job_id}"
    return row


def counter(name: str, queue: str = "default") -> float:
    return get_collector().get(name, queue=queue)


def reap_now(case: BackendCase, backend: QueueBackend, lease: Lease) -> None:
    """Expire ``lease`` and recover it, as the reaper does after a worker crash."""
    require_hook(case, "expire")(backend, lease)
    if not backend.native_lease:
        assert backend.reap_expired() == 1


# -- fetch, size, settle --


def test_fetch_returns_the_envelope_as_sent_with_a_valid_signature(queue_backend, backend_case):
    require_queue(queue_backend)
    # Every envelope field set to a non-default value, so a field dropped on the wire shows up.
    sent = (
        scripted.using(
            queue="emails",
            priority=7,
            max_retries=4,
            name="conformance",
            idempotency_key=unique(),
            timeout=12.5,
            scheduled_at=timezone.now() - timedelta(seconds=3),
            backoff={"strategy": "fixed", "base": 9},
            retry_on=[RuntimeError],
            single_instance=True,
        )
        .builder(action="ok", key=None, db=backend_case.side_effect_db, nested={"l": [1, 2.5, None, True], "s": "é☃"})
        .build()
    )
    queue_backend.enqueue(sent)

    lease = fetch(queue_backend, "emails")

    assert lease.envelope == sent  # dataclass equality: every field, attempts 0 included
    signing.verify(lease.envelope)  # raises BadSignature otherwise
    assert lease.queue == "emails"
    assert isinstance(lease.token, str) and lease.token
    assert isinstance(lease.owner_token, str) and lease.owner_token
    assert lease.expires_at > timezone.now()


def test_fetch_only_sees_its_own_queue_and_an_empty_queue_gives_none(queue_backend, backend_case):
    require_queue(queue_backend)
    assert queue_backend.fetch("default") is None
    env = enqueue(queue_backend, backend_case, queue="other")
    assert queue_backend.fetch("default") is None
    assert fetch(queue_backend, "other").envelope.id == env.id
    assert queue_backend.fetch("other") is None


def test_size_counts_ready_delayed_and_leased(queue_backend, backend_case):
    require_queue(queue_backend)
    if not queue_backend.supports_delay:
        pytest.skip("backend cannot hold a message back")
    enqueue(queue_backend, backend_case)  # leased below
    enqueue(queue_backend, backend_case, delay=3600)  # delayed
    enqueue(queue_backend, backend_case)  # ready
    enqueue(queue_backend, backend_case, queue="other")  # another queue: not counted
    lease = fetch(queue_backend)

    assert queue_backend.size("default") == 3
    queue_backend.ack(lease)
    assert queue_backend.size("default") == 2
    assert queue_backend.size("other") == 1
    assert queue_backend.size("emails") == 0


def test_ack_settles_the_message_for_good(queue_backend, backend_case):
    require_queue(queue_backend)
    env = enqueue(queue_backend, backend_case)
    lease = fetch(queue_backend)

    queue_backend.ack(lease)

    assert queue_backend.size("default") == 0
    assert queue_backend.fetch("default") is None
    if backend_case.record:
        row = record(backend_case, queue_backend, env.id)
        assert (row.status, row.attempts) == ("completed", 1)
        assert row.finished_at is not None
        assert row.owner_token is None and row.leased_until is None


def test_nack_without_delay_redelivers_with_one_more_attempt(queue_backend, backend_case):
    require_queue(queue_backend)
    env = enqueue(queue_backend, backend_case, priority=3, max_retries=2)
    first = fetch(queue_backend)

    queue_backend.nack(first, 0, error="RuntimeError: try again")

    assert queue_backend.size("default") == 1
    second = fetch(queue_backend)
    assert second.envelope.id == env.id
    assert second.envelope.attempts == 1
    assert second.owner_token != first.owner_token
    # Only attempts and available_at may change on a requeue: priority and the rest are kept,
    # so the requeued message still verifies.
    ignored = {"attempts": 0, "available_at": None}
    assert {**asdict(second.envelope), **ignored} == {**asdict(env), **ignored}
    signing.verify(second.envelope)
    if backend_case.record:
        row = record(backend_case, queue_backend, env.id)
        assert (row.status, row.attempts, row.last_error) == ("in_progress", 1, "RuntimeError: try again")


def test_nack_with_a_delay_hides_the_message_until_due(queue_backend, backend_case):
    require_queue(queue_backend)
    if not queue_backend.supports_delay:
        pytest.skip("backend cannot hold a message back")
    env = enqueue(queue_backend, backend_case, max_retries=1)
    lease = fetch(queue_backend)
    before = timezone.now()

    # A far delay instead of sleeping: the message must simply not be fetchable now.
    queue_backend.nack(lease, 3600, error="later")

    assert queue_backend.fetch("default") is None
    assert queue_backend.size("default") == 1  # delayed messages are not settled
    if backend_case.record:
        row = record(backend_case, queue_backend, env.id)
        assert (row.status, row.attempts) == ("pending", 1)
        assert row.available_at >= before + timedelta(seconds=3590)


def test_abandon_keeps_the_message_failed_with_its_error(queue_backend, backend_case):
    require_queue(queue_backend)
    env = enqueue(queue_backend, backend_case, max_retries=5)
    lease = fetch(queue_backend)

    queue_backend.abandon(lease, "ValueError: broken for good")

    assert queue_backend.fetch("default") is None
    assert queue_backend.size("default") == 0
    if backend_case.record:
        row = record(backend_case, queue_backend, env.id)
        assert (row.status, row.attempts, row.last_error) == ("failed", 1, "ValueError: broken for good")
        assert row.finished_at is not None


def test_extend_pushes_the_lease_expiry(queue_backend, backend_case):
    require_queue(queue_backend)
    # The heartbeat extends by LEASE_TIMEOUT; beanstalkd can only restart a job's TTR, which is
    # fixed at put time from LEASE_TIMEOUT, so the test extends by that amount.
    with override_settings(JOBS={**settings.JOBS, "LEASE_TIMEOUT": 3600}):
        backend = get_backend(backend_case.name)
        env = enqueue(backend, backend_case)
        lease = fetch(backend)
        old_expiry = lease.expires_at

        before = timezone.now()
        backend.extend(lease, 3600)

        assert lease.expires_at >= before + timedelta(seconds=3590)
        assert lease.expires_at >= old_expiry  # equal within a millisecond (Redis scores)
        if backend_case.record:
            row = record(backend_case, backend, env.id)
            assert row.leased_until >= before + timedelta(seconds=3590)
        backend.ack(lease)  # the extended lease is still the owner


def test_extend_and_the_flag_read_say_who_asked_to_abort_the_job_where_one_can_ask(queue_backend, backend_case):
    require_queue(queue_backend)
    env = enqueue(queue_backend, backend_case)
    lease = fetch(queue_backend)
    assert queue_backend.extend(lease, 60) is None  # nobody asked
    assert queue_backend.abort_requested(lease) is None
    expires = lease.expires_at

    try:
        state = Jobs.abort(env.id, "ops")
    except AbortNotSupported:  # a backend that cannot find a job by id is never asked
        asked = None
    else:
        assert state == "aborting"
        asked = "ops"
        again = operations.abort_jobs([env.id], "boss")  # the first request stands
        assert (again.asked, again.already[env.id].by) == ([], "ops")
    assert queue_backend.abort_requested(lease) == asked
    assert lease.expires_at == expires  # the read extends nothing
    assert queue_backend.extend(lease, 60) == asked
    queue_backend.ack(lease)  # the lease is still the owner


@pytest.mark.parametrize("op", ["ack", "nack", "abandon", "extend"])
def test_a_settled_lease_cannot_be_settled_again(queue_backend, backend_case, op):
    require_queue(queue_backend)
    env = enqueue(queue_backend, backend_case, max_retries=3)
    lease = fetch(queue_backend)
    queue_backend.ack(lease)

    with pytest.raises(LeaseLost):
        _settle(queue_backend, lease, op)
    if backend_case.record:
        row = record(backend_case, queue_backend, env.id)
        assert (row.status, row.attempts) == ("completed", 1)


def _settle(backend: QueueBackend, lease: Lease, op: str) -> None:
    if op == "ack":
        backend.ack(lease)
    elif op == "nack":
        backend.nack(lease, 0, error="stale")
    elif op == "abandon":
        backend.abandon(lease, "stale")
    else:
        backend.extend(lease, 3600)


# -- fencing and lease recovery --


@pytest.mark.parametrize("op", ["ack", "nack", "abandon", "extend"])
def test_a_stale_lease_is_fenced_after_redelivery(queue_backend, backend_case, op):
    require_queue(queue_backend)
    env = enqueue(queue_backend, backend_case, max_retries=3)
    stale = fetch(queue_backend)
    reap_now(backend_case, queue_backend, stale)
    current = fetch(queue_backend)
    assert current.envelope.id == env.id and current.owner_token != stale.owner_token
    before = record(backend_case, queue_backend, env.id) if backend_case.record else None

    with pytest.raises(LeaseLost):
        _settle(queue_backend, stale, op)

    # The stale worker changed nothing: the new holder still owns the job and can settle it.
    if before is not None:
        after = record(backend_case, queue_backend, env.id)
        assert (after.status, after.attempts, after.owner_token, after.leased_until, after.last_error) == (
            before.status,
            before.attempts,
            before.owner_token,
            before.leased_until,
            before.last_error,
        )
        assert after.owner_token == current.owner_token
    queue_backend.ack(current)
    assert queue_backend.size("default") == 0


def test_reap_requeues_an_expired_lease_as_a_failed_run(queue_backend, backend_case):
    require_queue(queue_backend)
    env = enqueue(queue_backend, backend_case, max_retries=1)
    lease = fetch(queue_backend)
    expire = require_hook(backend_case, "expire")
    expire(queue_backend, lease)

    assert queue_backend.reap_expired("default") == (0 if queue_backend.native_lease else 1)

    if backend_case.record:
        row = record(backend_case, queue_backend, env.id)
        assert (row.status, row.attempts) == ("pending", 1)
        assert row.last_error.startswith("WorkerLost")
        assert row.owner_token is None
    again = fetch(queue_backend)  # backoff "none": due at once
    assert again.envelope.id == env.id and again.envelope.attempts == 1
    signing.verify(again.envelope)


def test_reap_fails_an_expired_lease_when_retries_are_exhausted(queue_backend, backend_case):
    require_queue(queue_backend)
    env = enqueue(queue_backend, backend_case, max_retries=0)
    lease = fetch(queue_backend)

    reap_now(backend_case, queue_backend, lease)

    assert queue_backend.fetch("default") is None
    assert queue_backend.size("default") == 0
    if backend_case.record:
        row = record(backend_case, queue_backend, env.id)
        assert (row.status, row.attempts) == ("failed", 1)
        assert row.last_error.startswith("WorkerLost")
        assert row.finished_at is not None


def test_ping_changes_nothing(queue_backend, backend_case):
    """The probe a reaper holding back after an outage makes: it answers, and it changes no
    message (a ready one stays ready, a leased one stays leased)."""
    require_queue(queue_backend)
    enqueue(queue_backend, backend_case, max_retries=0)
    enqueue(queue_backend, backend_case, max_retries=0)
    lease = fetch(queue_backend)

    assert queue_backend.ping() is None

    assert queue_backend.size("default") == 2
    other = fetch(queue_backend)
    assert other.envelope.id != lease.envelope.id
    assert queue_backend.fetch("default") is None
    queue_backend.ack(lease)
    queue_backend.ack(other)


def test_reap_never_touches_an_unexpired_lease(queue_backend, backend_case):
    require_queue(queue_backend)
    env = enqueue(queue_backend, backend_case, max_retries=3)
    lease = fetch(queue_backend)  # LEASE_TIMEOUT is 60 s: far from expiring

    assert queue_backend.reap_expired() == 0
    assert queue_backend.reap_expired("default") == 0

    assert queue_backend.fetch("default") is None
    if backend_case.record:
        row = record(backend_case, queue_backend, env.id)
        assert (row.status, row.attempts, row.owner_token) == ("in_progress", 0, lease.owner_token)
    queue_backend.ack(lease)


def test_reap_only_touches_the_queue_it_is_given(queue_backend, backend_case):
    require_queue(queue_backend)
    if queue_backend.native_lease:
        pytest.skip("the broker expires leases itself: reap_expired has nothing to do")
    expire = require_hook(backend_case, "expire")
    enqueue(queue_backend, backend_case, queue="other", max_retries=1)
    enqueue(queue_backend, backend_case, queue="emails", max_retries=1)
    expire(queue_backend, fetch(queue_backend, "other"))
    expire(queue_backend, fetch(queue_backend, "emails"))

    assert queue_backend.reap_expired("default") == 0
    assert queue_backend.reap_expired("other") == 1
    assert queue_backend.fetch("emails") is None  # still leased
    assert queue_backend.reap_expired(None) == 1  # None = every queue
    assert fetch(queue_backend, "emails").envelope.attempts == 1


def test_reap_delays_the_retry_by_the_jobs_backoff(queue_backend, backend_case):
    require_queue(queue_backend)
    if not queue_backend.supports_delay:
        pytest.skip("backend cannot hold a message back")
    env = enqueue(queue_backend, backend_case, max_retries=2, backoff={"strategy": "fixed", "base": 200})
    lease = fetch(queue_backend)
    before = timezone.now()

    reap_now(backend_case, queue_backend, lease)

    # A lost run is a failed run: the retry waits compute_delay(attempts + 2) = 200 s
    # (fixed base 200, under RETRY_BACKOFF_MAX's default 300).
    assert queue_backend.fetch("default") is None
    assert queue_backend.size("default") == 1
    if backend_case.record:
        row = record(backend_case, queue_backend, env.id)
        assert (row.status, row.attempts) == ("pending", 1)
        assert before + timedelta(seconds=199) <= row.available_at <= timezone.now() + timedelta(seconds=201)


@pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)
def test_reap_after_a_short_lease_timeout(queue_backend, backend_case):
    # LEASE_TIMEOUT is read when fetching: a tiny override makes the lease expire for real.
    require_queue(queue_backend)
    if queue_backend.native_lease:
        pytest.skip("the broker expires leases itself: reap_expired has nothing to do")
    with override_settings(JOBS={**settings.JOBS, "LEASE_TIMEOUT": 0.2}):
        backend = get_backend(backend_case.name)
        env = enqueue(backend, backend_case, max_retries=1)
        lease = fetch(backend)
        assert lease.expires_at <= timezone.now() + timedelta(seconds=0.2)
        reaped, deadline = 0, time.monotonic() + 10
        while not reaped and time.monotonic() < deadline:
            reaped = backend.reap_expired("default")
            time.sleep(0.05)
        assert reaped == 1
        again = fetch(backend)
        assert (again.envelope.id, again.envelope.attempts) == (env.id, 1)
        with pytest.raises(LeaseLost):
            backend.ack(lease)
        backend.ack(again)


# -- ordering and exclusivity --


def test_priority_orders_fetches_higher_first_and_fifo_within_a_priority(queue_backend, backend_case):
    require_queue(queue_backend)
    if not queue_backend.supports_priority:
        pytest.skip("backend does not order by priority")
    order = [0, 5, 0, 5, -1, 10, 0]
    sent = [enqueue(queue_backend, backend_case, priority=p).id for p in order]

    fetched = [fetch(queue_backend).envelope.id for _ in order]

    # Stable sort by descending priority = priority first, enqueue order within a priority.
    expected = [job_id for _, job_id in sorted(zip(order, sent, strict=True), key=lambda pair: -pair[0])]
    assert fetched == expected
    assert queue_backend.fetch("default") is None


def test_enqueue_many_keeps_fifo_within_a_priority(queue_backend, backend_case):
    require_queue(queue_backend)
    envs = [make_env(backend_case) for _ in range(8)]  # 8! orders: a lucky pass is ~1 in 40000

    queue_backend.enqueue_many(envs)

    assert [fetch(queue_backend).envelope.id for _ in envs] == [e.id for e in envs]


def test_two_fetches_never_return_the_same_job(queue_backend, backend_case):
    require_queue(queue_backend)
    env = enqueue(queue_backend, backend_case)
    first = fetch(queue_backend)
    assert first.envelope.id == env.id
    assert queue_backend.fetch("default") is None  # the only job is leased

    other = enqueue(queue_backend, backend_case)
    second = fetch(queue_backend)
    assert second.envelope.id == other.id != first.envelope.id
    assert second.owner_token != first.owner_token


@pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)
def test_concurrent_fetchers_never_hold_the_same_job(queue_backend, backend_case):
    require_queue(queue_backend)
    jobs = {enqueue(queue_backend, backend_case).id for _ in range(30)}
    got: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(4)

    def fetcher() -> None:
        try:
            start.wait()
            while (lease := queue_backend.fetch("default")) is not None:
                with lock:
                    got.append(lease.token)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=fetcher) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert not errors, errors
    assert sorted(got) == sorted(jobs)  # every job leased exactly once


@pytest.mark.parametrize("op", ["ack", "nack", "abandon"])
def test_count_run_false_leaves_attempts_unchanged(queue_backend, backend_case, op):
    require_queue(queue_backend)
    env = enqueue(queue_backend, backend_case, max_retries=3)
    lease = fetch(queue_backend)

    if op == "ack":
        queue_backend.ack(lease, count_run=False)
    elif op == "nack":
        queue_backend.nack(lease, 0, count_run=False)
        assert fetch(queue_backend).envelope.attempts == 0
    else:
        queue_backend.abandon(lease, "rejected: nope", count_run=False)

    if backend_case.record:
        assert record(backend_case, queue_backend, env.id).attempts == 0


# -- the worker over each backend (these apply to the sync backend too) --

# A job function and its ``async def`` twin (which records its runs with the async ORM).
FLAVOURS = pytest.mark.parametrize("function", [scripted, scripted_async], ids=["def", "async-def"])


@FLAVOURS
def test_worker_runs_a_job_once_and_acks_it(queue_backend, backend_case, function):
    key = unique()
    env = enqueue(queue_backend, backend_case, key=key, function=function)

    if holds_messages(queue_backend):
        assert runs(backend_case, key) == 0  # nothing runs before a worker fetches it
        worker = QueueWorker(queue_backend, ["default"])
        result = worker.process_once()
        assert (result.status, result.job_id, result.attempt, result.error) == ("acked", env.id, 1, None)
        assert worker.process_once().status == "empty"
    # The sync backend ran it inline, during enqueue.
    assert runs(backend_case, key) == 1
    assert counter("jobs_succeeded") == 1
    if backend_case.record:
        row = record(backend_case, queue_backend, env.id)
        assert (row.status, row.attempts) == ("completed", 1)


@FLAVOURS
def test_worker_retries_then_dead_letters_an_always_failing_job(queue_backend, backend_case, function):
    key = unique()
    # Never raises to the caller, even on the sync backend where it runs inside enqueue().
    env = enqueue(queue_backend, backend_case, key=key, action="raise", max_retries=2, function=function)

    if holds_messages(queue_backend):
        assert drain(queue_backend) == ["requeued", "requeued", "dead-lettered"]
        assert runs(backend_case, key) == 3  # max_retries + 1 runs
        assert counter("jobs_failed_permanently") == 1
    else:
        # One attempt inline, never retried: there is no queue to retry from.
        assert runs(backend_case, key) == 1
        assert queue_backend.fetch("default") is None
    assert counter("jobs_failed") == runs(backend_case, key)
    if backend_case.record:
        row = record(backend_case, queue_backend, env.id)
        assert (row.status, row.attempts) == ("failed", 3)
        assert row.last_error.startswith("RuntimeError: scripted failure")


def test_worker_skips_a_job_whose_idempotency_key_already_succeeded(queue_backend, backend_case):
    key, idem = unique(), unique("idem")
    enqueue(queue_backend, backend_case, key=key, idempotency_key=idem)
    if holds_messages(queue_backend):
        assert drain(queue_backend) == ["acked"]
    duplicate = enqueue(queue_backend, backend_case, key=key, idempotency_key=idem)

    if holds_messages(queue_backend):
        result = QueueWorker(queue_backend, ["default"]).process_once()
        assert (result.status, result.job_id, result.attempt) == ("skipped-idempotent", duplicate.id, 0)
    assert runs(backend_case, key) == 1
    assert counter("jobs_skipped_idempotent") == 1
    if backend_case.record:
        row = record(backend_case, queue_backend, duplicate.id)
        assert (row.status, row.attempts) == ("completed", 0)  # skipped: not a run


def test_worker_rejects_a_tampered_envelope_without_running_it(queue_backend, backend_case):
    key = unique()
    signed = make_env(backend_case, key=key, max_retries=3)
    # Same signature, different payload: what an attacker with write access to the queue sends.
    tampered = replace(
        signed, payload={"args": [], "kwargs": {"action": "raise", "key": key, "db": backend_case.side_effect_db}}
    )
    queue_backend.enqueue(tampered)  # never raises, even where enqueue runs the job

    if holds_messages(queue_backend):
        result = QueueWorker(queue_backend, ["default"]).process_once()
        assert result.status == "rejected" and result.error.startswith("rejected: BadSignature")
        assert queue_backend.fetch("default") is None  # permanent: not requeued despite max_retries
    assert runs(backend_case, key) == 0
    assert counter("jobs_rejected_signature") == 1
    if backend_case.record:
        row = record(backend_case, queue_backend, signed.id)
        assert (row.status, row.attempts) == ("failed", 0)
        assert row.last_error.startswith("rejected:")


def test_worker_rejects_an_unregistered_handler_without_retrying(queue_backend, backend_case):
    env = Envelope(id=uuid.uuid4().hex, handler="os.system", payload={"args": ["true"]}, queue="default", max_retries=5)
    env.signature = signing.sign(env)  # correctly signed: only the handler allowlist stops it
    queue_backend.enqueue(env)

    if holds_messages(queue_backend):
        result = QueueWorker(queue_backend, ["default"]).process_once()
        assert result.status == "rejected" and "HandlerNotAllowed" in result.error
        assert queue_backend.fetch("default") is None
    assert counter("jobs_succeeded") == counter("jobs_failed") == 0
    if backend_case.record:
        row = record(backend_case, queue_backend, env.id)
        assert (row.status, row.attempts) == ("failed", 0)
        assert row.last_error.startswith("rejected:")


def test_worker_reports_lease_lost_when_its_lease_was_reaped(queue_backend, backend_case):
    require_queue(queue_backend)
    key = unique()
    env = enqueue(queue_backend, backend_case, key=key, max_retries=1)
    stale = fetch(queue_backend)
    reap_now(backend_case, queue_backend, stale)

    # The stalled worker finally runs the job, but its ack is fenced off.
    result = QueueWorker(queue_backend, ["default"]).process(stale)

    assert result.status == "lease-lost"
    assert counter("jobs_lease_lost") == 1
    assert runs(backend_case, key) == 1
    if backend_case.record:
        row = record(backend_case, queue_backend, env.id)
        assert (row.status, row.attempts) == ("pending", 1)  # as the reaper left it


def test_permanent_failure_is_recorded_as_a_failed_job_row(queue_backend, backend_case):
    key = unique()
    env = enqueue(queue_backend, backend_case, key=key, action="raise", max_retries=0)
    if holds_messages(queue_backend):
        assert drain(queue_backend) == ["dead-lettered"]
    assert runs(backend_case, key) == 1

    # The database backend's own row, or an audit copy (in the default database) for the others.
    aliases = {getattr(queue_backend, "alias", "default"), "default"}
    rows = [Job.objects.using(alias).filter(pk=env.id).first() for alias in aliases]
    rows = [row for row in rows if row is not None]
    assert len(rows) == 1, "exactly one failed Job row (the backend's own row or an audit copy)"
    assert rows[0].status == "failed" and rows[0].last_error.startswith("RuntimeError: scripted failure")


def test_dispatch_inside_a_transaction_pushes_on_commit_unless_transactional(
    queue_backend, backend_case, django_capture_on_commit_callbacks
):
    key = unique()
    with django_capture_on_commit_callbacks(using="default") as callbacks:
        scripted.using(backend=backend_case.name).dispatch(action="ok", key=key, db=backend_case.side_effect_db)
        if queue_backend.transactional:
            assert queue_backend.size("default") == 1  # same transaction as the caller's data
        else:
            # A worker (or the inline run) must not see the job before the caller commits.
            assert runs(backend_case, key) == 0 and queue_backend.size("default") == 0
    if queue_backend.transactional:
        assert callbacks == []
    else:
        assert len(callbacks) == 1
        callbacks[0]()
    if holds_messages(queue_backend):
        assert drain(queue_backend) == ["acked"]
    assert runs(backend_case, key) == 1


def test_a_tuple_argument_runs_as_the_list_it_arrives_as(
    queue_backend, backend_case, django_capture_on_commit_callbacks
):
    # JSON carries a tuple as a list, and storage may turn 1.0 into 1: the signature covers the
    # tuple as the worker verifies the list (it was once signed as [1.0,2], verified as [1,2]).
    key = unique()
    with django_capture_on_commit_callbacks(using="default", execute=True):
        job_id = scripted.using(backend=backend_case.name).dispatch(
            action="ok", key=key, db=backend_case.side_effect_db, pair=(1.0, 2), nested=[{"t": (0.5, (3.0,))}]
        )
    if holds_messages(queue_backend):
        assert drain(queue_backend) == ["acked"]
    assert runs(backend_case, key) == 1, f"job {job_id} did not run"


@pytest.mark.parametrize("alias", ["default", "postgres"])
@pytest.mark.django_db(databases=["default", "postgres"])
def test_overriding_jobs_inside_a_transaction_keeps_the_database_usable(alias, request):
    if alias == "postgres":
        request.getfixturevalue("postgres_up")
    name = {"default": "default", "postgres": "pg"}[alias]
    get_backend(name).size("default")  # the backend is built and its connection open
    with override_settings(JOBS={**settings.JOBS, "LEASE_TIMEOUT": 5}):
        assert get_backend(name).size("default") == 0
    assert Job.objects.using(alias).count() == 0


# -- ack_and_fetch: settle one message and lease the next (one round trip where pipelined) --


def test_ack_and_fetch_settles_one_and_leases_the_next(queue_backend, backend_case):
    require_queue(queue_backend)
    first, second = enqueue(queue_backend, backend_case), enqueue(queue_backend, backend_case)
    lease = fetch(queue_backend)
    assert lease.envelope.id == first.id

    following = queue_backend.ack_and_fetch(lease, "default")

    assert following is not None and following.envelope is not None
    assert following.envelope.id == second.id
    assert queue_backend.size("default") == 1  # the second, leased
    queue_backend.ack(following)
    assert queue_backend.ack_and_fetch(fetch_again(queue_backend, backend_case), "default") is None


def fetch_again(backend: QueueBackend, case: BackendCase) -> Lease:
    enqueue(backend, case)
    return fetch(backend)


def test_ack_and_fetch_with_a_stale_lease_leases_nothing(queue_backend, backend_case):
    require_queue(queue_backend)
    enqueue(queue_backend, backend_case, max_retries=1)
    lease = fetch(queue_backend)
    queue_backend.ack(lease)
    waiting = enqueue(queue_backend, backend_case)

    with pytest.raises(LeaseLost):
        queue_backend.ack_and_fetch(lease, "default")

    assert fetch(queue_backend).envelope.id == waiting.id  # still there for a worker


def test_a_worker_never_takes_more_jobs_than_max_jobs(queue_backend, backend_case):
    require_queue(queue_backend)
    ids = [enqueue(queue_backend, backend_case).id for _ in range(5)]
    results = []

    QueueWorker(queue_backend, ["default"]).run(max_jobs=3, on_result=results.append, reap=False)

    assert [r.job_id for r in results] == ids[:3]
    assert queue_backend.size("default") == 2  # ready, not leased ahead and left behind
    assert [fetch(queue_backend).envelope.id for _ in range(2)] == ids[3:]


def test_a_stopping_worker_hands_back_the_job_it_leased_ahead(queue_backend, backend_case):
    require_queue(queue_backend)
    ids = [enqueue(queue_backend, backend_case).id for _ in range(3)]
    worker = QueueWorker(queue_backend, ["default"])
    results = []

    def stop_after_first(result):
        results.append(result)
        worker.stop()

    worker.run(on_result=stop_after_first, reap=False)

    assert [r.job_id for r in results] == ids[:1]
    # Both remaining jobs are ready again at once (none left leased until its lease expires),
    # and neither counts a run.
    rest = [fetch(queue_backend).envelope for _ in range(2)]
    assert sorted(env.id for env in rest) == sorted(ids[1:])
    assert [env.attempts for env in rest] == [0, 0]


@pytest.mark.parametrize(
    ("moment", "ran"),
    [(job_started, 0), (post_save, 1)],  # as the run is about to begin; inside it (its side effect's save)
    ids=["about-to-begin", "running"],
)
def test_a_worker_stopped_at_once_hands_back_its_job_uncounted(queue_backend, backend_case, moment, ran):
    """What a second SIGINT does (``QueueWorker.interrupt`` from a signal handler): the run in
    hand ends at once (or does not begin) and its job is ready again, no run counted."""
    require_queue(queue_backend)
    key = unique()
    env = enqueue(queue_backend, backend_case, key=key, action="hang")
    worker = QueueWorker(queue_backend, ["default"], prefetch=1)
    previous = signal.signal(signal.SIGUSR1, lambda *_: worker.interrupt())

    def send(sender: Any, **kwargs: Any) -> None:
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)

    moment.connect(send)
    try:
        results: list[Any] = []
        worker.run(on_result=results.append, reap=False)  # returns: the worker is stopping
    finally:
        moment.disconnect(send)
        signal.signal(signal.SIGUSR1, previous)
    assert [(r.job_id, r.label, r.attempt) for r in results] == [(env.id, "interrupted", 0)]
    assert runs(backend_case, key) == ran
    again = fetch(queue_backend)
    assert (again.envelope.id, again.envelope.attempts) == (env.id, 0)


# -- batches: claimed ahead, acked together (backends with supports_prefetch) --


def require_prefetch(backend: QueueBackend) -> None:
    if not backend.supports_prefetch:
        pytest.skip("backend claims one message at a time")


def test_fetch_many_claims_a_batch_in_fetch_order_each_claimed_ahead(queue_backend, backend_case):
    require_prefetch(queue_backend)
    low = [enqueue(queue_backend, backend_case).id for _ in range(2)]
    high = enqueue(queue_backend, backend_case, priority=5).id

    batch = queue_backend.fetch_many("default", 2)

    assert [lease.envelope.id for lease in batch] == [high, low[0]]
    assert all(lease.ahead and not lease.must_begin for lease in batch)
    assert len({lease.owner_token for lease in batch}) == 1  # one claim, fenced message by message
    assert [lease.envelope.id for lease in queue_backend.fetch_many("default", 5)] == [low[1]]
    assert queue_backend.fetch_many("default", 5) == []
    assert queue_backend.size("default") == 3  # all leased


def test_ack_many_fences_each_message_and_returns_the_lost_ones(queue_backend, backend_case):
    require_prefetch(queue_backend)
    for _ in range(3):
        enqueue(queue_backend, backend_case)
    batch = queue_backend.fetch_many("default", 3)
    queue_backend.ack(batch[1])  # settled already: its ack in the batch is fenced off

    lost = queue_backend.ack_many(batch)

    assert lost == [batch[1]]
    assert queue_backend.size("default") == 0
    assert queue_backend.ack_many([]) == []


def test_ack_many_and_fetch_acks_a_batch_and_claims_the_next(queue_backend, backend_case):
    require_prefetch(queue_backend)
    ids = [enqueue(queue_backend, backend_case).id for _ in range(4)]
    first = queue_backend.fetch_many("default", 2)

    lost, following = queue_backend.ack_many_and_fetch(first, "default", 5)

    assert lost == []
    assert [lease.envelope.id for lease in following] == ids[2:]
    assert queue_backend.size("default") == 2  # the first two are gone, the others leased
    if backend_case.record:
        assert [record(backend_case, queue_backend, i).status for i in ids] == ["completed"] * 2 + ["in_progress"] * 2
        assert record(backend_case, queue_backend, ids[0]).attempts == 1


def test_settle_many_requeues_failed_runs_with_the_acks(queue_backend, backend_case):
    """``settle_many(acks, begun, requeues)``: a requeued run comes back with one more attempt
    and still verifies; a requeue whose lease is not ours is fenced off (``False``)."""
    require_prefetch(queue_backend)
    _, failed, _ = (enqueue(queue_backend, backend_case, max_retries=2) for _ in range(3))
    batch = queue_backend.fetch_many("default", 3)
    stale = replace(batch[2], owner_token="0" * 32)
    now = time.time()

    requeues = [Requeue(batch[1], now, "RuntimeError: again"), Requeue(stale, now, "RuntimeError: not ours")]
    assert queue_backend.settle_many([batch[0]], (), requeues) == ([], [True, False])

    [again] = queue_backend.fetch_many("default", 5)
    assert (again.envelope.id, again.envelope.attempts) == (failed.id, 1)
    signing.verify(again.envelope)
    assert queue_backend.size("default") == 2  # the requeued run and the one still leased
    if backend_case.record:
        row = record(backend_case, queue_backend, failed.id)
        assert (row.attempts, row.last_error) == (1, "RuntimeError: again")


def test_settle_many_and_fetch_may_claim_the_run_it_requeued(queue_backend, backend_case):
    require_prefetch(queue_backend)
    env = enqueue(queue_backend, backend_case, max_retries=1)
    [first] = queue_backend.fetch_many("default", 1)

    lost, done, claimed = queue_backend.settle_many_and_fetch(
        [], [Requeue(first, time.time(), "RuntimeError: again")], "default", 5
    )

    assert (lost, done) == ([], [True])
    assert [(lease.envelope.id, lease.envelope.attempts) for lease in claimed] == [(env.id, 1)]


def test_ack_many_records_the_starts_of_runs_begun_so_their_loss_counts(queue_backend, backend_case):
    """``ack_many(acks, begun)``: the acks, and the starts of runs claimed ahead that began
    meanwhile. A begun run's lost lease is a counted run; an unstarted claim's is not."""
    require_prefetch(queue_backend)
    expire = require_hook(backend_case, "expire")
    done, running, waiting = (enqueue(queue_backend, backend_case, max_retries=0) for _ in range(3))
    batch = queue_backend.fetch_many("default", 3)
    assert [lease.envelope.id for lease in batch] == [done.id, running.id, waiting.id]

    assert queue_backend.ack_many([batch[0]], begun=[batch[1]]) == []
    stale = replace(batch[2], owner_token="0" * 32)
    assert queue_backend.ack_many([], begun=[stale]) == []  # fenced: a lease not ours is left alone

    for lease in batch[1:]:
        expire(queue_backend, lease)
    assert queue_backend.reap_expired("default") == 2
    # The begun run was lost: counted (no retries left: failed). The other goes back uncounted.
    assert [(a.attempt, a.outcome) for a in history_of(queue_backend, running.id)] == [(1, "lost")]
    [again] = queue_backend.fetch_many("default", 5)
    assert (again.envelope.id, again.envelope.attempts, again.must_begin) == (waiting.id, 0, True)


def lose_a_claim_ahead(backend: QueueBackend, case: BackendCase, **options: Any) -> Envelope:
    """A job claimed ahead whose worker died with it: its lease expires and is reaped."""
    require_prefetch(backend)
    expire = require_hook(case, "expire")
    env = enqueue(backend, case, **options)
    [lease] = backend.fetch_many("default", 5)
    expire(backend, lease)
    assert backend.reap_expired("default") == 1
    return env


def test_a_lost_claim_ahead_is_handed_back_uncounted_then_begun_before_its_run(queue_backend, backend_case):
    env = lose_a_claim_ahead(queue_backend, backend_case, max_retries=0)
    expire = require_hook(backend_case, "expire")

    # Its worker died with it claimed ahead: no run is counted, none enters the history, and
    # with no retries left it is still pending, its next claim marked to be begun.
    [again] = queue_backend.fetch_many("default", 5)
    assert again.envelope.id == env.id and again.envelope.attempts == 0
    assert again.must_begin
    assert history_of(queue_backend, env.id) == []
    queue_backend.begin(again, 30)
    assert not again.must_begin
    # Begun, it is running: a lost lease from here on is a lost run (no retries left: failed).
    expire(queue_backend, again)
    assert queue_backend.reap_expired("default") == 1
    [attempt] = history_of(queue_backend, env.id)
    assert (attempt.attempt, attempt.outcome) == (1, "lost")
    assert queue_backend.fetch_many("default", 5) == []


def test_a_job_whose_counted_run_was_lost_is_begun_before_its_next_run(queue_backend, backend_case):
    """A job that crashes its host within an ack interval of every start: its first crash is
    handed back uncounted (its start was not written yet), every later one counts. After a
    counted loss too, its next claim ahead records its start before it runs, so no other crash
    goes uncounted (a red team saw every other crash uncounted: 4 runs for ``max_retries=1``)."""
    env = lose_a_claim_ahead(queue_backend, backend_case, max_retries=3)
    expire = require_hook(backend_case, "expire")
    for attempts in range(3):
        [again] = queue_backend.fetch_many("default", 5)
        assert (again.envelope.attempts, again.must_begin) == (attempts, True)
        queue_backend.begin(again, 30)
        expire(queue_backend, again)  # its worker dies with it running: a lost run, counted
        assert queue_backend.reap_expired("default") == 1
    assert [a.outcome for a in history_of(queue_backend, env.id)] == ["lost"] * 3


def test_lost_claims_are_recovered_at_once_counting_only_the_job_in_hand(queue_backend, backend_case):
    require_prefetch(queue_backend)
    envs = [enqueue(queue_backend, backend_case, max_retries=1) for _ in range(3)]
    other = enqueue(queue_backend, backend_case)
    batch = queue_backend.fetch_many("default", 3)
    [elsewhere] = queue_backend.fetch_many("default", 3)  # another worker's claim: untouched

    queue_backend.lose_claims("default", batch[0].owner_token, [batch[1].token])

    assert queue_backend.reap_expired("default") == 3
    redelivered = {lease.envelope.id: lease for lease in queue_backend.fetch_many("default", 5)}
    assert sorted(redelivered) == sorted(env.id for env in envs)
    assert [a.outcome for a in history_of(queue_backend, envs[1].id)] == ["lost"]
    # Each is begun before its next run: its lost run counted, or not.
    assert {env.id: (redelivered[env.id].envelope.attempts, redelivered[env.id].must_begin) for env in envs} == {
        envs[0].id: (0, True),
        envs[1].id: (1, True),
        envs[2].id: (0, True),
    }
    queue_backend.ack(elsewhere)  # still held by its own claim
    assert elsewhere.envelope.id == other.id


def test_lost_claims_count_the_job_in_hand_and_the_failed_runs_not_written(queue_backend, backend_case):
    """A worker process died with its job in hand and failed runs whose requeues waited for its
    batch's write: each of them counts a lost run, the job claimed ahead and not run does not."""
    require_prefetch(queue_backend)
    envs = [enqueue(queue_backend, backend_case, max_retries=1) for _ in range(3)]
    batch = queue_backend.fetch_many("default", 3)

    queue_backend.lose_claims("default", batch[0].owner_token, [batch[2].token, batch[0].token])

    assert queue_backend.reap_expired("default") == 3
    redelivered = {lease.envelope.id: lease for lease in queue_backend.fetch_many("default", 5)}
    assert {env.id: redelivered[env.id].envelope.attempts for env in envs} == {
        envs[0].id: 1,
        envs[1].id: 0,
        envs[2].id: 1,
    }
    assert [a.outcome for a in history_of(queue_backend, envs[0].id)] == ["lost"]
    assert history_of(queue_backend, envs[1].id) == []


def test_recovered_claims_ack_the_successes_whose_acks_waited(queue_backend, backend_case):
    """A worker process died with successes whose acks waited for its batch's write: its
    supervisor acks them, fenced by the dead claim's owner token, so they never run again; a
    token the dead process no longer held (another worker's claim now) is left alone."""
    require_prefetch(queue_backend)
    envs = [enqueue(queue_backend, backend_case, max_retries=1) for _ in range(3)]
    other = enqueue(queue_backend, backend_case)
    batch = queue_backend.fetch_many("default", 3)
    [elsewhere] = queue_backend.fetch_many("default", 3)

    recover_claims(queue_backend, "default", batch[0].owner_token, [batch[1].token], [batch[0].token, elsewhere.token])

    redelivered = {lease.envelope.id: lease for lease in queue_backend.fetch_many("default", 5)}
    assert {env.id: redelivered[env.id].envelope.attempts for env in envs[1:]} == {envs[1].id: 1, envs[2].id: 0}
    assert envs[0].id not in redelivered  # acked: it never runs again
    assert history_of(queue_backend, envs[0].id) == []  # a success, not a lost run
    if backend_case.record:
        row = record(backend_case, queue_backend, envs[0].id)
        assert (row.status, row.attempts) == ("completed", 1)
    queue_backend.ack(elsewhere)  # still held by its own claim
    assert elsewhere.envelope.id == other.id


def test_extend_ahead_keeps_the_claims_ahead_and_leaves_a_lost_one_alone(queue_backend, backend_case):
    require_prefetch(queue_backend)
    envs = [enqueue(queue_backend, backend_case) for _ in range(3)]
    batch = queue_backend.fetch_many("default", 3)
    reap_now(backend_case, queue_backend, batch[1])  # lost: handed back, then claimed elsewhere
    [elsewhere] = queue_backend.fetch_many("default", 3)
    assert elsewhere.envelope.id == envs[1].id
    before = [lease.expires_at for lease in batch]

    queue_backend.extend_ahead(batch, 120)

    assert batch[0].expires_at > before[0] and batch[2].expires_at > before[2]
    assert batch[1].expires_at == before[1]  # lost: not extended, no error
    for lease in (batch[0], batch[2], elsewhere):
        queue_backend.ack(lease)  # each still held by its own claim


def test_release_hands_a_claimed_job_back_uncounted(queue_backend, backend_case):
    require_prefetch(queue_backend)
    first, second = enqueue(queue_backend, backend_case), enqueue(queue_backend, backend_case)
    [lease] = queue_backend.fetch_many("default", 1)
    before = record(backend_case, queue_backend, first.id).available_at if backend_case.record else None

    queue_backend.release(lease)

    with pytest.raises(LeaseLost):
        queue_backend.release(lease)  # fenced: it is no longer held
    again = {lease.envelope.id: lease for lease in queue_backend.fetch_many("default", 5)}
    assert set(again) == {first.id, second.id}
    assert again[first.id].envelope.attempts == 0 and not again[first.id].must_begin
    if backend_case.record:  # the database keeps its place: the same available_at, first again
        row = record(backend_case, queue_backend, first.id)
        assert (row.available_at, row.claimed_ahead) == (before, 1)
        assert next(iter(again)) == first.id


def test_begin_is_fenced(queue_backend, backend_case):
    require_prefetch(queue_backend)
    enqueue(queue_backend, backend_case)
    [lease] = queue_backend.fetch_many("default", 1)
    queue_backend.ack(lease)

    with pytest.raises(LeaseLost):
        queue_backend.begin(lease, 30)


def test_a_claim_of_one_job_alone_is_started_at_once(queue_backend, backend_case):
    """``fetch`` (a worker with PREFETCH 1) claims nothing ahead: its loss is a lost run."""
    env = lose_a_claim_ahead(queue_backend, backend_case, max_retries=1)  # marked to be begun
    expire = require_hook(backend_case, "expire")

    lease = fetch(queue_backend)
    expire(queue_backend, lease)
    queue_backend.reap_expired("default")

    assert fetch(queue_backend).envelope.attempts == 1
    assert [a.outcome for a in history_of(queue_backend, env.id)] == ["lost"]


@pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)
def test_a_batching_worker_runs_every_job_once_and_acks_it(queue_backend, backend_case):
    require_prefetch(queue_backend)
    keys = [unique() for _ in range(7)]
    envs = [enqueue(queue_backend, backend_case, key=key) for key in keys]
    results = []

    done = QueueWorker(queue_backend, ["default"], prefetch=3).run(once=False, max_jobs=7, on_result=results.append)

    assert done == 7
    assert [r.job_id for r in results] == [e.id for e in envs]
    assert {r.status for r in results} == {"acked"}
    assert [runs(backend_case, key) for key in keys] == [1] * 7
    assert queue_backend.size("default") == 0
    if backend_case.record:
        rows = [record(backend_case, queue_backend, e.id) for e in envs]
        assert {(row.status, row.attempts) for row in rows} == {("completed", 1)}


@pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)
def test_a_stopping_batching_worker_hands_back_its_claims_uncounted(queue_backend, backend_case):
    require_prefetch(queue_backend)
    ids = [enqueue(queue_backend, backend_case).id for _ in range(6)]
    worker = QueueWorker(queue_backend, ["default"], prefetch=4)
    results = []

    def stop_after_two(result):
        results.append(result)
        if len(results) == 2:
            worker.stop()

    worker.run(on_result=stop_after_two, reap=False)

    assert [r.job_id for r in results] == ids[:2]
    rest = [fetch(queue_backend).envelope for _ in range(4)]
    assert sorted(env.id for env in rest) == sorted(ids[2:])  # the two claimed ahead are ready again
    assert [env.attempts for env in rest] == [0] * 4


@pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)
def test_a_lease_lost_before_its_batched_ack_is_counted_and_the_job_kept(queue_backend, backend_case, monkeypatch):
    require_prefetch(queue_backend)
    expire = require_hook(backend_case, "expire")
    # The acks wait for the run's end, whatever the machine's load: not for the heartbeat's
    # write, 50 ms after the claim, which a loaded machine can reach before the signal below.
    monkeypatch.setattr(Batches, "_watch_later", lambda self, delay=0.0: None)
    env = enqueue(queue_backend, backend_case)
    enqueue(queue_backend, backend_case)
    before = counter("jobs_lease_lost")

    def reaped_meanwhile(sender: Any, envelope: Envelope, **kwargs: Any) -> None:
        if envelope.id == env.id:  # its ack waits in the batch: the lease is lost before it is written
            lease = Lease(token=env.id, owner_token="", expires_at=timezone.now(), queue="default")
            expire(queue_backend, lease)
            queue_backend.reap_expired("default")

    job_succeeded.connect(reaped_meanwhile)
    try:
        QueueWorker(queue_backend, ["default"], prefetch=2).run(max_jobs=2, reap=False)
    finally:
        job_succeeded.disconnect(reaped_meanwhile)

    assert counter("jobs_lease_lost") == before + 1
    again = fetch(queue_backend)  # handed back by the reaper: it runs again, never lost
    assert again.envelope.id == env.id


def sleeper(case: BackendCase, key: str, seconds: float) -> Envelope:
    builder = scripted.using(backoff={"strategy": "none"}).builder(
        action="sleep", key=key, db=case.side_effect_db, seconds=seconds
    )
    return builder.build()


@pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)
def test_a_success_is_acked_within_a_moment_even_while_a_long_job_follows(queue_backend, backend_case):
    require_prefetch(queue_backend)
    quick = enqueue(queue_backend, backend_case)
    slow = sleeper(backend_case, unique(), 0.1)
    queue_backend.enqueue(slow)
    seen = []

    def when_slow_starts(sender: Any, envelope: Envelope, **kwargs: Any) -> None:
        if envelope.id == slow.id:  # the quick job's ack waits in the batch: the heartbeat writes it
            time.sleep(0.5)
            seen.append(queue_backend.size("default"))

    job_started.connect(when_slow_starts)
    try:
        QueueWorker(queue_backend, ["default"], prefetch=2).run(max_jobs=2, reap=False)
    finally:
        job_started.disconnect(when_slow_starts)

    assert seen == [1], "only the slow job is still held: the quick one's ack was written"
    assert quick.id != slow.id and queue_backend.size("default") == 0


@pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)
def test_jobs_claimed_behind_a_long_job_are_handed_back_for_other_workers(queue_backend, backend_case):
    require_prefetch(queue_backend)
    slow = sleeper(backend_case, unique(), 1.5)  # longer than HAND_BACK_AFTER
    queue_backend.enqueue(slow)
    keys = [unique(), unique()]
    for key in keys:
        enqueue(queue_backend, backend_case, key=key)
    owners = {}

    def record_owner(sender: Any, envelope: Envelope, context: Any, **kwargs: Any) -> None:
        owners[envelope.id] = context.lease.owner_token

    job_started.connect(record_owner)
    try:
        results = []
        QueueWorker(queue_backend, ["default"], prefetch=3).run(max_jobs=3, reap=False, on_result=results.append)
    finally:
        job_started.disconnect(record_owner)

    assert [r.status for r in results] == ["acked"] * 3
    assert [runs(backend_case, key) for key in keys] == [1, 1]
    # Claimed in the slow job's batch, then handed back while it ran, and claimed again after.
    others = [owner for job_id, owner in owners.items() if job_id != slow.id]
    assert len(others) == 2 and owners[slow.id] not in others
    assert queue_backend.size("default") == 0


@pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)
def test_jobs_claimed_ahead_stay_leased_while_a_long_job_runs(queue_backend, backend_case):
    """The job runs longer than a lease (but not long enough for its batch to be handed back),
    with a reaper at work: the job claimed after it is kept leased by the heartbeat."""
    require_prefetch(queue_backend)
    slow, quick = unique(), unique()
    queue_backend.enqueue(sleeper(backend_case, slow, 0.9))
    enqueue(queue_backend, backend_case, key=quick)
    results, done = [], threading.Event()

    def reap_meanwhile() -> None:
        try:
            while not done.is_set():
                queue_backend.reap_expired("default")
                done.wait(0.05)
        finally:
            connections.close_all()  # this thread's own

    with override_settings(JOBS={**settings.JOBS, "LEASE_TIMEOUT": 0.45}):
        reaper = threading.Thread(target=reap_meanwhile)
        reaper.start()
        try:
            QueueWorker(queue_backend, ["default"], prefetch=2).run(max_jobs=2, on_result=results.append, reap=False)
        finally:
            done.set()
            reaper.join()

    assert [r.status for r in results] == ["acked", "acked"]
    assert (runs(backend_case, slow), runs(backend_case, quick)) == (1, 1)


# -- attempt history and kept results --


def history_of(backend: QueueBackend, job_id: str) -> list[JobAttempt]:
    return attempts_of(job_id, using=backend.history_alias)


def test_each_failed_attempt_enters_the_history_with_its_error(queue_backend, backend_case):
    env = enqueue(queue_backend, backend_case, key=unique(), action="raise", max_retries=2)
    if holds_messages(queue_backend):
        drain(queue_backend)
        expected = [(1, "retrying"), (2, "retrying"), (3, "failed")]
    else:  # the sync backend runs it once, inline, and never retries
        expected = [(1, "failed")]

    attempts = history_of(queue_backend, env.id)
    assert [(a.attempt, a.outcome) for a in attempts] == expected
    for attempt in attempts:
        assert attempt.error_class == "builtins.RuntimeError"
        assert attempt.error.startswith("RuntimeError: scripted failure")
        assert attempt.worker_id == history.worker_id()
        assert attempt.started_at is not None and attempt.started_at <= attempt.finished_at


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "batched"])
def test_an_error_no_database_can_store_is_kept_with_replacement_characters(queue_backend, backend_case, batched):
    # A message with U+0000 (PostgreSQL refuses it) and a lone surrogate (no UTF-8 encoder takes
    # it): written as it is, the settle failed like an outage, for ever, and held up its batch.
    env = enqueue(queue_backend, backend_case, key=unique(), action="unstorable", max_retries=1)
    if holds_messages(queue_backend):
        if batched:
            assert QueueWorker(queue_backend, ["default"]).run(max_jobs=2, sleep=0.01, reap=False, max_time=30) == 2
        else:
            assert drain(queue_backend) == ["requeued", "dead-lettered"]
        expected = [(1, "retrying"), (2, "failed")]
    else:
        expected = [(1, "failed")]
    attempts = history_of(queue_backend, env.id)
    assert [(a.attempt, a.outcome) for a in attempts] == expected
    text = "RuntimeError: nul \ufffd and half \ufffd a pair"
    assert all(a.error.startswith(text) for a in attempts)
    if backend_case.record:
        assert record(backend_case, queue_backend, env.id).last_error.startswith(text)


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "batched"])
def test_a_kept_result_no_database_can_store_fails_the_job_without_wedging_it(queue_backend, backend_case, batched):
    # Written as it is, PostgreSQL's jsonb refused the ack's result (U+0000, a lone surrogate's
    # escape) and the worker retried the ack as an outage, for ever.
    env = enqueue(queue_backend, backend_case, key=unique(), action="return_unstorable", keep_result=True)
    if holds_messages(queue_backend):
        if batched:
            assert QueueWorker(queue_backend, ["default"]).run(max_jobs=1, sleep=0.01, reap=False, max_time=30) == 1
        else:
            assert drain(queue_backend) == ["dead-lettered"]
    [attempt] = history_of(queue_backend, env.id)
    assert (attempt.outcome, attempt.error_class) == ("failed", "django_jobs.exceptions.InvalidPayload")
    assert "the job's return value cannot be kept: payload contains U+0000" in attempt.error
    if backend_case.record:
        assert record(backend_case, queue_backend, env.id).status == "failed"


def test_a_success_writes_no_history_unless_the_job_keeps_its_result(queue_backend, backend_case):
    plain = enqueue(queue_backend, backend_case, key=unique())
    kept = (
        scripted.using(keep_result=True, max_retries=1, backoff={"strategy": "none"})
        .builder(action="flaky", key=unique(), fail_times=1, db=backend_case.side_effect_db)
        .build()
    )
    queue_backend.enqueue(kept)
    if holds_messages(queue_backend):
        assert drain(queue_backend) == ["acked", "requeued", "acked"]
        assert [a.outcome for a in history_of(queue_backend, kept.id)] == ["retrying", "completed"]
    else:  # inline, once: the flaky job's first run fails
        assert [a.outcome for a in history_of(queue_backend, kept.id)] == ["failed"]

    assert history_of(queue_backend, plain.id) == []
    if holds_messages(queue_backend):
        # The backend's own row, or a completed audit copy for the brokers.
        alias = getattr(queue_backend, "alias", "default")
        row = Job.objects.using(alias).get(pk=kept.id)
        assert (row.status, row.result) == ("completed", "flaky")  # what scripted() returned


def test_a_lost_run_enters_the_history(queue_backend, backend_case):
    require_queue(queue_backend)
    received = []
    env = enqueue(queue_backend, backend_case, max_retries=1)
    lease = fetch(queue_backend)

    def on_reaped(sender: Any, **kwargs: Any) -> None:
        received.append((kwargs["job_id"], kwargs["attempt"], kwargs["failed"]))

    job_reaped.connect(on_reaped)
    try:
        reap_now(backend_case, queue_backend, lease)
        if queue_backend.native_lease:  # the broker redelivers; the next fetch sees the lost run
            fetch(queue_backend)
    finally:
        job_reaped.disconnect(on_reaped)

    [attempt] = history_of(queue_backend, env.id)
    assert (attempt.attempt, attempt.outcome, attempt.error_class) == (1, "lost", "django_jobs.exceptions.WorkerLost")
    assert attempt.error.startswith("WorkerLost")
    assert received == [(env.id, 1, False)]


@pytest.mark.django_db
def test_the_history_keeps_the_newest_history_limit_attempts():
    backend = get_backend("default")
    with override_settings(JOBS={**settings.JOBS, "HISTORY_LIMIT": 2}):
        env = scripted.using(max_retries=3, backoff={"strategy": "none"}).builder(action="raise").build()
        backend.enqueue(env)
        assert drain(backend) == ["requeued", "requeued", "requeued", "dead-lettered"]
        assert [(a.attempt, a.outcome) for a in history_of(backend, env.id)] == [(3, "retrying"), (4, "failed")]
    with override_settings(JOBS={**settings.JOBS, "HISTORY_LIMIT": 0}):
        env = scripted.using(max_retries=1, backoff={"strategy": "none"}).builder(action="raise").build()
        backend.enqueue(env)
        drain(backend)
        assert history_of(backend, env.id) == []


@pytest.mark.django_db
def test_a_return_value_that_is_not_json_fails_a_job_that_keeps_its_result(monkeypatch):
    backend = get_backend("default")
    env = scripted.using(keep_result=True).builder(action="ok").build()
    backend.enqueue(env)
    monkeypatch.setattr("tests.testapp.jobs.scripted.func", lambda **kwargs: object())

    [status] = drain(backend)

    assert status == "dead-lettered"
    row = Job.objects.get(pk=env.id)
    assert row.status == "failed" and "the job's return value cannot be kept" in row.last_error
    assert [a.error_class for a in history_of(backend, env.id)] == ["django_jobs.exceptions.InvalidPayload"]


def test_the_run_loop_keeps_results_acked_together_with_the_next_fetch(queue_backend, backend_case):
    require_queue(queue_backend)
    envs = [
        scripted.using(keep_result=True).builder(action=f"value-{n}", db=backend_case.side_effect_db).build()
        for n in range(3)
    ]
    for env in envs:
        queue_backend.enqueue(env)

    # run() acks each job together with the fetch of the next where the backend can.
    assert QueueWorker(queue_backend, ["default"]).run(max_jobs=3, reap=False) == 3

    alias = getattr(queue_backend, "alias", "default")
    results = dict(Job.objects.using(alias).filter(pk__in=[e.id for e in envs]).values_list("pk", "result"))
    assert results == {env.id: f"value-{n}" for n, env in enumerate(envs)}


def test_a_kept_result_is_kept_before_the_ack_that_forgets_the_message(queue_backend, backend_case, monkeypatch):
    """A worker killed between the ack and the keeping of the result lost the job whole on a
    broker (a red team SIGKILLed Redis workers: the killed process's last job, acked, had no
    row, no result and no message left). The result is kept first: a death between the two
    leaves it, and the job to run again."""
    require_queue(queue_backend)
    env = scripted.using(keep_result=True).builder(action="kept", db=backend_case.side_effect_db).build()
    queue_backend.enqueue(env)
    at_ack = []
    ack = queue_backend.ack

    def observed_ack(lease: Lease, **kwargs: Any) -> None:
        at_ack.append(queue_backend.stored_result(lease.envelope.id))
        ack(lease, **kwargs)

    monkeypatch.setattr(queue_backend, "ack", observed_ack)

    assert drain(queue_backend) == ["acked"]

    # The database backend writes it with the ack itself, in the job's own row.
    assert at_ack == [None if queue_backend.transactional else "kept"]
    assert queue_backend.stored_result(env.id) == "kept"


def test_a_kept_result_keeps_its_floats(queue_backend, backend_case, monkeypatch):
    # PostgreSQL's jsonb would read 1e20 back as the int 100000000000000000000.
    require_queue(queue_backend)
    env = scripted.using(keep_result=True).builder(action="ok", db=backend_case.side_effect_db).build()
    queue_backend.enqueue(env)
    monkeypatch.setattr("tests.testapp.jobs.scripted.func", lambda **kwargs: [1e20, 1.5e300, 0.5])

    assert drain(queue_backend) == ["acked"]

    alias = getattr(queue_backend, "alias", "default")
    result = Job.objects.using(alias).get(pk=env.id).result
    assert result == [1e20, 1.5e300, 0.5] and {type(x) for x in result} == {float}, result


@contextlib.contextmanager
def postgres_sql() -> Iterator[list[str]]:
    """The SQL sent on the ``postgres`` alias inside the block, in order."""
    seen: list[str] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    with connections["postgres"].execute_wrapper(record):
        yield seen


def _queue_statements(backend: QueueBackend) -> list[str]:
    """The SQL of one fetch and one ack on ``backend``."""
    backend.enqueue(scripted.builder(action="ok").build())
    with postgres_sql() as seen:
        lease = backend.fetch("default")
        assert lease is not None
        backend.ack(lease)
    return seen


@pytest.mark.postgres
@pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)
def test_postgres_queue_statements_commit_asynchronously_and_only_themselves(postgres_up):
    seen = _queue_statements(get_backend("pg"))

    assert len(seen) == 2 and all(sql.endswith("; SET LOCAL synchronous_commit = off") for sql in seen)
    with connections["postgres"].cursor() as cursor:  # the session's own setting is untouched
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "on"


@pytest.mark.postgres
@pytest.mark.django_db(databases=ALL_DATABASES)
def test_postgres_queue_statements_in_the_callers_transaction_stay_synchronous(postgres_up):
    # The test's own transaction: a SET LOCAL would change how the caller's transaction commits.
    assert not any("synchronous_commit" in sql for sql in _queue_statements(get_backend("pg")))


@pytest.mark.postgres
@pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)
def test_postgres_async_commit_can_be_turned_off(postgres_up):
    config = {"ENGINE": "database", "OPTIONS": {"DATABASE": "postgres", "ASYNC_COMMIT": False}}
    with override_settings(JOBS={**settings.JOBS, "BACKENDS": {**settings.JOBS["BACKENDS"], "pg": config}}):
        assert not any("synchronous_commit" in sql for sql in _queue_statements(get_backend("pg")))


def _two_jobs_acked_together(backend: QueueBackend) -> list[str]:
    """Enqueue two jobs, fetch one, ack it together with the fetch of the other; the SQL sent."""
    for _ in range(2):
        backend.enqueue(scripted.builder(action="ok").build())
    lease = backend.fetch("default")
    assert lease is not None
    with postgres_sql() as seen:
        following = backend.ack_and_fetch(lease, "default")
    assert following is not None
    backend.ack(following)
    return seen


@pytest.mark.postgres
@pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)
def test_postgres_ack_and_fetch_runs_a_statement_prepared_once_per_connection(postgres_up):
    backend = get_backend("pg")
    first = _two_jobs_acked_together(backend)
    second = _two_jobs_acked_together(backend)

    # One query either way: the statement's PREPARE rides in front of its first EXECUTE.
    assert [sql.split()[0] for sql in first] in (["PREPARE"], ["EXECUTE"])
    assert first[0].startswith("EXECUTE") or "; EXECUTE " in first[0]
    assert [sql.split()[0] for sql in second] == ["EXECUTE"]  # prepared already: run, not planned again


@pytest.mark.postgres
@pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)
def test_postgres_a_lost_prepared_statement_falls_back_to_plain_sql(postgres_up, caplog):
    backend = get_backend("pg")
    _two_jobs_acked_together(backend)
    with connections["postgres"].cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")  # what a pooler in transaction mode does to us

    try:
        seen = _two_jobs_acked_together(backend)

        assert seen[0].startswith("EXECUTE") and seen[-1].startswith("WITH done AS")
        assert not backend.prepare and "no longer preparing" in caplog.text
        assert Job.objects.using("postgres").filter(status="completed").count() == 4
    finally:
        backend.prepare = True  # the backend instance is cached for the other tests


@pytest.mark.postgres
@pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)
def test_postgres_a_committed_dispatch_notifies_listening_workers(postgres_up):
    backend = get_backend("pg")
    connection = connections["postgres"]
    listener = connection.get_new_connection(connection.get_connection_params())
    try:
        listener.autocommit = True
        listener.execute("LISTEN django_jobs")
        with transaction.atomic(using="postgres"):
            backend.enqueue(scripted.builder(action="ok").build())
            assert list(listener.notifies(timeout=0.01)) == []  # nothing before the commit
        [notice] = list(listener.notifies(timeout=30, stop_after=1))
        assert notice.channel == "django_jobs"
    finally:
        listener.close()


@pytest.mark.postgres
@pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)
@pytest.mark.parametrize("in_a_transaction", [False, True], ids=["autocommit", "in-a-transaction"])
def test_postgres_the_listen_probe_notifies_on_the_open_connection_outside_a_transaction(
    postgres_up, monkeypatch, in_a_transaction
):
    """At a worker's start the migrations check has left Django's connection open: the probe's
    NOTIFY goes on it, and only the LISTEN needs a connection of its own. In a transaction the
    NOTIFY would wait for the commit: it takes a connection of its own too."""
    from django_jobs.backends import db_listen

    opened: list[str] = []
    connect = db_listen._connect
    monkeypatch.setattr(db_listen, "_connect", lambda alias: opened.append(alias) or connect(alias))
    monkeypatch.setattr(db_listen, "_HELD", {})
    connections["postgres"].ensure_connection()
    with transaction.atomic(using="postgres") if in_a_transaction else contextlib.nullcontext():
        assert db_listen.Listener("pg", "postgres", "postgres").held() is True
    assert opened == ["postgres", "postgres"] if in_a_transaction else opened == ["postgres"]


@pytest.mark.postgres
@pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)
def test_postgres_an_idle_worker_wakes_for_a_job_dispatched_elsewhere(postgres_up):
    backend = get_backend("pg")
    assert backend.fetch("default") is None
    backend.wait_for_work(["default"], 0)  # listening from now on
    dispatched: list[str] = []

    def dispatch_elsewhere() -> None:
        try:
            env = scripted.builder(action="ok").build()
            get_backend("pg").enqueue(env)  # this thread's own connection, autocommit
            dispatched.append(env.id)
        finally:
            connections.close_all()

    thread = threading.Thread(target=dispatch_elsewhere)
    thread.start()
    try:
        assert backend.wait_for_work(["default"], 60) is True
    finally:
        thread.join()
        backend.close()
    lease = backend.fetch("default")
    assert lease is not None and [lease.token] == dispatched
    backend.ack(lease)
