"""Error paths of the broker backends: real Redis and beanstalkd, and Service Bus on its fake.

Each test drives the real backend into a state a broker, an operator or a dead worker can
leave behind (a hand-written score, a missing body, a tube nobody used, a lock lost during a
purge) and checks what the backend does with it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import greenstalk
import pytest
from django.conf import settings

from django_jobs.backends.beanstalk import BeanstalkBackend
from django_jobs.backends.redis import RedisBackend
from django_jobs.envelope import Envelope
from django_jobs.models import Job, JobStatus
from django_jobs.pipeline import Outcome
from django_jobs.reaper import LOST_RUN_BATCH
from django_jobs.worker import QueueWorker
from tests.beanstalk_support import raw_tube, tube_counts
from tests.fake_servicebus import SDK_INSTALLED, FakeNamespace, FakeServiceBusReceivedMessage
from tests.testapp.jobs import scripted

pytestmark = pytest.mark.django_db(databases=["default", "postgres"])

NO_BACKOFF = {"strategy": "none"}


def make_env(queue: str = "default", backend: str = "redis", **options: Any) -> Envelope:
    options.setdefault("backoff", NO_BACKOFF)
    return scripted.using(queue=queue, backend=backend, **options).builder(action="ok").build()


# -- redis ---------------------------------------------------------------------------------------


@pytest.fixture
def redis_backend(redis_up) -> Iterator[RedisBackend]:
    backend = RedisBackend("redis", {"URL": settings.REDIS_URL, "PREFIX": f"{settings.REDIS_PREFIX}-err"})
    yield backend
    left = list(redis_up.scan_iter(match=f"{backend.prefix}:*", count=1000))
    if left:
        redis_up.delete(*left)
    backend.close()


def test_redis_ack_and_fetch_across_queues_acks_then_leases_from_the_other_queue(redis_backend):
    first, second = make_env("default"), make_env("other")
    redis_backend.enqueue(first)
    redis_backend.enqueue(second)
    lease = redis_backend.fetch("default")
    assert lease.envelope.id == first.id

    following = redis_backend.ack_and_fetch(lease, "other")

    assert following is not None
    assert (following.queue, following.envelope.id) == ("other", second.id)
    assert redis_backend.stats("default") == {"pending": 0, "delayed": 0, "in_progress": 0, "failed": 0, "waiting": 0}


def test_redis_reaps_a_hand_written_lease_without_a_body_as_failed(redis_backend):
    # A processing entry written by hand: a score no datetime can hold, an owner, and no body.
    keys = redis_backend.keys("default")
    client = redis_backend.client
    client.zadd(keys.processing, {"orphan": -1e20})
    client.hset(keys.owners, "orphan", "someone")

    assert redis_backend.reap_expired("default") == 1

    assert redis_backend.stats("default") == {"pending": 0, "delayed": 0, "in_progress": 0, "failed": 1, "waiting": 0}
    assert client.zscore(keys.failed, "orphan") is not None
    assert client.hget(keys.errors, "orphan") == b"WorkerLost: lease expired (worker crashed or stalled)"
    # Nothing decodable: no Job row could be written for it.
    assert not Job.objects.filter(pk="orphan").exists()


# -- beanstalk -----------------------------------------------------------------------------------


@pytest.fixture
def beanstalk_backend(beanstalk_up) -> Iterator[BeanstalkBackend]:
    prefix = f"{settings.BEANSTALK_PREFIX}-err{uuid.uuid4().hex[:8]}"
    options = {"HOST": settings.BEANSTALK_HOST, "PORT": int(settings.BEANSTALK_PORT), "PREFIX": prefix}
    backend = BeanstalkBackend("beanstalk", options)
    yield backend
    backend.close()


def test_beanstalk_wait_for_work_times_out_on_an_empty_tube(beanstalk_backend):
    start = time.monotonic()
    assert beanstalk_backend.wait_for_work(["default"], 1) is True
    assert time.monotonic() - start >= 0.9  # it blocked in reserve for the whole second
    assert beanstalk_backend.fetch("default") is None  # and stashed nothing


def test_beanstalk_a_connection_that_fails_to_close_is_still_dropped(beanstalk_backend, monkeypatch):
    tube = beanstalk_backend._tube("default")

    def close_fails() -> None:
        raise OSError("socket already broken")

    monkeypatch.setattr(tube.client, "close", close_fails)
    too_big = make_env(backend="beanstalk", queue="default")
    too_big.payload = {"blob": "x" * 70_000}  # over beanstalkd's default max-job-size (65535)
    with pytest.raises(greenstalk.JobTooBigError):
        beanstalk_backend.enqueue(too_big)

    assert "default" not in beanstalk_backend._tubes  # dropped despite the failing close
    env = make_env(backend="beanstalk")
    beanstalk_backend.enqueue(env)  # a fresh connection
    assert beanstalk_backend.fetch("default").envelope.id == env.id


def test_beanstalk_fetch_settles_at_most_a_batch_of_lost_runs(beanstalk_backend, beanstalk_up):
    name = beanstalk_backend.tube_name("default")
    count = LOST_RUN_BATCH + 1
    with raw_tube(beanstalk_backend.address, name) as raw:
        for _ in range(count):
            raw.put(make_env(backend="beanstalk", max_retries=0).to_bytes(), ttr=1)
        for _ in range(count):
            raw.reserve(timeout=1)  # a worker that reserves and dies: TTR runs out
        deadline = time.monotonic() + 15
        while tube_counts(raw, name)["pending"] < count and time.monotonic() < deadline:
            time.sleep(0.1)  # until beanstalkd has put every expired reservation back
        assert tube_counts(raw, name)["pending"] == count
        # Every job came back once without a settle and has no retry left: each is buried,
        # and one fetch handles at most a batch of them before it gives up for now.
        assert beanstalk_backend.fetch("default") is None
        counts = tube_counts(raw, name)
        assert counts["failed"] == LOST_RUN_BATCH
        assert counts["pending"] == 1
    assert Job.objects.filter(status=JobStatus.FAILED, backend="beanstalk").count() == LOST_RUN_BATCH


# -- service bus (the in-memory namespace) ----------------------------------------------------------

servicebus = pytest.mark.skipif(not SDK_INSTALLED, reason="azure-servicebus is not installed")


@pytest.fixture
def ns(servicebus_fake: FakeNamespace) -> FakeNamespace:
    return servicebus_fake


@pytest.fixture
def sb_backend(ns: FakeNamespace) -> Iterator[Any]:
    from django_jobs.backends.servicebus import ServiceBusBackend

    built = ServiceBusBackend("servicebus", dict(settings.JOBS["BACKENDS"]["servicebus"]["OPTIONS"]))
    yield built
    built.close()


def raw_send(backend: Any, body: Any) -> None:
    from azure.servicebus import ServiceBusMessage

    backend._sender("default").handle.send_messages(ServiceBusMessage(body))


@servicebus
def test_servicebus_close_logs_a_client_that_fails_to_close(ns, sb_backend, monkeypatch, caplog):
    from tests.fake_servicebus import FakeServiceBusAdministrationClient

    sb_backend.enqueue(make_env(backend="servicebus"))  # opens the client
    sb_backend.stats("default")  # and the admin client

    def close_fails(self: Any) -> None:
        raise ConnectionError("admin link already gone")

    monkeypatch.setattr(FakeServiceBusAdministrationClient, "close", close_fails)
    with caplog.at_level(logging.WARNING, logger="django_jobs"):
        sb_backend.close()
    assert "servicebus backend 'servicebus': error while closing" in caplog.text
    assert "admin link already gone" in caplog.text
    assert ns.clients[0].closed  # the others were closed all the same


@servicebus
def test_servicebus_close_leaves_an_undecodable_waited_message_alone(ns, sb_backend):
    raw_send(sb_backend, b"\x00garbage")
    assert sb_backend.wait_for_work(["default"], 1)
    sent_before = len(ns.messages("default"))

    sb_backend.close()

    [stored] = ns.messages("default")
    assert len(ns.messages("default")) == sent_before  # no copy put back
    assert stored.lock_token is not None  # left locked: it comes back at its lock's expiry


@servicebus
def test_servicebus_close_logs_a_waited_message_it_cannot_put_back(ns, sb_backend, caplog):
    from azure.servicebus.exceptions import ServiceBusServerBusyError

    env = make_env(backend="servicebus")
    sb_backend.enqueue(env)
    assert sb_backend.wait_for_work(["default"], 1)
    ns.fail("send", ServiceBusServerBusyError())

    with caplog.at_level(logging.WARNING, logger="django_jobs"):
        sb_backend.close()  # never raises

    assert "servicebus backend 'servicebus': could not put back message" in caplog.text
    [stored] = ns.messages("default")
    assert Envelope.from_bytes(stored.body).id == env.id  # the original is kept, still locked
    assert stored.lock_token is not None


@servicebus
def test_servicebus_fetch_settles_at_most_a_batch_of_lost_runs(ns, sb_backend):
    count = LOST_RUN_BATCH + 1
    for _ in range(count):
        sb_backend.enqueue(make_env(backend="servicebus", max_retries=0))
    for _ in range(count):
        assert sb_backend.fetch("default") is not None  # workers that fetch and die
    ns.advance(ns.lock_seconds() + 1)

    assert sb_backend.fetch("default") is None

    assert len(ns.dead_letters("default")) == LOST_RUN_BATCH
    assert len(ns.messages("default")) == 1
    assert Job.objects.filter(status=JobStatus.FAILED, backend="servicebus").count() == LOST_RUN_BATCH


@servicebus
@pytest.mark.parametrize("body", [42, {"a": "map"}], ids=["value", "map"])
def test_servicebus_a_message_without_a_data_body_is_rejected(ns, sb_backend, monkeypatch, body):
    sb_backend.enqueue(make_env(backend="servicebus"))
    monkeypatch.setattr(FakeServiceBusReceivedMessage, "body", property(lambda self: body))
    lease = sb_backend.fetch("default")
    assert lease.envelope is None
    assert "has no data body" in str(lease.error)
    result = QueueWorker(sb_backend).process(lease)
    assert result.status is Outcome.REJECTED


@servicebus
def test_servicebus_a_single_section_body_is_read_as_is(ns, sb_backend, monkeypatch):
    env = make_env(backend="servicebus")
    sb_backend.enqueue(env)
    monkeypatch.setattr(FakeServiceBusReceivedMessage, "body", property(lambda self: self._body))
    lease = sb_backend.fetch("default")
    assert lease.envelope is not None
    assert lease.envelope.id == env.id


@servicebus
def test_servicebus_purge_ignores_a_kept_dead_letter_whose_lock_was_lost(ns, sb_backend):
    from azure.servicebus.exceptions import MessageLockLostError

    sb_backend.enqueue(make_env(backend="servicebus"))
    sb_backend.abandon(sb_backend.fetch("default"), "ValueError: recent")
    ns.fail("abandon", MessageLockLostError())

    assert sb_backend.purge_failed("default", timedelta(days=1)) == 0  # too young: kept

    assert len(ns.dead_letters("default")) == 1
