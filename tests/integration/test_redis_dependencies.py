"""Job dependencies on the Redis backend, against a real Redis server: a child waits blocked in
its queue, attached to each parent in the parent's queue; a parent's settle writes its outcome
into its queue's outbox (``finished``), which is drained at once and replayed by the sweep
(``resolve_dependents``).

Key names come from ``backend.keys(queue)``; every key lives under this session's prefix, which
the ``redis_up`` fixture clears before each test and the ``backend`` fixture after it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from django_jobs import Jobs, chain, group
from django_jobs.backends.base import Lease
from django_jobs.backends.redis import SEP, RedisBackend, lex_range
from django_jobs.envelope import Envelope
from django_jobs.models import Job, JobAttempt
from django_jobs.worker import QueueWorker, WorkerResult
from tests.testapp.jobs import flow_step, scripted
from tests.testapp.models import SideEffect

pytestmark = [pytest.mark.django_db(databases=["default", "postgres"]), pytest.mark.usefixtures("clean_state")]


@pytest.fixture
def backend(redis_topology_backend: RedisBackend) -> RedisBackend:
    """On a single Redis, then on the Redis Cluster."""
    return redis_topology_backend


def job(backend: RedisBackend, *parents: str, queue: str = "default", **options: Any) -> Envelope:
    """Send a scripted job (``action`` in ``options``, default ok) waiting for ``parents``."""
    action = options.pop("action", "ok")
    key = options.pop("key", None)
    builder = scripted.using(backend="redis", queue=queue, backoff={"strategy": "none"}, **options)
    env = builder.builder(action=action, key=key).depends_on(*parents).build()
    backend.enqueue(env)
    return env


def run(queue: str = "default") -> WorkerResult:
    return QueueWorker("redis", [queue]).process_once()


def blocked_on(backend: RedisBackend, job_id: str, queue: str = "default") -> list[str] | None:
    """The parents a blocked job still waits for, sorted (its open edges); ``None``: not blocked."""
    keys = backend.keys(queue)
    if backend.client.hget(keys.blocked, job_id) is None:
        return None
    return [member.decode().split(SEP)[1] for member in backend.client.zrangebylex(keys.edges, *lex_range(job_id))]


def dependents_of(backend: RedisBackend, job_id: str, queue: str = "default") -> list[str]:
    """The children attached to a parent, sorted."""
    members = backend.client.zrangebylex(backend.keys(queue).dependents, *lex_range(job_id))
    return [member.decode().split(SEP)[1] for member in members]


def is_ready(backend: RedisBackend, job_id: str, queue: str = "default") -> bool:
    return backend.client.zscore(backend.keys(queue).waiting, job_id) is not None


def readied(backend: RedisBackend, queue: str = "default") -> int:
    """How many times a message of ``queue`` was made ready (each takes a sequence number)."""
    return int(backend.client.get(backend.keys(queue).sequence) or 0)


def history(job_id: str) -> list[tuple[int, str, str, str, str]]:
    rows = JobAttempt.objects.filter(job_id=job_id).order_by("id")
    return [(a.attempt, a.outcome, a.worker_id, a.error, a.error_class) for a in rows]


def leased(backend: RedisBackend, job_id: str, queue: str = "default") -> Lease:
    lease = backend.fetch(queue)
    assert lease is not None and lease.token == job_id
    return lease


def outbox_and_edges_empty(backend: RedisBackend, *queues: str) -> bool:
    return not any(
        backend.client.exists(keys.finished, keys.dependents, keys.blocked, keys.edges)
        for keys in (backend.keys(q) for q in queues or ("default",))
    )


PARENT_FAILED = "django_jobs.exceptions.ParentFailed"
PARENT_CANCELLED = "django_jobs.exceptions.ParentCancelled"


# -- release --


def test_a_child_waits_blocked_until_every_parent_completed(backend):
    a, b = job(backend), job(backend)
    child = job(backend, a.id, b.id, key="child")

    assert blocked_on(backend, child.id) == sorted([a.id, b.id])
    assert not is_ready(backend, child.id)
    assert backend.peek(child.id).state == "pending"  # live, not leased
    assert run().job_id == a.id
    assert blocked_on(backend, child.id) == [b.id]
    assert run().job_id == b.id

    assert blocked_on(backend, child.id) is None and is_ready(backend, child.id)
    assert run().job_id == child.id
    assert SideEffect.objects.filter(key="child").count() == 1
    assert outbox_and_edges_empty(backend)


def test_a_child_in_another_queue_waits_for_a_parent_of_this_one(backend):
    parent = job(backend)
    child = job(backend, parent.id, queue="other")

    assert dependents_of(backend, parent.id) == [child.id]
    run()

    assert is_ready(backend, child.id, "other")
    assert outbox_and_edges_empty(backend, "default", "other")


def test_a_released_child_keeps_its_own_delay(backend):
    parent = job(backend)
    child = job(backend, parent.id, delay=3600)
    run()

    due = backend.client.zscore(backend.keys("default").delayed, child.id)
    assert due is not None and due / 1000 > time.time() + 3000
    assert not is_ready(backend, child.id)


def test_a_chain_sent_through_the_api_runs_in_order_and_passes_results(
    backend, django_capture_on_commit_callbacks, monkeypatch
):
    from django_jobs import audit

    stored: list[str] = []
    record_result = audit.record_result
    monkeypatch.setattr(audit, "record_result", lambda env, *rest: (stored.append(env.id), record_result(env, *rest)))
    with django_capture_on_commit_callbacks(execute=True):
        first, second, third = chain(
            flow_step.using(backend="redis").prepare(None, "a"),
            flow_step.using(backend="redis").prepare("b"),
            flow_step.using(backend="redis").prepare("c"),
            pass_result=True,
        ).dispatch()

    assert [run().job_id for _ in range(3)] == [first, second, third]
    assert Job.objects.get(pk=second).result == ["a", "b"]
    assert stored == [first, second]  # each once, though each was also stored before its release
    assert outbox_and_edges_empty(backend)


def test_a_kept_result_is_stored_before_the_dependents_are_released(backend, monkeypatch):
    parent = job(backend, keep_result=True)
    child = job(backend, parent.id)
    seen: list[Any] = []
    resolve = backend._resolve

    def resolving(edges: Any, *rest: Any) -> int:
        seen.append(Job.objects.filter(pk=parent.id).values_list("status", "result").first())
        return resolve(edges, *rest)

    monkeypatch.setattr(backend, "_resolve", resolving)
    run()

    assert seen == [("completed", "ok")]
    assert is_ready(backend, child.id)


def test_a_group_callback_runs_once_after_every_member_however_each_ended(backend, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        *members, callback = (
            group(
                scripted.using(backend="redis", max_retries=0).prepare(action="ok"),
                scripted.using(backend="redis", max_retries=0).prepare(action="raise"),
            )
            .then(scripted.using(backend="redis").prepare(action="ok", key="callback"))
            .dispatch()
        )

    assert [run().job_id, run().job_id] == members
    assert run().job_id == callback
    assert SideEffect.objects.filter(key="callback").count() == 1


# -- failure and cancellation --


def test_a_failed_parent_fails_its_descendants_with_reasons_and_history(backend):
    a = job(backend, action="raise", max_retries=0)
    b = job(backend, a.id, key="b")
    c = job(backend, b.id, key="c")

    assert run().status == "dead-lettered"

    for child, parent in ((b, a), (c, b)):
        row = Job.objects.get(pk=child.id)
        assert (row.status, row.backend, row.attempts) == ("failed", "redis", 0)
        assert row.last_error == f"ParentFailed: parent {parent.id} failed"
        assert history(child.id) == [(1, "failed", "flow", row.last_error, PARENT_FAILED)]
        assert backend.client.zscore(backend.keys("default").failed, child.id) is not None
        assert backend.client.hget(backend.keys("default").errors, child.id).decode() == row.last_error
    assert run().status == "empty"
    assert not SideEffect.objects.filter(key__in=["b", "c"]).exists()
    assert outbox_and_edges_empty(backend)


def test_a_failed_parent_keeps_its_row_when_its_worker_dies_resolving_its_children(backend, monkeypatch):
    a = job(backend, action="raise", max_retries=0)
    b = job(backend, a.id, key="b")

    def killed(parents: Any) -> None:  # the worker dies before resolving anything
        raise SystemExit("killed")

    monkeypatch.setattr(backend, "_release", killed)
    with pytest.raises(SystemExit):
        run()
    assert Job.objects.get(pk=a.id).status == "failed"
    monkeypatch.undo()
    assert blocked_on(backend, b.id) == [a.id]
    assert backend.resolve_dependents() == 1
    assert Job.objects.get(pk=b.id).last_error == f"ParentFailed: parent {a.id} failed"


def test_run_if_parent_fails_releases_the_child_after_a_failure(backend):
    parent = job(backend, action="raise", max_retries=0)
    child = job(backend, parent.id, run_if_parent_fails=True, key="child")
    run()

    assert run().job_id == child.id
    assert SideEffect.objects.filter(key="child").count() == 1


def test_aborting_a_pending_parent_cancels_its_descendants(backend):
    a = job(backend)
    b = job(backend, a.id)
    c = job(backend, b.id)

    assert Jobs.abort(a.id, "ops") == "cancelled"

    for child, parent in ((b, a), (c, b)):
        row = Job.objects.get(pk=child.id)
        assert (row.status, row.last_error) == ("cancelled", f"ParentCancelled: parent {parent.id} was cancelled")
        assert history(child.id) == [(1, "cancelled", "flow", row.last_error, PARENT_CANCELLED)]
        assert backend.peek(child.id) is None
    assert run().status == "empty"
    assert outbox_and_edges_empty(backend)


def test_aborting_a_blocked_child_cancels_it_and_its_own_children_only(backend):
    a = job(backend)
    b = job(backend, a.id)
    c = job(backend, b.id)

    assert Jobs.abort(b.id, "ops") == "cancelled"

    assert Job.objects.get(pk=b.id).last_error == "Aborted by ops"
    assert Job.objects.get(pk=c.id).last_error == f"ParentCancelled: parent {b.id} was cancelled"
    assert blocked_on(backend, b.id) is None and blocked_on(backend, c.id) is None
    assert run().job_id == a.id  # its edge to the cancelled child resolves to nothing
    assert run().status == "empty"
    assert outbox_and_edges_empty(backend)


def test_a_running_parent_aborted_cancels_its_child(backend):
    parent = job(backend)
    child = job(backend, parent.id)
    lease = leased(backend, parent.id)

    backend.cancel(lease, "Aborted by ops")

    row = Job.objects.get(pk=child.id)
    assert (row.status, row.last_error) == ("cancelled", f"ParentCancelled: parent {parent.id} was cancelled")


def test_a_parent_reaped_for_good_fails_its_child(backend):
    parent = job(backend, max_retries=0)
    child = job(backend, parent.id)
    lease = leased(backend, parent.id)
    backend.client.zadd(backend.keys("default").processing, {lease.token: (time.time() - 5) * 1000}, xx=True)

    assert backend.reap_expired("default") == 1

    assert Job.objects.get(pk=child.id).last_error == f"ParentFailed: parent {parent.id} failed"


def test_a_child_of_parents_already_finished_is_settled_at_dispatch(backend):
    failed = job(backend, action="raise", max_retries=0)
    run()  # kept in the failed set
    cancelled = job(backend)
    Jobs.abort(cancelled.id, "ops")  # forgotten by Redis, a cancelled Job row
    completed = job(backend)
    run()  # forgotten by Redis, no row at all

    assert Job.objects.get(pk=job(backend, failed.id).id).status == "failed"
    assert Job.objects.get(pk=job(backend, cancelled.id).id).status == "cancelled"
    assert is_ready(backend, job(backend, completed.id).id)
    assert is_ready(backend, job(backend, "never-dispatched").id)  # unknown: counted as completed


# -- exactly once, and the sweep --


def test_two_parents_finishing_at_once_release_the_child_exactly_once(backend):
    for _ in range(20):
        a, b = job(backend), job(backend)
        child = job(backend, a.id, b.id)
        leases = [leased(backend, a.id), leased(backend, b.id)]
        before = readied(backend)
        start = threading.Barrier(2)

        def ack(lease: Lease, start: threading.Barrier = start) -> None:
            start.wait()
            backend.ack(lease)

        threads = [threading.Thread(target=ack, args=(lease,)) for lease in leases]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        assert readied(backend) == before + 1
        assert leased(backend, child.id).token == child.id
    assert outbox_and_edges_empty(backend)


def test_the_sweep_replays_an_outbox_left_by_a_crash_once(backend):
    parent = job(backend)
    child = job(backend, parent.id)
    lease = leased(backend, parent.id)
    # The ack script ran, then the worker died before draining the parent's outbox.
    assert backend._run("ack", "default", lease.token, lease.owner_token, "completed") == 2
    assert backend.client.hget(backend.keys("default").finished, parent.id) == b"completed"
    before = readied(backend)

    assert backend.resolve_dependents() == 1
    assert backend.resolve_dependents() == 0

    assert readied(backend) == before + 1 and is_ready(backend, child.id)
    assert outbox_and_edges_empty(backend)


def test_the_sweep_replays_a_drain_cut_between_its_steps(backend):
    parent = job(backend, action="raise", max_retries=0)
    child = job(backend, parent.id)
    grandchild = job(backend, child.id)
    lease = leased(backend, parent.id)
    assert backend._run("abandon", "default", lease.token, lease.owner_token, b"", 0, "boom") == 2
    # The child's edge was resolved (it failed, its outcome in the outbox), nothing was drained.
    reply = backend._run("resolve", "default", child.id, parent.id, "failed", 0, f"ParentFailed: parent {parent.id}")
    assert reply[2] == 2

    assert backend.resolve_dependents() == 1  # the grandchild; the child's edge was resolved already
    assert backend.resolve_dependents() == 0

    assert Job.objects.get(pk=grandchild.id).last_error == f"ParentFailed: parent {child.id} failed"
    assert outbox_and_edges_empty(backend)


@pytest.mark.parametrize("parent_ends", ["completed", "failed", "live"])
def test_the_sweep_resolves_a_child_whose_attach_never_happened(backend, parent_ends):
    parent = job(backend, action="raise" if parent_ends == "failed" else "ok", max_retries=0)
    child = scripted.using(backend="redis").builder(action="ok").depends_on(parent.id).build()
    backend.send(backend._block(child))  # stored blocked; the process died before attaching it
    if parent_ends != "live":
        run()  # the parent settles with no dependents known
    assert blocked_on(backend, child.id) == [parent.id]

    moved = backend.resolve_dependents()

    if parent_ends == "completed":
        assert moved == 1 and is_ready(backend, child.id)
    elif parent_ends == "failed":
        assert moved == 1 and Job.objects.get(pk=child.id).status == "failed"
    else:  # attached now: its parent's ack releases it
        assert moved == 0 and blocked_on(backend, child.id) == [parent.id]
        run()
        assert is_ready(backend, child.id)


def test_a_child_of_more_parents_than_one_attach_script_links(backend):
    from django_jobs.backends.redis import LINK_BATCH

    builder = scripted.using(backend="redis", backoff={"strategy": "none"})
    parents = [builder.builder(action="ok").build() for _ in range(LINK_BATCH * 2 + 1)]
    child = builder.builder(action="ok").depends_on(*(p.id for p in parents)).build()
    backend.enqueue_many([*parents, child])
    assert backend.client.zcard(backend.keys("default").dependents) == len(parents)
    assert backend.resolve_dependents() == 0  # every edge attached: nothing to do, nothing added
    before = readied(backend)

    while claimed := backend.fetch_many("default", 100):
        assert backend.ack_many(claimed) == []
        if child.id in [lease.token for lease in claimed]:
            break

    assert readied(backend) == before + 1
    assert outbox_and_edges_empty(backend)


def test_parents_with_ids_that_json_escapes_are_resolved_one_by_one(backend):
    from dataclasses import replace

    from django_jobs import signing

    odd = ["a/b", "é", 'q"uote', "x\\y", "a", "[b],"]
    parents = []
    for job_id in odd:  # ids as another system may choose them: signed under that id
        env = replace(scripted.using(backend="redis").builder(action="ok").build(), id=job_id)
        env.signature = signing.sign(env)
        backend.enqueue(env)
        parents.append(env)
    child = job(backend, *odd)
    assert blocked_on(backend, child.id) == sorted(odd)

    for done, parent in enumerate(parents, 1):
        backend.ack(leased(backend, parent.id))
        assert blocked_on(backend, child.id) == (sorted(odd[done:]) or None)

    assert is_ready(backend, child.id)


# -- batches and the hot path --


def test_batched_acks_release_dependents(backend):
    parents = [job(backend) for _ in range(3)]
    child = job(backend, *(p.id for p in parents))
    claimed = backend.fetch_many("default", 3)

    assert backend.ack_many(claimed) == []

    assert is_ready(backend, child.id)
    lost, more = backend.ack_many_and_fetch(backend.fetch_many("default", 1), "default", 5)
    assert (lost, more) == ([], [])


@pytest.mark.parametrize(
    "settle",
    [
        lambda b, lease: b.ack(lease),
        lambda b, lease: b.ack_and_fetch(lease, "default"),
        lambda b, lease: b.ack_many([lease]),
        lambda b, lease: b.ack_many_and_fetch([lease], "default", 2),
        lambda b, lease: b.abandon(lease, "boom"),
    ],
    ids=["ack", "ack_and_fetch", "ack_many", "ack_many_and_fetch", "abandon"],
)
def test_a_job_without_dependents_settles_without_any_dependency_step(
    backend, monkeypatch, settle: Callable[[RedisBackend, Lease], Any]
):
    for name in ("_drain", "_link", "_resolve"):
        monkeypatch.setattr(backend, name, lambda *args, name=name: pytest.fail(f"{name} called"))
    lease = leased(backend, job(backend).id)

    settle(backend, lease)

    assert outbox_and_edges_empty(backend)


def test_stats_count_blocked_jobs_as_waiting(backend):
    parent = job(backend)
    job(backend, parent.id)
    job(backend, parent.id, delay=3600)

    assert backend.stats("default") == {"pending": 1, "delayed": 0, "in_progress": 0, "failed": 0, "waiting": 2}
    assert backend.size("default") == 3
