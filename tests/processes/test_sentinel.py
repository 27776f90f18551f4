"""The Redis backend through Redis Sentinel, on a private group (a primary, a replica, three
sentinels: ``private_sentinel``) whose primary these tests fail over and kill.

The protocol through Sentinel is covered by the conformance suite (its ``redis-sentinel`` case,
on the shared group) and the flows tests; workers following failovers while they run, by the
chaos battery's ``failover`` scenario (tests/processes/test_chaos_short.py). This file covers
what a client of one process sees: after a failover it talks to the new primary, its Lua scripts
load again there, a killed primary is an outage (never a failed command), and a primary that
refuses writes for want of replicas (``min-replicas-to-write``) is one too, and a primary
whose sentinels do not answer goes on serving.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from django_jobs import Jobs
from django_jobs.backends.redis import RedisBackend
from django_jobs.backends.redis_connection import RECHECK, NoReplicasError
from django_jobs.envelope import Envelope

pytestmark = [pytest.mark.slow, pytest.mark.django_db]


def direct(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)


def job() -> Envelope:
    return Jobs.define("abortable", {}).build()


@pytest.fixture
def backend(private_sentinel: Any) -> Iterator[RedisBackend]:
    instance = RedisBackend("ha", {"URL": private_sentinel.url, "PREFIX": f"ha{uuid.uuid4().hex[:8]}"})
    yield instance
    instance.close()


def primary_port(backend: RedisBackend) -> int:
    """The port of the server the backend's client talks to."""
    return int(backend.client.connection_pool.master_address[1])


def test_after_a_failover_the_backend_works_on_the_new_primary(private_sentinel, backend):
    private_sentinel.settle()  # the primary has a replica in sync (a demoted one rejoins in up to 10 s)
    waiting = job()
    backend.enqueue(waiting)
    assert backend.client.execute_command("WAIT", 1, 5000) == 1  # the replica has it
    new, _acted, _named = private_sentinel.failover()
    # The client asks the sentinels who the primary is at most every RECHECK seconds.
    time.sleep(RECHECK + 0.1)

    lease = backend.fetch("default")
    assert lease is not None and lease.token == waiting.id
    assert primary_port(backend) == new
    # The claim is on the new primary, not on the demoted one (which still answers).
    assert direct(new).zscore(backend.keys("default").processing, waiting.id) is not None
    backend.ack(lease)
    assert backend.size("default") == 0


def test_scripts_load_again_on_a_primary_that_lost_them(private_sentinel, backend):
    # As on a replica promoted before it ever ran them: every script of the backend is unknown.
    backend.enqueue(job())
    direct(private_sentinel.primary()).script_flush()
    second = job()
    backend.enqueue(second)  # one script (redis-py loads it on NOSCRIPT)
    leases = backend.fetch_many("default", 5)
    assert len(leases) == 2
    direct(private_sentinel.primary()).script_flush()
    assert backend.ack_many(leases) == []  # a batch of scripts by SHA: loaded and resent
    assert backend.size("default") == 0


def test_pipelined_scripts_run_on_a_new_primary_that_never_loaded_them(private_sentinel, backend):
    """``send()`` after a failover: the calls by SHA that met ``NOSCRIPT`` on the new primary are
    sent again once the scripts are loaded there."""
    private_sentinel.settle()
    backend.enqueue_many([job() for _ in range(3)])
    leases = backend.fetch_many("default", 3)
    assert len(leases) == 3
    assert backend.client.execute_command("WAIT", 1, 5000) == 1  # the replica has the leases
    new, _acted, _named = private_sentinel.failover()
    direct(new).script_flush()  # as on a replica promoted before it ever ran them
    time.sleep(RECHECK + 0.1)  # the client asks the sentinels again

    assert backend.ack_many(leases) == []  # one pipeline of ack scripts by SHA
    assert primary_port(backend) == new
    direct(new).script_flush()
    backend.enqueue_many([job() for _ in range(2)])  # one pipeline of enqueue scripts by SHA
    assert backend.size("default") == 2
    assert all(direct(new).script_exists(lua.sha)[0] for lua in backend._scripts.values())


def test_a_killed_primary_is_an_outage_that_ends_with_the_promotion(private_sentinel, backend):
    private_sentinel.settle()
    backend.enqueue(job())
    assert backend.client.execute_command("WAIT", 1, 5000) == 1
    new, _killed, _named = private_sentinel.kill_primary()

    errors = []
    deadline = time.monotonic() + 30
    while True:
        try:
            lease = backend.fetch("default")
            break
        except Exception as exc:  # noqa: BLE001 - every error is checked below
            # A worker waits and tries again on these; anything else would fail a job.
            assert isinstance(exc, backend.unavailable_errors), repr(exc)
            errors.append(type(exc).__name__)
            assert time.monotonic() < deadline, errors
            time.sleep(0.2)
    assert lease is not None and primary_port(backend) == new
    backend.ack(lease)


def test_a_primary_short_of_replicas_refuses_a_dispatch_as_unavailable(private_sentinel, backend):
    primary = direct(private_sentinel.primary())
    primary.config_set("min-replicas-to-write", 2)  # it has one replica
    try:
        with pytest.raises(NoReplicasError) as caught:
            backend.enqueue(job())
        assert isinstance(caught.value, backend.unavailable_errors)
    finally:
        primary.config_set("min-replicas-to-write", 0)
    assert backend.size("default") == 0  # nothing was written
    backend.enqueue(job())
    assert backend.size("default") == 1


def test_the_backend_keeps_working_while_no_sentinel_answers(private_sentinel, backend):
    backend.enqueue(job())  # connected: the sentinels named the primary
    private_sentinel.stop_sentinels()
    try:
        # Past RECHECK the client asks them again; unanswered, it keeps its primary.
        time.sleep(RECHECK + 0.1)
        lease = backend.fetch("default")
        assert lease is not None
        backend.ack(lease)
        backend.enqueue(job())
        assert backend.size("default") == 1
    finally:
        private_sentinel.start_sentinels()
