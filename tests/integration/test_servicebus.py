"""Service Bus specific behaviour of the servicebus backend, on the in-memory namespace.

The protocol itself (fetch, ack, nack, abandon, extend, fencing, lost leases, FIFO, the worker
over the backend) is covered by tests/integration/test_conformance.py, case ``servicebus``. This
file covers what only Service Bus has, with the real backend and the fake SDK clients of
tests/fake_servicebus.py:

- the fakes still match the installed SDK (drift guard on every faked signature);
- nack's order (copy sent, then the original completed) and what a failure in between leaves;
- lock loss and settled messages raising LeaseLost;
- ``delivery_count`` counted as lost runs, backoff after a lost run, dead-lettering without a
  run once retries are spent, and Azure's own MaxDeliveryCount;
- abandon to the native dead-letter sub-queue plus a failed Job row; garbage bodies;
- the system check on MaxDeliveryCount; close(); the missing extra; credentials; waiting.

No emulator runs here. To run the conformance suite against a real namespace, set
``JOBS_TEST_SERVICEBUS_CONNECTION_STRING`` (see ``_live_namespace`` in tests/fake_servicebus.py).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from django.utils import timezone
from django.utils.module_loading import import_string

from django_jobs import signing
from django_jobs.backends import get_backend
from django_jobs.backends.servicebus import ServiceBusBackend
from django_jobs.envelope import Envelope
from django_jobs.exceptions import LeaseLost
from django_jobs.metrics import get_collector
from django_jobs.models import Job
from django_jobs.worker import QueueWorker
from tests.fake_servicebus import FAKES, SDK_INSTALLED, FakeNamespace
from tests.testapp.jobs import scripted
from tests.testapp.models import SideEffect

pytestmark = [
    pytest.mark.django_db(databases=["default", "postgres"]),
    pytest.mark.skipif(not SDK_INSTALLED, reason="azure-servicebus is not installed"),
]

NO_BACKOFF = {"strategy": "none"}
ENTITY = "default"  # the test backend has no PREFIX: entity name = queue name


@pytest.fixture
def ns(servicebus_fake: FakeNamespace) -> FakeNamespace:
    return servicebus_fake


@pytest.fixture
def backend(ns: FakeNamespace) -> Iterator[ServiceBusBackend]:
    """A backend of its own (not the cached ``get_backend`` one), closed after the test."""
    built = ServiceBusBackend("servicebus", dict(settings.JOBS["BACKENDS"]["servicebus"]["OPTIONS"]))
    yield built
    built.close()


def unique(prefix: str = "k") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def make_env(
    *, action: str = "ok", key: str | None = None, queue: str = "default", payload: dict | None = None, **options: Any
) -> Envelope:
    """A signed envelope of the scripted job; ``options`` go to ``using()``, ``payload`` to the call."""
    options.setdefault("backoff", NO_BACKOFF)
    job = scripted.using(queue=queue, backend="servicebus", **options)
    return job.builder(action=action, key=key, **(payload or {})).build()


def send(backend: ServiceBusBackend, **kwargs: Any) -> Envelope:
    env = make_env(**kwargs)
    backend.enqueue(env)
    return env


def runs(key: str) -> int:
    return SideEffect.objects.filter(key=key).count()


def counter(name: str, queue: str = "default") -> float:
    return get_collector().get(name, queue=queue)


def lose_lock(ns: FakeNamespace, backend: ServiceBusBackend, times: int) -> None:
    """``times`` deliveries whose worker died: each is fetched, and its lock runs out."""
    for _ in range(times):
        lease = backend.fetch("default")
        assert lease is not None
        ns.advance(ns.lock_seconds() + 1)


def raw_send(backend: ServiceBusBackend, body: Any) -> None:
    """A message put on the queue by something else than django-jobs."""
    from azure.servicebus import ServiceBusMessage

    backend._sender("default").handle.send_messages(ServiceBusMessage(body))


# -- the fakes follow the SDK ------------------------------------------------------------------------


def _members(cls: type) -> dict[str, Any]:
    """Methods and properties a fake class defines itself (the dunders that matter included)."""
    return {
        name: value
        for name, value in vars(cls).items()
        if (not name.startswith("_") or name in ("__init__", "__enter__", "__exit__"))
        and (callable(value) or isinstance(value, (property, classmethod, staticmethod)))
    }


# Fakes the backend builds itself; the others are built by a fake client, so their constructors
# are the fake's business.
CONSTRUCTED = {"ServiceBusClient", "ServiceBusAdministrationClient"}


def _shape(fn: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("fake_name", sorted(FAKES))
def test_every_faked_method_has_the_sdk_signature(fake_name):
    fake, real_path = FAKES[fake_name]
    real = import_string(real_path)
    checked = 0
    # The fakes' base class methods (close, _check_live) count for the sender and receiver too.
    for cls in [c for c in fake.__mro__ if c.__module__ == fake.__module__]:
        for name, member in _members(cls).items():
            if name == "__init__" and fake_name not in CONSTRUCTED:
                continue
            real_member = inspect.getattr_static(real, name, None)
            assert real_member is not None, f"{real_path} has no {name!r}: the fake models an API that does not exist"
            if isinstance(member, property):
                assert isinstance(real_member, property), f"{real_path}.{name} is not a property in the SDK"
            else:
                assert not isinstance(real_member, property), f"{real_path}.{name} is a property in the SDK"
                # Names and kinds (positional, keyword-only, *args, **kwargs) must match exactly.
                assert _shape(getattr(fake, name)) == _shape(getattr(real, name)), (
                    f"{fake.__name__}.{name}{inspect.signature(getattr(fake, name))} != "
                    f"{real_path}.{name}{inspect.signature(getattr(real, name))}"
                )
            checked += 1
    assert checked >= 3


def test_the_backend_uses_only_what_the_fakes_model():
    # A method the backend calls on a client object must be faked (and so drift-guarded).
    source = inspect.getsource(importlib.import_module("django_jobs.backends.servicebus"))
    faked = {name for fake, _ in FAKES.values() for cls in fake.__mro__ for name in vars(cls)}
    for name in (
        "from_connection_string",
        "get_queue_receiver",
        "get_queue_sender",
        "receive_messages",
        "complete_message",
        "dead_letter_message",
        "abandon_message",
        "renew_message_lock",
        "send_messages",
        "create_message_batch",
        "get_queue_runtime_properties",
        "delivery_count",
        "locked_until_utc",
        "lock_token",
        "enqueued_time_utc",
        "active_message_count",
        "scheduled_message_count",
        "dead_letter_message_count",
    ):
        assert name in source, f"{name} is listed here but the backend no longer uses it"
        assert name in faked, f"the backend uses {name}, which the fake does not model"


def test_the_first_delivery_has_delivery_count_zero(ns, backend):
    # The SDK reports the AMQP header (earlier failed deliveries): 0 on a first delivery. A
    # fake starting at 1 would make every first run look like a lost one.
    send(backend)
    lease = backend.fetch("default")
    assert lease.raw.message.delivery_count == 0
    assert lease.envelope.attempts == 0


# -- enqueue: messages, delays, batches --------------------------------------------------------------


def test_each_copy_has_its_own_message_id_and_the_job_id_as_correlation_id(ns, backend):
    # With duplicate detection on, a requeued copy reusing an id would be dropped: the job lost.
    env = send(backend, max_retries=2)
    first = backend.fetch("default")
    backend.nack(first, 0)
    [copy] = ns.messages(ENTITY)
    backend.nack(backend.fetch("default"), 0, count_run=False)
    [again] = ns.messages(ENTITY)
    assert len({first.raw.message.message_id, copy.message_id, again.message_id}) == 3
    assert copy.correlation_id == again.correlation_id == env.id
    assert copy.content_type == "application/json"


def test_a_delayed_job_is_scheduled_and_counted_as_delayed(ns, backend):
    env = send(backend, delay=600)
    [stored] = ns.messages(ENTITY)
    assert stored.scheduled_at == env.available_at
    assert backend.fetch("default") is None
    assert backend.stats("default") == {"pending": 0, "delayed": 1, "in_progress": 0, "failed": 0}

    ns.advance(601)
    lease = backend.fetch("default")
    assert lease.envelope.id == env.id
    assert backend.stats("default") == {"pending": 1, "delayed": 0, "in_progress": 0, "failed": 0}


def test_enqueue_many_splits_batches_at_the_size_limit_and_keeps_fifo(ns, backend):
    # ~60 KB each: a 256 KB (Standard tier) batch holds four; ten need three sends.
    envs = [make_env(payload={"filler": "x" * 60_000}) for _ in range(10)]
    envs.insert(5, make_env(queue="other"))
    backend.enqueue_many(envs)

    assert [op for op, entity in ns.log if op == "send" and entity == ENTITY] == ["send"] * 3
    fetched = []
    while (lease := backend.fetch("default")) is not None:
        fetched.append(lease.envelope.id)
    assert fetched == [e.id for e in envs if e.queue == "default"]
    assert backend.fetch("other").envelope.id == envs[5].id


def test_a_message_too_large_for_service_bus_is_refused_at_enqueue(ns, backend):
    from azure.servicebus.exceptions import MessageSizeExceededError

    with pytest.raises(MessageSizeExceededError):
        backend.enqueue(make_env(payload={"filler": "x" * 300_000}))
    assert ns.messages(ENTITY) == []


# -- nack: copy first, then complete ------------------------------------------------------------------


def test_nack_checks_the_lock_then_sends_the_copy_then_completes_the_original(ns, backend):
    env = send(backend, max_retries=3)
    lease = backend.fetch("default")
    ns.log.clear()

    backend.nack(lease, 30)

    assert [op for op, _ in ns.log] == ["renew", "send", "complete"]
    [copy] = ns.messages(ENTITY)
    assert copy.scheduled_at is not None and copy.scheduled_at > timezone.now() + timedelta(seconds=29)
    ns.advance(31)
    again = backend.fetch("default")
    assert (again.envelope.id, again.envelope.attempts) == (env.id, 1)
    signing.verify(again.envelope)


def test_a_failure_between_the_copy_and_the_complete_duplicates_and_never_loses(ns, backend):
    from azure.servicebus.exceptions import ServiceBusConnectionError

    env = send(backend, max_retries=3)
    lease = backend.fetch("default")
    ns.fail("complete", ServiceBusConnectionError(message="link detached"))

    with pytest.raises(ServiceBusConnectionError):
        backend.nack(lease, 0)

    # The copy is queued; the original is still locked, and comes back when its lock expires.
    copy = backend.fetch("default")
    assert (copy.envelope.id, copy.envelope.attempts) == (env.id, 1)
    ns.advance(ns.lock_seconds() + 1)
    original = backend.fetch("default")
    assert original.envelope.id == env.id
    # Its lock ran out without a settle: counted as a lost run, like the failed run it was.
    assert original.envelope.attempts == 1


def test_a_failed_send_leaves_the_original_locked_and_nothing_is_lost(ns, backend):
    from azure.servicebus.exceptions import ServiceBusServerBusyError

    env = send(backend, max_retries=3)
    lease = backend.fetch("default")
    ns.fail("send", ServiceBusServerBusyError())

    with pytest.raises(ServiceBusServerBusyError):
        backend.nack(lease, 0)

    [original] = ns.messages(ENTITY)  # no copy, and the original not completed
    assert Envelope.from_bytes(original.body).id == env.id
    backend.ack(lease)  # the lock is still this worker's
    assert ns.messages(ENTITY) == []


def test_the_worker_retrying_a_failed_nack_requeues_the_job_once(ns, backend):
    from azure.servicebus.exceptions import ServiceBusServerBusyError

    key = unique()
    env = send(backend, action="raise", key=key, max_retries=3)
    ns.fail("send", ServiceBusServerBusyError())  # the first requeue fails; the worker tries again

    result = QueueWorker(backend, ["default"]).process_once()

    # The second try renews the lock it still holds, sends the copy and completes the original:
    # the job waits for its retry exactly once, with its run counted.
    assert result.status == "requeued"
    assert runs(key) == 1
    again = backend.fetch("default")
    assert (again.envelope.id, again.envelope.attempts) == (env.id, 1)
    backend.ack(again)
    ns.advance(ns.lock_seconds() + 1)
    assert backend.fetch("default") is None


# -- lock loss --------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["ack", "nack", "abandon", "extend"])
def test_an_expired_lock_raises_lease_lost_and_changes_nothing(ns, backend, op):
    env = send(backend, max_retries=3)
    lease = backend.fetch("default")
    ns.advance(ns.lock_seconds() + 1)
    ns.log.clear()

    with pytest.raises(LeaseLost):
        {
            "ack": lambda: backend.ack(lease),
            "nack": lambda: backend.nack(lease, 0),
            "abandon": lambda: backend.abandon(lease, "too late"),
            "extend": lambda: backend.extend(lease, 60),
        }[op]()

    assert ns.log == []  # nothing renewed, sent, completed or dead-lettered
    assert ns.dead_letters(ENTITY) == []
    assert not Job.objects.filter(pk=env.id).exists()
    assert backend.fetch("default").envelope.attempts == 1  # redelivered, the lost run counted


def test_a_lease_fetched_before_close_is_lost_and_comes_back_at_lock_expiry(ns, backend):
    env = send(backend, max_retries=1)
    lease = backend.fetch("default")
    backend.close()

    with pytest.raises(LeaseLost):
        backend.ack(lease)
    ns.advance(ns.lock_seconds() + 1)
    assert backend.fetch("default").envelope.id == env.id


def test_extend_renews_the_lock(ns, backend):
    send(backend)
    lease = backend.fetch("default")
    first = lease.expires_at
    ns.advance(ns.lock_seconds() * 0.9)

    backend.extend(lease, 60)

    assert lease.expires_at == ns.messages(ENTITY)[0].locked_until
    assert lease.expires_at > first
    ns.advance(ns.lock_seconds() * 0.5)  # past the first expiry, within the renewed one
    backend.ack(lease)


def test_the_heartbeat_keeps_a_long_job_locked_past_its_lock_duration(ns):
    # A lock of 0.9 s and a job of 2 s: only the heartbeat's renewals (every 0.3 s) keep it.
    with override_settings(JOBS={**settings.JOBS, "LEASE_TIMEOUT": 0.9}):
        backend = get_backend("servicebus")
        key = unique()
        backend.enqueue(make_env(action="sleep", key=key, payload={"seconds": 2.0}))
        worker = QueueWorker(backend, ["default"])
        worker.heartbeat.start()
        try:
            result = worker.process_once()
        finally:
            worker.heartbeat.stop()
        assert result.status == "acked"
        assert runs(key) == 1
        assert ns.messages(ENTITY) == []
        backend.close()


def test_a_lock_shorter_than_the_heartbeat_interval_is_reported(ns, backend, caplog):
    ns.lock_duration = 5  # LEASE_TIMEOUT 60: the heartbeat renews every 20 s, too late
    send(backend)
    with caplog.at_level(logging.WARNING, logger="django_jobs.servicebus"):
        backend.fetch("default")
        send(backend)
        backend.fetch("default")
    [record] = [r for r in caplog.records if r.name == "django_jobs.servicebus"]  # once per queue
    assert "LockDuration" in record.getMessage()


# -- delivery_count: lost runs ------------------------------------------------------------------------


def test_a_message_whose_lock_expired_twice_arrives_with_two_more_attempts(ns, backend):
    env = send(backend, max_retries=5)
    lose_lock(ns, backend, 2)

    lease = backend.fetch("default")

    assert lease.raw.message.delivery_count == 2
    assert (lease.envelope.id, lease.envelope.attempts) == (env.id, 2)
    assert counter("jobs_reaped") == 2


def test_a_lost_run_with_retries_left_waits_for_the_jobs_backoff(ns, backend):
    env = send(backend, max_retries=3, backoff={"strategy": "fixed", "base": 120})
    lose_lock(ns, backend, 1)

    assert backend.fetch("default") is None  # requeued as a copy due in 120 s
    [copy] = ns.messages(ENTITY)
    assert copy.delivery_count == 0 and copy.scheduled_at > timezone.now() + timedelta(seconds=110)
    ns.advance(121)
    again = backend.fetch("default")
    assert (again.envelope.id, again.envelope.attempts) == (env.id, 1)


def test_a_delivery_past_max_retries_is_dead_lettered_without_running(ns, backend):
    key = unique()
    env = send(backend, key=key, max_retries=1)
    lose_lock(ns, backend, 2)  # two runs lost: attempts 2 > max_retries 1

    result = QueueWorker(backend, ["default"]).process_once()

    assert result.status == "empty"
    assert runs(key) == 0
    [dead] = ns.dead_letters(ENTITY)
    assert dead.dead_letter_reason.startswith("WorkerLost: its Service Bus lock expired 2 time(s)")
    row = Job.objects.get(pk=env.id)
    assert (row.status, row.attempts, row.backend) == ("failed", 2, "servicebus")
    assert row.last_error.startswith("WorkerLost")
    assert backend.size("default") == 0


def test_lost_runs_are_not_trusted_before_the_signature_verifies(ns, backend):
    # A forged message claiming max_retries=0 must be rejected, not failed with a Job row that
    # an admin could retry (and so sign).
    env = make_env(max_retries=0)
    backend.enqueue(replace(env, payload={"args": [], "kwargs": {"action": "raise"}}))
    lose_lock(ns, backend, 1)

    result = QueueWorker(backend, ["default"]).process_once()

    assert result.status == "rejected" and "BadSignature" in result.error
    assert counter("jobs_rejected_signature") == 1
    assert counter("jobs_reaped") == 0
    # Rejected as any tampered message is (its audit row is a new one that quotes the id it
    # claimed, and an admin retry refuses it), never failed as a lost run.
    assert not Job.objects.filter(pk=env.id).exists()
    assert Job.objects.get(last_error__contains=repr(env.id)).last_error.startswith("rejected: BadSignature")
    assert ns.dead_letters(ENTITY)[0].dead_letter_reason.startswith("rejected: BadSignature")


def test_azure_dead_letters_on_its_own_at_max_delivery_count(ns, backend):
    # What the django_jobs.W001 check warns about: MaxDeliveryCount 3 < max_retries + 2, so the
    # broker dead-letters the job before django-jobs has failed it, and no Job row records it.
    ns.max_delivery_count = 3
    env = send(backend, max_retries=5)
    lose_lock(ns, backend, 3)

    assert backend.fetch("default") is None
    [dead] = ns.dead_letters(ENTITY)
    assert dead.dead_letter_reason == "MaxDeliveryCountExceeded"
    assert not Job.objects.filter(pk=env.id).exists()


# -- abandon and garbage ------------------------------------------------------------------------------


def test_a_permanent_failure_goes_to_the_dead_letter_queue_and_a_failed_job_row(ns, backend):
    key = unique()
    env = send(backend, action="raise", key=key, max_retries=1)

    assert [QueueWorker(backend, ["default"]).process_once().status for _ in range(2)] == ["requeued", "dead-lettered"]

    [dead] = ns.dead_letters(ENTITY)
    assert dead.dead_letter_reason == "RuntimeError: scripted failure"
    assert dead.dead_letter_description.startswith("RuntimeError: scripted failure\nTraceback")
    assert Envelope.from_bytes(dead.body).id == env.id
    row = Job.objects.get(pk=env.id)
    assert (row.status, row.attempts, row.backend) == ("failed", 2, "servicebus")
    assert dead.dead_letter_description == row.last_error[:4096]
    assert backend.stats("default") == {"pending": 0, "delayed": 0, "in_progress": 0, "failed": 1}


def test_long_errors_are_cut_to_fit_message_properties_and_kept_whole_in_the_job_row(ns, backend):
    env = send(backend)
    error = "ValueError: " + "x" * 500 + "\n" + "frame\n" * 2000
    backend.abandon(backend.fetch("default"), error)

    [dead] = ns.dead_letters(ENTITY)
    assert len(dead.dead_letter_reason) == 256 and error.startswith(dead.dead_letter_reason)
    assert len(dead.dead_letter_description) == 4096
    assert Job.objects.get(pk=env.id).last_error == error


@pytest.mark.parametrize("body", [b"not json at all", b'{"v": 2}', "\u00e9t\u00e9"], ids=["bytes", "not-v1", "text"])
def test_a_garbage_body_is_dead_lettered_counted_and_never_run(ns, backend, body):
    raw_send(backend, body)

    result = QueueWorker(backend, ["default"]).process_once()

    assert result.status == "rejected" and result.error.startswith("rejected: InvalidPayload")
    assert counter("jobs_rejected_payload") == 1
    assert counter("jobs_succeeded") == counter("jobs_failed") == 0
    [dead] = ns.dead_letters(ENTITY)
    assert dead.dead_letter_reason.startswith("rejected: InvalidPayload")
    assert backend.fetch("default") is None
    assert Job.objects.count() == 0  # nothing trustworthy to record


def test_a_garbage_body_delivered_again_after_a_lost_lock_is_still_rejected(ns, backend):
    raw_send(backend, b"\x00garbage")
    lose_lock(ns, backend, 1)

    result = QueueWorker(backend, ["default"]).process_once()

    assert result.status == "rejected"
    assert len(ns.dead_letters(ENTITY)) == 1


# -- waiting, closing, stats, purge --------------------------------------------------------------------


def test_wait_for_work_blocks_until_a_message_arrives_and_the_next_fetch_takes_it(ns, backend):
    env = make_env()
    sender = threading.Timer(0.2, lambda: get_backend("servicebus").enqueue(env))
    sender.start()
    try:
        started = time.monotonic()
        assert backend.wait_for_work(["default"], 10) is True
        assert time.monotonic() - started < 9  # woke on the message, not the timeout
    finally:
        sender.join()
    ns.log.clear()
    lease = backend.fetch("default")
    assert lease.envelope.id == env.id
    assert ("receive", ENTITY) not in ns.log  # handed out from the stash


def test_wait_for_work_on_several_queues_lets_the_worker_sleep(backend):
    assert backend.wait_for_work(["default", "other"], 1) is False
    assert backend.wait_for_work(["default"], 0) is False


def test_close_puts_back_a_waited_message_without_counting_a_run(ns, backend):
    env = send(backend, max_retries=0)
    assert backend.wait_for_work(["default"], 1)

    backend.close()  # the worker stops before fetching it

    lease = backend.fetch("default")
    assert (lease.envelope.id, lease.envelope.attempts) == (env.id, 0)
    assert lease.raw.message.delivery_count == 0


def test_close_closes_the_client_its_handlers_and_the_admin_client(ns, backend):
    send(backend)
    backend.fetch("other")
    backend.stats("default")
    [client] = ns.clients
    [admin] = ns.admin_clients
    handlers = list(client._handlers)
    assert len(handlers) == 2  # the sender of default, the receiver of other

    backend.close()

    assert client.closed and admin.closed
    assert all(h._closed for h in handlers)
    # Used again, the backend opens a new client.
    assert backend.fetch("default") is not None
    assert len(ns.clients) == 2 and not ns.clients[1].closed


def test_one_client_serves_every_queue_and_handlers_are_cached(ns, backend):
    for queue in ("default", "other", "default", "other"):
        backend.enqueue(make_env(queue=queue))
        backend.fetch(queue)
    [client] = ns.clients
    assert len(client._handlers) == 4  # one sender and one receiver per queue


def test_stats_and_size_map_the_runtime_properties(ns, backend):
    send(backend)  # leased below: active
    send(backend)  # dead-lettered below
    send(backend, delay=600)  # scheduled
    send(backend)  # ready: active
    lease = backend.fetch("default")
    backend.abandon(backend.fetch("default"), "ValueError: no")

    assert backend.stats("default") == {"pending": 2, "delayed": 1, "in_progress": 0, "failed": 1}
    assert backend.size("default") == 3
    backend.ack(lease)
    assert backend.size("default") == 2


def test_reap_expired_has_nothing_to_do(ns, backend):
    send(backend)
    backend.fetch("default")
    ns.advance(ns.lock_seconds() + 1)
    assert backend.reap_expired() == 0 and backend.reap_expired("default") == 0


def test_purge_failed_removes_the_dead_letters_queued_before_the_cutoff(ns, backend):
    ns.clock.offset = -2 * 86400  # the broker's clock: two days ago
    send(backend)
    backend.abandon(backend.fetch("default"), "ValueError: old")
    ns.clock.offset = 0
    recent = send(backend)
    backend.abandon(backend.fetch("default"), "ValueError: recent")
    send(backend)  # pending: not a dead letter, never touched

    assert backend.purge_failed("default", timedelta(days=1)) == 1

    [kept] = ns.dead_letters(ENTITY)
    assert Envelope.from_bytes(kept.body).id == recent.id
    assert kept.lock_token is None  # the purge released it at once, not at its lock's expiry
    assert len(ns.messages(ENTITY)) == 1


def test_purge_failed_without_an_age_removes_every_dead_letter(ns, backend):
    for _ in range(2):
        send(backend)
        backend.abandon(backend.fetch("default"), "ValueError: no")
    assert backend.purge_failed("default") == 2
    assert backend.stats("default")["failed"] == 0


# -- configuration -----------------------------------------------------------------------------------


def servicebus_warnings(**jobs: Any) -> list[checks.CheckMessage]:
    with override_settings(JOBS={**settings.JOBS, **jobs}):
        # django-jobs registers its checks as compatibility checks; the model checks would
        # query every configured database.
        return [m for m in checks.run_checks(tags=[checks.Tags.compatibility]) if m.id == "django_jobs.W001"]


def with_servicebus(options: dict[str, Any]) -> dict[str, Any]:
    return {**settings.JOBS["BACKENDS"], "servicebus": {"ENGINE": "servicebus", "OPTIONS": options}}


def test_the_check_warns_when_max_delivery_count_does_not_exceed_max_retries_plus_one(ns):
    [warning] = servicebus_warnings(DEFAULT_MAX_RETRIES=9)  # Azure's default 10 is not > 10
    assert warning.level == checks.WARNING
    assert "'servicebus'" in warning.msg and "MaxDeliveryCount (10)" in warning.msg
    assert "MAX_DELIVERY_COUNT" in warning.hint
    assert servicebus_warnings(DEFAULT_MAX_RETRIES=8) == []
    assert servicebus_warnings(DEFAULT_MAX_RETRIES=9, BACKENDS=with_servicebus({"MAX_DELIVERY_COUNT": 11})) == []
    assert len(servicebus_warnings(DEFAULT_MAX_RETRIES=2, BACKENDS=with_servicebus({"MAX_DELIVERY_COUNT": 3}))) == 1
    assert len(servicebus_warnings(BACKENDS=with_servicebus({"MAX_DELIVERY_COUNT": "10"}))) == 1
    # Its dotted path counts as the same engine; other engines are never concerned.
    dotted = {"default": {"ENGINE": "django_jobs.backends.servicebus.ServiceBusBackend", "OPTIONS": {}}}
    assert len(servicebus_warnings(DEFAULT_MAX_RETRIES=20, BACKENDS=dotted)) == 1
    assert servicebus_warnings(DEFAULT_MAX_RETRIES=20, BACKENDS={"default": {"ENGINE": "database"}}) == []
    # No network I/O: the check never built a client.
    assert ns.clients == [] and ns.admin_clients == []


def test_import_without_the_azure_servicebus_package_names_the_extra(monkeypatch):
    # monkeypatch restores both entries (and so the real module objects) after the test.
    monkeypatch.setitem(sys.modules, "azure.servicebus", None)  # `import azure.servicebus` now fails
    monkeypatch.delitem(sys.modules, "django_jobs.backends.servicebus")
    with pytest.raises(ImproperlyConfigured) as excinfo:
        importlib.import_module("django_jobs.backends.servicebus")
    assert "pip install 'django-reliable-jobs[servicebus]'" in str(excinfo.value)


def test_a_backend_without_credentials_is_improperly_configured_on_first_use():
    backend = ServiceBusBackend("nowhere", {})  # building it does no I/O and needs nothing
    with pytest.raises(ImproperlyConfigured, match="CONNECTION_STRING"):
        backend.fetch("default")


def test_a_namespace_without_azure_identity_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "azure.identity", None)
    backend = ServiceBusBackend("aad", {"FULLY_QUALIFIED_NAMESPACE": "example.servicebus.windows.net"})
    with pytest.raises(ImproperlyConfigured, match="pip install azure-identity"):
        backend.stats("default")


def test_a_namespace_authenticates_with_default_azure_credential(ns, monkeypatch):
    made = []

    class Credential:
        def __init__(self) -> None:
            made.append(self)

        def close(self) -> None:
            made.remove(self)

    monkeypatch.setitem(sys.modules, "azure.identity", type(sys)("azure.identity"))
    sys.modules["azure.identity"].DefaultAzureCredential = Credential  # type: ignore[attr-defined]
    backend = ServiceBusBackend("aad", {"FULLY_QUALIFIED_NAMESPACE": "example.servicebus.windows.net"})
    backend.enqueue(make_env())
    backend.stats("default")

    [client], [admin] = ns.clients, ns.admin_clients
    assert client.fully_qualified_namespace == admin.fully_qualified_namespace == "example.servicebus.windows.net"
    assert client.credential is made[0]  # one credential, shared by both clients
    backend.close()
    assert made == []


def test_prefix_names_the_entities(ns):
    backend = ServiceBusBackend("prefixed", {"CONNECTION_STRING": "Endpoint=sb://x/", "PREFIX": "app1-"})
    env = make_env()
    backend.enqueue(env)
    assert len(ns.messages("app1-default")) == 1 and ns.messages("default") == []
    assert backend.fetch("default").envelope.id == env.id
    backend.close()


def test_capability_flags():
    assert (ServiceBusBackend.native_lease, ServiceBusBackend.native_dead_letter) == (True, True)
    assert (ServiceBusBackend.supports_delay, ServiceBusBackend.supports_priority) == (True, False)
    assert ServiceBusBackend.persistent and not ServiceBusBackend.transactional


def test_a_retry_says_that_the_brokers_dead_letter_copy_stays(ns, backend):
    # Service Bus keeps its dead-lettered message (native_dead_letter): retrying the failed Job
    # row sends a fresh copy, and the operator is told the old one stays until purged.
    from django_jobs.operations import retry_jobs

    env = send(backend, action="raise", max_retries=0)
    assert QueueWorker(backend, ["default"]).process_once().status == "dead-lettered"

    outcome = retry_jobs(Job.objects.filter(pk=env.id))

    assert outcome.retried == 1 and outcome.errors == []
    assert len(outcome.notes) == 1 and "'servicebus' keeps its own dead-lettered copy" in outcome.notes[0]
    assert len(ns.dead_letters(ENTITY)) == 1
    assert retry_jobs(Job.objects.none()).notes == []
