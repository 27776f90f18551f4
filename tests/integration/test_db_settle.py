"""The database backend's batched settle (``backends/db_settle.py``): a batch's acks, recorded
starts and requeues written by one UPDATE, each row fenced on its own, checked row by row on
real PostgreSQL (both bindings) and on SQLite; and how many statements a batch costs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_jobs.backends.base import Lease, QueueBackend, Requeue
from django_jobs.models import Job
from django_jobs.reaper import recover_claims
from tests.backend_params import (
    ALL_DATABASES,
    BACKEND_PARAMS,
    PG_SERVER_SIDE_BINDING,
    BackendCase,
    backend_of,
    ready_case,
)
from tests.integration.test_conformance import enqueue
from tests.testapp.jobs import flow_step

BATCHED = ("database-postgres", "database-postgres-server-side-binding", "database-sqlite")
PARAMS = [param for param in [*BACKEND_PARAMS, PG_SERVER_SIDE_BINDING] if param.id in BATCHED]
STALE = "0" * 32


@pytest.fixture(params=PARAMS)
def case(request: pytest.FixtureRequest) -> BackendCase:
    return ready_case(request)


@pytest.fixture
def backend(case: BackendCase) -> Iterator[QueueBackend]:
    with backend_of(case) as built:
        assert built.batches_requeues
        yield built


def claim(backend: QueueBackend, case: BackendCase, count: int, **options: Any) -> list[Lease]:
    envelopes = [enqueue(backend, case, **options) for _ in range(count)]
    batch = backend.fetch_many("default", count)
    assert [lease.token for lease in batch] == [env.id for env in envelopes]
    return batch


def row(backend: Any, lease: Lease) -> Job:
    return Job.objects.using(backend.alias).get(pk=lease.token)


def test_one_call_settles_a_mixed_batch_each_row_fenced_on_its_own(backend, case):
    batch = claim(backend, case, 7, max_retries=3)
    acked, lost_ack, begun, requeued, uncounted, lost_requeue, aborted = batch
    Job.objects.using(backend.alias).filter(pk=aborted.token).update(abort_requested="ops")
    Job.objects.using(backend.alias).filter(pk=uncounted.token).update(last_error="RuntimeError: before")
    now = time.time()
    requeues = [
        Requeue(requeued, now + 60, "RuntimeError: again"),
        Requeue(uncounted, now, "", count_run=False),
        Requeue(replace(lost_requeue, owner_token=STALE), now, "RuntimeError: not ours"),
        Requeue(aborted, now, "RuntimeError: asked to stop"),
    ]
    stale_ack = replace(lost_ack, owner_token=STALE)

    lost, done = backend.settle_many([acked, stale_ack], [begun], requeues)

    assert lost == [stale_ack]
    assert done == [True, True, False, "ops"]
    ack_row = row(backend, acked)
    assert (ack_row.status, ack_row.attempts, ack_row.owner_token, ack_row.leased_until) == ("completed", 1, None, None)
    assert ack_row.finished_at is not None and ack_row.claimed_ahead == 0
    for untouched in (lost_ack, lost_requeue, aborted):  # still leased ahead, as claimed
        still = row(backend, untouched)
        assert (still.status, still.attempts, still.owner_token, still.claimed_ahead) == (
            "in_progress",
            0,
            untouched.owner_token,
            1,
        )
        assert still.last_error == ""
    started = row(backend, begun)  # its start recorded: still leased, no longer claimed ahead
    assert (started.status, started.attempts, started.owner_token, started.claimed_ahead) == (
        "in_progress",
        0,
        begun.owner_token,
        0,
    )
    assert started.leased_until is not None and started.finished_at is None
    again = row(backend, requeued)
    assert (again.status, again.attempts, again.owner_token, again.leased_until, again.claimed_ahead) == (
        "pending",
        1,
        None,
        None,
        0,
    )
    assert again.last_error == "RuntimeError: again" and again.finished_at is None
    assert 55 < (again.available_at - ack_row.finished_at).total_seconds() < 65  # its backoff kept
    back = row(backend, uncounted)  # not a run: no attempt, the last error kept
    assert (back.status, back.attempts, back.last_error) == ("pending", 0, "RuntimeError: before")
    assert [lease.token for lease in backend.fetch_many("default", 10)] == [uncounted.token]


def test_an_ack_of_a_job_others_wait_for_resolves_their_edges(backend, case):
    parent = flow_step.using(backend=case.name).prepare(None, "parent", case.side_effect_db, "ok").dispatch()
    child = (
        flow_step.using(backend=case.name, depends_on=[parent])
        .prepare(None, "child", case.side_effect_db, "ok")
        .dispatch()
    )
    [lease] = backend.fetch_many("default", 5)

    lost, claimed_lost, claimed = backend.settle_many_and_fetch([lease], [], "default", 5)
    if not claimed:  # the claim ran before the transactional ack released the child
        claimed = backend.fetch_many("default", 5)

    assert (lost, claimed_lost) == ([], [])
    assert [one.token for one in claimed] == [child]
    assert (row(backend, lease).status, row(backend, lease).attempts) == ("completed", 1)


def test_settle_and_claim_takes_a_run_requeued_due_at_once(backend, case):
    first, second = claim(backend, case, 2, max_retries=2)

    lost, done, claimed = backend.settle_many_and_fetch(
        [first], [Requeue(second, time.time(), "RuntimeError: again")], "default", 5
    )

    assert (lost, done) == ([], [True])
    assert [(lease.token, lease.envelope.attempts, lease.ahead) for lease in claimed] == [(second.token, 1, True)]
    assert row(backend, second).owner_token == claimed[0].owner_token


def statements(backend: Any, call: Any) -> int:
    with CaptureQueriesContext(connections[backend.alias]) as queries:
        call()
    return len(queries)


# (SQLite writes a batch and its claim in one transaction of two statements.)
@pytest.mark.parametrize("case", [param for param in PARAMS if "postgres" in str(param.id)], indirect=True)
def test_a_batch_costs_one_statement_and_a_refused_requeue_one_more(backend, case):
    warm = claim(backend, case, 2)  # the statements are prepared on first use (PostgreSQL)
    backend.settle_many([warm[0]], [warm[1]], [])
    backend.settle_many_and_fetch([warm[1]], [], "other", 5)
    batch = claim(backend, case, 6, max_retries=3)
    later = time.time() + 60
    requeues = [Requeue(lease, later, "RuntimeError: again") for lease in batch[3:5]]

    assert statements(backend, lambda: backend.settle_many(batch[:2], [batch[2]], requeues)) == 1
    stale = Requeue(replace(batch[5], owner_token=STALE), later, "RuntimeError: not ours")
    assert statements(backend, lambda: backend.settle_many([], [], [stale])) == 2  # lost, or asked to abort?
    more = claim(backend, case, 4, max_retries=3)
    assert statements(backend, lambda: backend.settle_many_and_fetch(more[:2], requeues[:0], "default", 5)) == 1
    again = [Requeue(lease, later, "RuntimeError: again") for lease in more[2:]]
    assert statements(backend, lambda: backend.settle_many_and_fetch([], again, "default", 5)) == 1


@contextmanager
def held(alias: str, lock: Callable[[], object]) -> Iterator[threading.Event]:
    """``lock()`` run in a transaction of another thread, on a connection of its own, and held
    open until the block ends, or until the event it yields is set."""
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic(using=alias):
                lock()
                locked.set()
                release.wait(30)
        finally:
            connections[alias].close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(10)
        yield release
    finally:
        release.set()
        holder.join()


@pytest.mark.django_db(databases=[*ALL_DATABASES, "postgres_ssb"], transaction=True)
def test_a_row_another_transaction_holds_does_not_hold_up_the_reaper(backend, case):
    """A worker stopped inside its settle's transaction (SIGSTOP, a paused VM) keeps its rows
    locked while their leases expire. The reaper must not wait for it: it would hold up every
    row after it, and the worker that runs the reap. It skips the held row until the lock is
    gone and reaps the others."""
    if connections[backend.alias].vendor != "postgresql":
        pytest.skip("PostgreSQL: rows locked one by one (SQLite has one writer)")
    held_row, other, ahead = claim(backend, case, 3, max_retries=3)
    jobs = Job.objects.using(backend.alias)
    jobs.update(leased_until=timezone.now() - timedelta(seconds=5), claimed_ahead=0)  # both begun, and
    jobs.filter(pk=ahead.token).update(claimed_ahead=1)  # one still claimed ahead

    def reap() -> None:
        try:
            reaped.append(backend.reap_expired("default"))
        finally:
            connections[backend.alias].close()

    reaped: list[int] = []
    with held(backend.alias, lambda: list(jobs.select_for_update().filter(pk__in=[held_row.token, ahead.token]))):
        reaper = threading.Thread(target=reap, daemon=True)
        reaper.start()
        reaper.join(10)
        assert not reaper.is_alive(), "the reaper waited for the other transaction"
        assert reaped == [1]
        assert (row(backend, other).status, row(backend, other).attempts) == ("pending", 1)
        assert row(backend, held_row).status == row(backend, ahead).status == "in_progress"
    assert backend.reap_expired("default") == 2  # the lock gone: the next pass reaps them
    assert (row(backend, held_row).status, row(backend, held_row).attempts) == ("pending", 1)
    assert (row(backend, ahead).status, row(backend, ahead).attempts) == ("pending", 0)


@pytest.mark.django_db(databases=[*ALL_DATABASES, "postgres_ssb"], transaction=True)
def test_a_dead_workers_acks_outlast_a_transient_database_error(backend, case):
    """The supervisor acks the successes a dead worker process had not acked. A lock timeout
    on the first try is tried again, as a worker's own settle is: given up at once, those jobs
    went to the reaper, handed back as never begun, and ran again uncounted."""
    if connections[backend.alias].vendor != "postgresql":
        pytest.skip("PostgreSQL: a lock timeout")
    batch = claim(backend, case, 3)

    def lock_table() -> None:
        with connections[backend.alias].cursor() as cursor:
            cursor.execute(f"LOCK TABLE {Job._meta.db_table} IN SHARE MODE")

    with held(backend.alias, lock_table) as release:
        with connections[backend.alias].cursor() as cursor:
            cursor.execute("SET lock_timeout = '100ms'")  # the first try fails; a fresh connection waits
        threading.Timer(0.5, release.set).start()
        try:
            recover_claims(backend, "default", batch[0].owner_token, [], [lease.token for lease in batch])
        finally:
            connections[backend.alias].close()  # the SET goes with its session, whatever happened
    assert [row(backend, lease).status for lease in batch] == ["completed"] * 3
    assert [row(backend, lease).attempts for lease in batch] == [1, 1, 1]
