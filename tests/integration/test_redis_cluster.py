"""The Redis backend on a Redis Cluster (3 primaries, scripts/services.d/redis-cluster.sh): each
queue's keys share one slot, queues spread over the primaries, a worker waits on queues of
several slots, and scripts a server lost are loaded again mid-pipeline.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from django_jobs.backends import redis_connection
from django_jobs.backends.redis import RedisBackend
from tests.testapp.jobs import scripted

pytestmark = [pytest.mark.django_db(databases=["default", "postgres"])]

# The test settings' queues: their hash tags fall on the three primaries of the test cluster
# (slots 5718, 11361 and 3728; docs/operations.md shows the map).
QUEUES = ["default", "other", "emails"]


@pytest.fixture
def backend(redis_topology_backend: RedisBackend) -> RedisBackend:
    return redis_topology_backend


def cluster_only(backend: RedisBackend) -> None:
    if not redis_connection.is_cluster(backend.client):
        pytest.skip("a cluster's behaviour")


def send(backend: RedisBackend, queue: str) -> str:
    env = scripted.using(backend="redis", queue=queue).builder(action="ok").build()
    return backend.enqueue(env)


def test_each_queue_keeps_to_one_slot_and_the_queues_spread_over_the_primaries(backend):
    cluster_only(backend)
    client = backend.client
    homes = {}
    for queue in QUEUES:
        keys = backend.keys(queue)
        assert len({client.keyslot(key) for key in keys}) == 1, f"the keys of {queue!r} span slots"
        job_id = send(backend, queue)
        node = client.get_node_from_key(keys.waiting)
        # The message is on that primary itself, not only reachable through the cluster.
        assert node.redis_connection.zscore(keys.waiting, job_id) is not None
        homes[queue] = node.name
    assert len(set(homes.values())) == 3, homes
    assert {node.name for node in client.get_primaries()} == set(homes.values())


def test_a_script_a_server_lost_is_loaded_again_and_nothing_runs_twice(backend):
    """A restarted server or a promoted replica has no scripts: a pipeline's calls that met
    NOSCRIPT did not run and are sent again, the others are not (one server of a cluster
    lost them here)."""
    first = [send(backend, queue) for queue in QUEUES]
    redis_connection.servers(backend.client)[0].script_flush()
    envs = [scripted.using(backend="redis", queue=q).builder(action="ok").build() for q in QUEUES * 2]
    backend.enqueue_many(envs)  # one pipeline over every queue (every primary of a cluster)
    for queue in QUEUES:
        # Each message made ready once: one sequence number each (a call sent twice takes two).
        assert int(backend.client.get(backend.keys(queue).sequence)) == 3
        fetched = {lease.token for lease in backend.fetch_many(queue, 10)}
        assert fetched == {first[QUEUES.index(queue)]} | {e.id for e in envs if e.queue == queue}


def test_a_worker_waiting_on_queues_in_several_slots_wakes_for_any_of_them(backend):
    cluster_only(backend)
    assert len(redis_connection.by_slot(backend.client, [backend.keys(q).notify for q in QUEUES])) == 3
    for queue in QUEUES:
        backend.client.delete(backend.keys(queue).notify)
    waiter = RedisBackend("redis", backend.options)  # a client of its own, as a worker has
    woke: list[Any] = []
    thread = threading.Thread(target=lambda: woke.append(waiter.wait_for_work(QUEUES, 60)), daemon=True)
    thread.start()
    send(backend, QUEUES[-1])  # the last slot the waiter looks at
    thread.join(30)
    waiter.close()
    assert woke == [True], "the waiter slept through work on one of its queues"


def test_purging_a_queues_failed_set_is_one_slots_transaction(backend):
    """``purge_failed`` deletes with MULTI: one queue's keys, one slot, one primary."""
    job_id = send(backend, "other")
    lease = backend.fetch("other")
    assert lease is not None and lease.token == job_id
    backend.abandon(lease, "boom")
    keys = backend.keys("other")
    assert backend.client.zscore(keys.failed, job_id) is not None
    assert backend.purge_failed("other") == 1
    assert not backend.client.exists(keys.failed, keys.errors, keys.bodies)


def test_a_failed_row_left_unwritten_is_written_by_the_sweep_within_its_queues_slot(backend):
    """``record_missed_failures`` reads a queue's ``unrecorded``, failed set, bodies and errors
    in one pipeline, and takes the ids out in another: one queue's keys, one slot."""
    from django_jobs.models import Job

    job_id = send(backend, "emails")
    lease = backend.fetch("emails")
    assert lease is not None and lease.token == job_id
    backend._fail(lease, "RuntimeError: boom", True)  # the script, and no row: its worker died there
    keys = backend.keys("emails")
    backend.client.zadd(keys.unrecorded, {job_id: (time.time() - 120) * 1000}, xx=True)
    assert backend.record_missed_failures() == 1
    row = Job.objects.get(pk=job_id)
    assert (row.status, row.queue, row.attempts, row.last_error) == ("failed", "emails", 1, "RuntimeError: boom")
    assert backend.client.zcard(keys.unrecorded) == 0


def test_run_jobs_brings_delayed_jobs_of_several_slots_forward(backend):
    """``run_jobs(include_delayed=True)`` shifts the delayed jobs of every queue at once."""
    from django_jobs.testing import run_jobs

    for hours, queue in enumerate(QUEUES, start=1):
        env = scripted.using(backend="redis", queue=queue, delay=hours * 3600).builder(action="ok").build()
        backend.enqueue(env)
    results = run_jobs(QUEUES, backend=backend, include_delayed=True)
    assert [r.status for r in results] == ["acked"] * 3
    assert [r.queue for r in results] == QUEUES  # in the order they fell due


def test_a_cluster_needs_a_url_or_startup_nodes():
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match="STARTUP_NODES"):
        redis_connection.connect("jobs", {"CLUSTER": True})


def test_a_cluster_none_of_whose_startup_nodes_answers_is_an_outage():
    """A worker waits out an outage (``unavailable_errors``); a cluster it cannot reach is one."""
    from tests.servers import free_port

    backend = RedisBackend("jobs", {"CLUSTER": True, "STARTUP_NODES": [("127.0.0.1", free_port())]})
    with pytest.raises(backend.unavailable_errors):
        backend.client  # noqa: B018


def test_the_persistence_warning_names_every_primary_that_keeps_nothing(backend):
    """The test cluster keeps nothing on disk (scripts/services.d/redis-cluster.sh): each of its
    primaries is named."""
    cluster_only(backend)
    warning = backend.persistence_warning()
    assert warning is not None
    for server in redis_connection.servers(backend.client):
        assert redis_connection.address(server) in warning
