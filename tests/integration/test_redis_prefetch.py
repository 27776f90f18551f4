"""Batched claims and acks of the Redis backend (``fetch_many``, ``ack_many``,
``ack_many_and_fetch``, ``begin``) and the reaper's rule for messages claimed ahead, against a
real Redis server.

Key names come from ``backend.keys(queue)``; every key lives under this session's prefix,
which the ``redis_up`` fixture clears before each test.
"""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from django_jobs.backends.base import Lease
from django_jobs.backends.redis import QueueKeys, RedisBackend
from django_jobs.envelope import Envelope
from django_jobs.exceptions import LeaseLost
from django_jobs.history import attempts_of
from django_jobs.signals import job_reaped
from tests.testapp.jobs import scripted

pytestmark = pytest.mark.django_db

STALE = "0" * 32  # an owner token no claim ever hands out


@pytest.fixture
def backend(redis_topology_backend: RedisBackend) -> RedisBackend:
    """On a single Redis, then on the Redis Cluster."""
    return redis_topology_backend


def keys(backend: RedisBackend, queue: str = "default") -> QueueKeys:
    return backend.keys(queue)


def enqueue(backend: RedisBackend, queue: str = "default", **options: Any) -> Envelope:
    env = scripted.using(queue=queue, backoff={"strategy": "none"}, **options).builder(action="ok", key=None).build()
    backend.enqueue(env)
    return env


def ids(leases: list[Lease]) -> list[str]:
    return [lease.token for lease in leases]


def ahead_mark(backend: RedisBackend, job_id: str, queue: str = "default") -> bytes | None:
    mark: bytes | None = backend.client.hget(keys(backend, queue).ahead, job_id)
    return mark


def stored(backend: RedisBackend, job_id: str, queue: str = "default") -> Envelope:
    return Envelope.from_bytes(backend.client.hget(keys(backend, queue).bodies, job_id))


def expire(backend: RedisBackend, lease: Lease) -> None:
    """The lease's deadline passed 5 s ago, as if its worker had died."""
    past_ms = (time.time() - 5) * 1000
    assert backend.client.zadd(keys(backend, lease.queue).processing, {lease.token: past_ms}, xx=True, ch=True) == 1


def lost_and_reaped(backend: RedisBackend, lease: Lease) -> None:
    expire(backend, lease)
    assert backend.reap_expired("default") == 1


# -- fetch_many --


def test_a_batch_comes_in_priority_then_fifo_order_all_claimed_ahead(backend):
    low1, high1, low2, high2, lowest = (enqueue(backend, priority=p) for p in (0, 5, 0, 5, -1))

    batch = backend.fetch_many("default", 10)

    assert ids(batch) == [high1.id, high2.id, low1.id, low2.id, lowest.id]
    assert [lease.envelope for lease in batch] == [high1, high2, low1, low2, lowest]
    assert all(lease.ahead and not lease.must_begin for lease in batch)
    assert len({lease.owner_token for lease in batch}) == 1, "one owner token per batch"
    assert all(lease.expires_at > timezone.now() for lease in batch)
    assert all(ahead_mark(backend, lease.token) == b"1" for lease in batch)
    assert backend.stats("default") == {"pending": 0, "delayed": 0, "in_progress": 5, "failed": 0, "waiting": 0}


def test_the_limit_is_respected_and_the_rest_waits(backend):
    envs = [enqueue(backend) for _ in range(5)]

    first = backend.fetch_many("default", 2)
    assert ids(first) == [e.id for e in envs[:2]]
    assert backend.stats("default")["pending"] == 3
    assert ids(backend.fetch_many("default", 10)) == [e.id for e in envs[2:]]
    assert backend.fetch_many("default", 10) == []
    assert backend.size("default") == 5  # all still leased
    late = enqueue(backend)
    lost, claimed = backend.ack_many_and_fetch([], "default", 10)
    assert (lost, ids(claimed)) == ([], [late.id])


def test_a_due_delayed_message_is_promoted_and_an_empty_claim_records_the_next_due(backend):
    env = enqueue(backend, delay=3600)
    assert backend.fetch_many("default", 5) == []
    due = backend._next_due["default"]
    assert abs(due - (time.time() + 3600)) < 60, "wait_for_work wakes for the delayed message"

    backend.client.zadd(keys(backend).delayed, {env.id: (time.time() - 1) * 1000}, xx=True)
    [lease] = backend.fetch_many("default", 5)
    assert lease.token == env.id


def test_a_missing_or_undecodable_body_gives_a_lease_with_an_error(backend):
    k = keys(backend)
    good = enqueue(backend)
    backend.client.hset(k.bodies, "garbage", b"\x00\xff{not json")
    backend.client.zadd(k.waiting, {"garbage": backend.client.incr(k.sequence)})
    backend.client.zadd(k.waiting, {"bodiless-é☃": backend.client.incr(k.sequence)})
    last = enqueue(backend)

    batch = backend.fetch_many("default", 10)

    assert ids(batch) == [good.id, "garbage", "bodiless-é☃", last.id]
    assert batch[0].envelope == good and batch[0].error is None
    for bad in batch[1:3]:
        assert bad.envelope is None and bad.error is not None and bad.ahead
    assert batch[3].envelope == last
    assert backend.ack_many([batch[2]]) == [], "any id is acked by name"
    assert backend.client.zscore(k.processing, "bodiless-é☃") is None

    # Claimed ahead and lost: handed back as it was, not failed.
    expire(backend, batch[1])
    assert backend.reap_expired("default") == 1
    assert backend.client.zscore(k.failed, "garbage") is None
    assert backend.client.zscore(k.waiting, "garbage") is not None
    assert backend.client.hget(k.bodies, "garbage") == b"\x00\xff{not json"


# -- ack_many --


def test_ack_many_fences_each_message_and_keeps_the_lost_ones(backend):
    a, b, c = (enqueue(backend) for _ in range(3))
    lease_a, lease_b = backend.fetch_many("default", 2)
    [lease_c] = backend.fetch_many("default", 2)
    stale_a = replace(lease_a, owner_token=STALE)
    # The batch's token does not reach another message: fencing is per message (id + token).
    borrowed_c = replace(lease_c, owner_token=lease_a.owner_token)

    lost = backend.ack_many([stale_a, lease_b, borrowed_c])

    assert lost == [stale_a, borrowed_c]
    k = keys(backend)
    assert backend.client.hget(k.bodies, b.id) is None, "b is acked: forgotten"
    assert ahead_mark(backend, b.id) is None
    for kept in (a, c):
        assert backend.client.zscore(k.processing, kept.id) is not None, "a lost ack leaves it leased"
        assert backend.client.hget(k.bodies, kept.id) is not None
        assert ahead_mark(backend, kept.id) == b"1"
    assert backend.ack_many([lease_a, lease_c]) == []
    assert backend.size("default") == 0


def test_ack_many_settles_leases_of_several_queues(backend):
    enqueue(backend)
    enqueue(backend, queue="other")
    leases = backend.fetch_many("default", 5) + backend.fetch_many("other", 5)
    stale = replace(leases[1], owner_token=STALE)

    assert backend.ack_many([leases[0], stale]) == [stale]
    assert backend.size("default") == 0
    assert backend.size("other") == 1
    assert backend.ack_many([]) == []


# -- ack_many_and_fetch --


def test_ack_many_and_fetch_acks_and_claims_even_when_an_ack_is_lost(backend):
    a, b, c, d = (enqueue(backend) for _ in range(4))
    lease_a, lease_b = backend.fetch_many("default", 2)
    stale_b = replace(lease_b, owner_token=STALE)

    lost, claimed = backend.ack_many_and_fetch([lease_a, stale_b], "default", 5)

    assert lost == [stale_b]
    assert ids(claimed) == [c.id, d.id]
    assert all(lease.ahead and not lease.must_begin for lease in claimed)
    assert claimed[0].owner_token not in (lease_a.owner_token, STALE)
    k = keys(backend)
    assert backend.client.hget(k.bodies, a.id) is None
    assert backend.client.hget(k.owners, b.id) == lease_b.owner_token.encode()
    assert backend.stats("default")["in_progress"] == 3

    lost, claimed = backend.ack_many_and_fetch([lease_b, *claimed], "default", 5)
    assert (lost, claimed) == ([], [])
    assert backend.size("default") == 0


def test_ack_many_and_fetch_with_a_lease_of_another_queue_still_does_both(backend):
    enqueue(backend, queue="other")
    waiting = enqueue(backend)
    [other] = backend.fetch_many("other", 1)

    lost, claimed = backend.ack_many_and_fetch([other], "default", 3)

    assert lost == []
    assert ids(claimed) == [waiting.id]
    assert backend.size("other") == 0


# -- begin --


def test_begin_ends_the_claim_ahead_and_extends_the_lease(backend):
    env = enqueue(backend)
    [lease] = backend.fetch_many("default", 1)
    before = lease.expires_at

    backend.begin(lease, 600)

    assert ahead_mark(backend, env.id) is None
    score = backend.client.zscore(keys(backend).processing, env.id)
    assert abs(score / 1000 - (time.time() + 600)) < 5
    assert lease.expires_at > before + timedelta(seconds=300)


def test_begin_is_fenced(backend):
    env = enqueue(backend)
    [lease] = backend.fetch_many("default", 1)
    score = backend.client.zscore(keys(backend).processing, env.id)

    with pytest.raises(LeaseLost):
        backend.begin(replace(lease, owner_token=STALE), 600)
    assert ahead_mark(backend, env.id) == b"1"
    assert backend.client.zscore(keys(backend).processing, env.id) == score


def test_extend_keeps_the_claim_ahead(backend):
    env = enqueue(backend)
    [lease] = backend.fetch_many("default", 1)
    backend.extend(lease, 600)
    assert ahead_mark(backend, env.id) == b"1"


# -- settles and single fetches end a claim ahead --


@pytest.mark.parametrize("settle", ["ack", "nack", "abandon"])
def test_every_settle_removes_the_ahead_mark(backend, settle):
    env = enqueue(backend)
    [lease] = backend.fetch_many("default", 1)
    assert ahead_mark(backend, env.id) == b"1"

    if settle == "ack":
        backend.ack(lease)
    elif settle == "nack":
        backend.nack(lease, 0, error="boom")
    else:
        backend.abandon(lease, "boom")

    assert ahead_mark(backend, env.id) is None


# -- reaping --


def test_a_lost_claim_ahead_is_handed_back_uncounted_and_must_begin_next_time(backend):
    env = enqueue(backend)
    [lease] = backend.fetch_many("default", 1)
    reaped: list[str] = []

    def on_reaped(sender: Any, **kwargs: Any) -> None:
        reaped.append(kwargs["job_id"])

    job_reaped.connect(on_reaped)
    try:
        lost_and_reaped(backend, lease)
    finally:
        job_reaped.disconnect(on_reaped)

    k = keys(backend)
    assert stored(backend, env.id).attempts == 0, "not a run"
    assert attempts_of(env.id, using=backend.history_alias) == []
    assert reaped == []
    assert backend.client.hget(k.errors, env.id) is None
    assert backend.client.zscore(k.waiting, env.id) is not None, "ready now"
    assert ahead_mark(backend, env.id) == b"2"
    with pytest.raises(LeaseLost):
        backend.ack(lease)

    [again] = backend.fetch_many("default", 5)
    assert again.token == env.id
    assert again.ahead and again.must_begin
    assert again.envelope is not None and again.envelope.attempts == 0
    assert ahead_mark(backend, env.id) == b"2", "still not begun"


def test_a_lost_lease_that_began_counts_a_run(backend):
    env = enqueue(backend, max_retries=3)
    [lease] = backend.fetch_many("default", 1)
    backend.begin(lease, 60)

    lost_and_reaped(backend, lease)

    assert stored(backend, env.id).attempts == 1
    [attempt] = attempts_of(env.id, using=backend.history_alias)
    assert (attempt.attempt, attempt.outcome) == (1, "lost")
    assert ahead_mark(backend, env.id) == b"2"  # its next run is begun first, as after a lost claim ahead
    [again] = backend.fetch_many("default", 1)
    assert again.must_begin


def test_a_second_loss_counts_once_the_reclaimed_message_began(backend):
    env = enqueue(backend, max_retries=3)
    [lease] = backend.fetch_many("default", 1)
    lost_and_reaped(backend, lease)
    [again] = backend.fetch_many("default", 1)
    assert again.must_begin
    backend.begin(again, 60)
    assert not again.must_begin, "begun"

    lost_and_reaped(backend, again)

    assert stored(backend, env.id).attempts == 1
    assert len(attempts_of(env.id, using=backend.history_alias)) == 1


def test_a_single_fetch_after_a_lost_claim_ahead_clears_the_mark(backend):
    env = enqueue(backend, max_retries=3)
    [lease] = backend.fetch_many("default", 1)
    lost_and_reaped(backend, lease)
    assert ahead_mark(backend, env.id) == b"2"

    single = backend.fetch("default")

    assert single is not None and single.token == env.id
    assert not single.ahead and not single.must_begin
    assert ahead_mark(backend, env.id) is None
    lost_and_reaped(backend, single)
    assert stored(backend, env.id).attempts == 1, "a lease fetched singly counts when lost"


def test_ack_fetch_leases_singly_and_clears_the_mark(backend):
    first, second = enqueue(backend), enqueue(backend)
    [lease_first] = backend.fetch_many("default", 1)
    [lease_second] = backend.fetch_many("default", 1)
    lost_and_reaped(backend, lease_second)
    assert ahead_mark(backend, second.id) == b"2"

    nxt = backend.ack_and_fetch(lease_first, "default")

    assert nxt is not None and nxt.token == second.id
    assert ahead_mark(backend, second.id) is None
    assert backend.client.hget(keys(backend).bodies, first.id) is None


def test_peek_and_stats_see_messages_claimed_ahead(backend):
    env = enqueue(backend)
    enqueue(backend)
    [lease] = backend.fetch_many("default", 1)

    live = backend.peek(env.id)
    assert live is not None and live.state == "in_progress"
    assert backend.stats("default") == {"pending": 1, "delayed": 0, "in_progress": 1, "failed": 0, "waiting": 0}
    lost_and_reaped(backend, lease)
    assert backend.stats("default") == {"pending": 2, "delayed": 0, "in_progress": 0, "failed": 0, "waiting": 0}
