"""Job dependencies, chains and groups, on every backend that supports them.

The backend-neutral tests look only at what a user sees: which jobs can be fetched, which ran
and in what order (``SideEffect`` rows), the stored ``Job`` rows and attempt history of jobs
settled by a parent. The database backend's own guarantees (the ack fence, edges resolved in
the transaction that finishes the parent, the sweep) have their own section at the end.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections, transaction

from django_jobs import Jobs, chain, dependencies, group, operations
from django_jobs.backends.base import Lease, QueueBackend
from django_jobs.exceptions import LeaseLost, UnknownJob
from django_jobs.history import attempts_of
from django_jobs.models import Dependency, Job
from django_jobs.reaper import Reaper
from django_jobs.worker import QueueWorker
from tests.backend_params import ALL_DATABASES, BACKEND_PARAMS, DB, BackendCase, backend_of, ready_case
from tests.testapp.jobs import flow_step, scripted
from tests.testapp.models import SideEffect

DATABASE_PARAMS = [param for param in BACKEND_PARAMS if str(param.id).startswith("database-")]
REDIS = next(param for param in BACKEND_PARAMS if param.id == "redis")
FLOW_PARAMS = [
    *DATABASE_PARAMS,
    pytest.param(*REDIS.values, id="redis", marks=[DB]),
]


@pytest.fixture(params=FLOW_PARAMS)
def case(request: pytest.FixtureRequest) -> BackendCase:
    return ready_case(request)


@pytest.fixture
def backend(case: BackendCase, monkeypatch: pytest.MonkeyPatch) -> Iterator[QueueBackend]:
    with backend_of(case) as built:
        if not built.transactional:  # a broker's push waits for a commit the test never makes
            monkeypatch.setattr("django_jobs.backends.base.atomic_alias", lambda: None)
        yield built


@pytest.fixture(params=DATABASE_PARAMS)
def db_case(request: pytest.FixtureRequest) -> BackendCase:
    return ready_case(request)


@pytest.fixture
def db_backend(db_case: BackendCase) -> Iterator[QueueBackend]:
    with backend_of(db_case) as built:
        yield built


# -- helpers --


def step(case: BackendCase, key: str, action: str = "ok", **options: Any) -> Any:
    """An unsent flow_step call recording ``key`` when it runs."""
    return flow_step.using(backend=case.name, **options).prepare(None, key, case.side_effect_db, action)


def send(case: BackendCase, key: str, action: str = "ok", **options: Any) -> str:
    return step(case, key, action, **options).dispatch()


def ran(case: BackendCase) -> list[str]:
    """The keys of the flow steps that ran, in the order they ran."""
    return list(SideEffect.objects.using(case.side_effect_db).order_by("id").values_list("key", flat=True))


def drain(backend: QueueBackend, limit: int = 50) -> list[str]:
    worker = QueueWorker(backend, ["default"])
    statuses = []
    for _ in range(limit):
        result = worker.process_once()
        if result.status == "empty":
            return statuses
        statuses.append(str(result.status))
    raise AssertionError(f"still jobs after {limit} deliveries: {statuses}")


def fetch(backend: QueueBackend) -> Lease:
    lease = backend.fetch("default")
    assert lease is not None and lease.envelope is not None, "expected a job to fetch"
    return lease


def stored(backend: QueueBackend, job_id: str) -> Job:
    """The job's ``Job`` row: the database backend's own, or a broker's record of it."""
    row = Job.objects.using(backend.history_alias or "default").filter(pk=job_id).first()
    assert row is not None, f"no Job row for {job_id}"
    return row


def assert_settled_by_parent(backend: QueueBackend, job_id: str, status: str, reason: str) -> None:
    """Settled ``status`` without a run: its last error names the parent, and its history holds
    the run it did not have, by the ``flow`` worker."""
    row = stored(backend, job_id)
    assert (row.status, row.last_error, row.attempts) == (status, reason, 0)
    [entry] = attempts_of(job_id, using=backend.history_alias)
    assert (entry.attempt, entry.outcome, entry.worker_id, entry.error) == (1, status, "flow", reason)
    assert entry.error_class == f"django_jobs.exceptions.Parent{status.title()}"


# -- waiting and release --


def test_a_dependent_waits_without_counting_a_run(case, backend):
    parent = send(case, "parent")
    child = send(case, "child", depends_on=[parent])

    lease = fetch(backend)
    assert lease.envelope.id == parent
    assert backend.fetch("default") is None  # the child is not claimable while its parent runs
    backend.ack(lease)

    released = fetch(backend)
    assert (released.envelope.id, released.envelope.attempts) == (child, 0)


def test_a_dependent_is_released_when_every_parent_completed(case, backend):
    first, second = send(case, "p1"), send(case, "p2")
    child = send(case, "child", depends_on=[first, second])
    leases = {lease.envelope.id: lease for lease in (fetch(backend), fetch(backend))}
    assert backend.fetch("default") is None

    backend.ack(leases[second])
    assert backend.fetch("default") is None  # one parent still running
    backend.ack(leases[first])

    assert fetch(backend).envelope.id == child


def test_a_released_dependent_keeps_its_own_delay(case, backend):
    parent = send(case, "parent")
    send(case, "child", depends_on=[parent], delay=3600)
    backend.ack(fetch(backend))
    assert backend.fetch("default") is None  # ready, but not due for an hour
    assert backend.size("default") == 1


def test_a_failed_parent_fails_its_dependents_without_running_them(case, backend):
    parent = send(case, "parent", "raise")
    child = send(case, "child", depends_on=[parent])
    grandchild = send(case, "grandchild", depends_on=[child])

    assert drain(backend) == ["dead-lettered"]

    assert ran(case) == ["parent"]
    assert_settled_by_parent(backend, child, "failed", f"ParentFailed: parent {parent} failed")
    assert_settled_by_parent(backend, grandchild, "failed", f"ParentFailed: parent {child} failed")


def test_run_if_parent_fails_runs_the_dependent_anyway(case, backend):
    parent = send(case, "parent", "raise")
    send(case, "tolerant", depends_on=[parent], run_if_parent_fails=True)
    assert drain(backend) == ["dead-lettered", "acked"]
    assert ran(case) == ["parent", "tolerant"]


def test_a_parent_lost_for_good_fails_its_dependents(case, backend):
    parent = send(case, "parent")
    child = send(case, "child", depends_on=[parent])
    lease = fetch(backend)
    case.expire(backend, lease)
    assert backend.reap_expired() == 1  # no retry left: failed
    assert stored(backend, parent).status == "failed"
    assert_settled_by_parent(backend, child, "failed", f"ParentFailed: parent {parent} failed")


def test_cancelling_a_parent_cancels_its_dependents(case, backend):
    parent = send(case, "parent")
    child = send(case, "child", depends_on=[parent])
    grandchild = send(case, "grandchild", depends_on=[child])

    assert Jobs.abort(parent) == "cancelled"

    assert drain(backend) == []
    assert_settled_by_parent(backend, child, "cancelled", f"ParentCancelled: parent {parent} was cancelled")
    assert_settled_by_parent(backend, grandchild, "cancelled", f"ParentCancelled: parent {child} was cancelled")


def test_an_aborted_running_parent_cancels_its_dependents(case, backend):
    parent = send(case, "parent")
    child = send(case, "child", depends_on=[parent])
    backend.cancel(fetch(backend), "Aborted by boss (admin)")
    assert_settled_by_parent(backend, child, "cancelled", f"ParentCancelled: parent {parent} was cancelled")


def test_a_parent_aborted_while_its_worker_died_cancels_its_dependents_when_reaped(case, backend):
    parent = send(case, "parent")
    child = send(case, "child", depends_on=[parent])
    lease = fetch(backend)
    assert Jobs.abort(parent, requested_by="boss") == "aborting"
    case.expire(backend, lease)  # its worker died before it saw the request
    assert backend.reap_expired() == 1
    assert stored(backend, parent).status == "cancelled"
    assert_settled_by_parent(backend, child, "cancelled", f"ParentCancelled: parent {parent} was cancelled")


def test_a_waiting_job_can_be_cancelled_and_its_own_dependents_follow(case, backend):
    parent = send(case, "parent")
    child = send(case, "child", depends_on=[parent])
    grandchild = send(case, "grandchild", depends_on=[child])

    assert Jobs.abort(child) == "cancelled"

    assert stored(backend, child).status == "cancelled"
    assert_settled_by_parent(backend, grandchild, "cancelled", f"ParentCancelled: parent {child} was cancelled")
    assert drain(backend) == ["acked"]  # the parent itself runs
    assert ran(case) == ["parent"]


# -- dispatch after the parents finished --


def test_a_dependent_of_a_completed_parent_is_ready_at_once(case, backend):
    parent = send(case, "parent")
    drain(backend)
    child = send(case, "child", depends_on=[parent])
    assert fetch(backend).envelope.id == child


def test_a_dependent_of_a_failed_or_cancelled_parent_is_settled_at_dispatch(case, backend):
    failed = send(case, "failed", "raise")
    drain(backend)
    cancelled = send(case, "cancelled")
    Jobs.abort(cancelled)

    orphan = send(case, "orphan", depends_on=[failed])
    stray = send(case, "stray", depends_on=[cancelled])

    assert_settled_by_parent(backend, orphan, "failed", f"ParentFailed: parent {failed} failed")
    assert_settled_by_parent(backend, stray, "cancelled", f"ParentCancelled: parent {cancelled} was cancelled")
    assert drain(backend) == []


# -- chains and groups --


def test_a_chain_runs_its_steps_in_order(case, backend):
    ids = chain(*(step(case, key) for key in "abcd")).dispatch()
    assert len(set(ids)) == 4
    assert drain(backend) == ["acked"] * 4
    assert ran(case) == list("abcd")


def test_a_failed_step_settles_the_rest_of_its_chain(case, backend):
    ids = chain(step(case, "a"), step(case, "b", "raise"), step(case, "c"), step(case, "d")).dispatch()
    assert drain(backend) == ["acked", "dead-lettered"]
    assert ran(case) == ["a", "b"]
    assert_settled_by_parent(backend, ids[2], "failed", f"ParentFailed: parent {ids[1]} failed")
    assert_settled_by_parent(backend, ids[3], "failed", f"ParentFailed: parent {ids[2]} failed")


def test_a_chain_passes_each_result_to_the_next_step(case, backend):
    last = flow_step.using(backend=case.name, keep_result=True).prepare(key="c", db=case.side_effect_db)
    ids = chain(
        flow_step.using(backend=case.name).prepare([], "a", case.side_effect_db),
        flow_step.using(backend=case.name).prepare(key="b", db=case.side_effect_db),
        last,
        pass_result=True,
    ).dispatch()
    assert drain(backend) == ["acked"] * 3
    assert backend.stored_result(ids[0]) == ["a"]
    assert backend.stored_result(ids[2]) == ["a", "b", "c"]


def test_a_group_callback_runs_once_after_every_member(case, backend):
    *members, _callback = (
        group(step(case, "m1"), step(case, "m2", "raise"), step(case, "m3")).then(step(case, "done")).dispatch()
    )
    assert len(members) == 3
    assert sorted(drain(backend)) == ["acked", "acked", "acked", "dead-lettered"]
    assert ran(case) == ["m1", "m2", "m3", "done"]  # once, last, although a member failed
    assert stored(backend, members[1]).status == "failed"


def test_a_group_callback_that_needs_every_member_to_succeed(case, backend):
    *members, callback = (
        group(step(case, "m1"), step(case, "m2", "raise"))
        .then(step(case, "done"), only_if_all_succeeded=True)
        .dispatch()
    )
    drain(backend)
    assert ran(case) == ["m1", "m2"]
    assert_settled_by_parent(backend, callback, "failed", f"ParentFailed: parent {members[1]} failed")


# -- retrying a settled job (jobs_retry, the admin) --


def retry(*ids: str) -> None:
    """Retry the jobs as ``jobs_retry`` and the admin's action do."""
    outcome = operations.retry_by_id(list(ids))
    assert (outcome.retried, outcome.errors) == (len(ids), [])


def runs(backend: QueueBackend, job_id: str) -> list[tuple[str, str]]:
    """The job's history: each attempt's outcome, and ``flow`` or ``worker`` (who ended it). A
    completed run is recorded when the job keeps its result."""
    return [
        (entry.outcome, "flow" if entry.worker_id == "flow" else "worker")
        for entry in attempts_of(job_id, using=backend.history_alias)
    ]


@pytest.mark.parametrize("parent_ends", ["failed", "cancelled"])
def test_a_retried_dependent_runs_once_without_its_parent(case, backend, parent_ends):
    parent = send(case, "parent", "raise")
    child = send(case, "child", depends_on=[parent], keep_result=True)
    if parent_ends == "cancelled":
        Jobs.abort(parent)
    drain(backend)
    assert stored(backend, child).status == parent_ends

    retry(child)

    assert drain(backend) == ["acked"]
    assert ran(case) == (["parent", "child"] if parent_ends == "failed" else ["child"])
    assert runs(backend, child) == [(parent_ends, "flow"), ("completed", "worker")]
    assert stored(backend, child).status == "completed"


@pytest.mark.parametrize("parent_ends", ["failed", "cancelled"])
def test_retrying_a_parent_does_not_revive_the_dependents_it_settled(case, backend, parent_ends):
    # Fails its first run only (when it runs at all), so the retried parent completes.
    flaky = scripted.using(backend=case.name)
    parent = flaky.dispatch("flaky", "parent", case.side_effect_db, fail_times=int(parent_ends == "failed"))
    child = send(case, "child", depends_on=[parent])
    grandchild = send(case, "grandchild", depends_on=[child])
    if parent_ends == "cancelled":
        Jobs.abort(parent)
    drain(backend)

    retry(parent)

    assert drain(backend) == ["acked"]
    assert ran(case) == ["parent"] * (2 if parent_ends == "failed" else 1)
    reason = {
        "failed": f"ParentFailed: parent {parent} failed",
        "cancelled": f"ParentCancelled: parent {parent} was cancelled",
    }
    assert_settled_by_parent(backend, child, parent_ends, reason[parent_ends])  # as it was: not settled again
    assert stored(backend, grandchild).status == parent_ends


@pytest.mark.parametrize("settled_by", ["failed parent", "abort"])
def test_a_retried_dependent_does_not_wait_again_for_a_parent_still_running(case, backend, settled_by):
    running = send(case, "running")
    failing = send(case, "failing", "raise")
    parents = [running, failing] if settled_by == "failed parent" else [running]
    child = send(case, "child", depends_on=parents, keep_result=True)
    lease = fetch(backend)
    assert lease.envelope.id == running
    if settled_by == "abort":
        assert Jobs.abort(child) == "cancelled"  # while it waits
    assert drain(backend) == ["dead-lettered"]
    assert stored(backend, child).status == ("failed" if settled_by == "failed parent" else "cancelled")

    retry(child)

    assert drain(backend) == ["acked"]  # while a parent still runs
    backend.ack(lease)  # that parent's end no longer concerns it
    assert drain(backend) == []
    assert ran(case) == ["failing", "child"]
    assert [outcome for outcome, _ in runs(backend, child)][-1:] == ["completed"]
    assert stored(backend, child).status == "completed"


def test_a_retried_dependent_is_a_parent_like_any_job(case, backend):
    parent = send(case, "parent", "raise")
    child = send(case, "child", depends_on=[parent])
    grandchild = send(case, "grandchild", depends_on=[child])
    drain(backend)

    retry(child)
    late = send(case, "late", depends_on=[child], keep_result=True)  # waits for the retried run

    assert drain(backend) == ["acked", "acked"]
    assert ran(case) == ["parent", "child", "late"]
    assert runs(backend, late) == [("completed", "worker")]
    # The dependent it settled before is not revived: retried in turn, it runs.
    assert_settled_by_parent(backend, grandchild, "failed", f"ParentFailed: parent {child} failed")
    retry(grandchild)
    assert drain(backend) == ["acked"]
    assert ran(case) == ["parent", "child", "late", "grandchild"]


# -- the database backend --


def test_an_unknown_parent_is_refused_and_nothing_is_sent(db_case, db_backend):
    first = send(db_case, "first")
    with pytest.raises(UnknownJob, match="'nope'.*not a job of backend"):
        chain(step(db_case, "a"), step(db_case, "b", depends_on=["nope"])).dispatch()
    # A failed job of a broker (its audit row) is no parent for this backend either.
    Job.objects.using(db_backend.alias).create(id="broker-job", backend="redis", status="failed", queue="default")
    with pytest.raises(UnknownJob, match="broker-job"):
        send(db_case, "c", depends_on=[first, "broker-job"])
    assert list(Job.objects.using(db_backend.alias).exclude(pk="broker-job").values_list("pk", flat=True)) == [first]
    assert not Dependency.objects.using(db_backend.alias).exists()


def test_a_waiting_row_holds_the_edges(db_case, db_backend):
    parent = send(db_case, "parent")
    child = send(db_case, "child", depends_on=[parent])
    jobs = Job.objects.using(db_backend.alias)
    assert jobs.get(pk=child).status == "waiting"
    assert jobs.get(pk=parent).has_dependents
    [edge] = Dependency.objects.using(db_backend.alias).all()
    assert (edge.parent, edge.child, edge.outcome) == (parent, child, None)
    drain(db_backend)
    edge.refresh_from_db()
    assert edge.outcome == "completed"
    assert jobs.get(pk=child).status == "completed"


@pytest.mark.parametrize("how", ["ack", "ack_and_fetch", "ack_many", "ack_many_and_fetch"])
def test_the_ack_fence_sends_a_parent_with_dependents_down_the_transactional_path(db_case, db_backend, how):
    parent = send(db_case, "parent")
    child = send(db_case, "child", depends_on=[parent])
    lease = fetch(db_backend)

    if how == "ack":
        db_backend.ack(lease)
        following = fetch(db_backend)
    elif how == "ack_and_fetch":
        following = db_backend.ack_and_fetch(lease, "default")
    elif how == "ack_many":
        assert db_backend.ack_many([lease]) == []  # acked, not reported lost
        following = fetch(db_backend)
    else:
        lost, claimed = db_backend.ack_many_and_fetch([lease], "default", 5)
        assert lost == []
        # The claim ran before the slow ack released the child: it is claimed next time.
        following = claimed[0] if claimed else fetch(db_backend)

    assert following is not None and following.envelope.id == child
    row = Job.objects.using(db_backend.alias).get(pk=parent)
    assert (row.status, row.attempts, row.owner_token) == ("completed", 1, None)


def test_a_truly_lost_lease_with_dependents_is_still_lost(db_case, db_backend):
    parent = send(db_case, "parent", max_retries=1)
    child = send(db_case, "child", depends_on=[parent])
    lease = fetch(db_backend)
    db_case.expire(db_backend, lease)
    assert db_backend.reap_expired() == 1  # requeued for its retry

    with pytest.raises(LeaseLost):
        db_backend.ack(lease)
    assert db_backend.ack_many([lease]) == [lease]
    assert Job.objects.using(db_backend.alias).get(pk=child).status == "waiting"


def test_a_parent_never_finishes_without_its_edges(db_case, db_backend, monkeypatch):
    """The parent's settle and its edges' resolution commit together: a failure in between
    leaves the parent unsettled (its worker retries the settle, or the reaper recovers it)."""
    parent = send(db_case, "parent")
    child = send(db_case, "child", depends_on=[parent])
    lease = fetch(db_backend)

    def crash(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("crash while resolving")

    monkeypatch.setattr(dependencies, "_release", crash)
    with pytest.raises(RuntimeError):
        db_backend.ack(lease)
    jobs = Job.objects.using(db_backend.alias)
    assert jobs.get(pk=parent).status == "in_progress"
    assert Dependency.objects.using(db_backend.alias).get().outcome is None

    monkeypatch.undo()
    db_backend.ack(lease)  # the lease is still ours: the retried settle goes through
    assert (jobs.get(pk=parent).status, jobs.get(pk=child).status) == ("completed", "pending")


def test_the_reaper_pass_sweeps_what_no_settle_resolved(db_case, db_backend):
    jobs = Job.objects.using(db_backend.alias)
    done, gone, open_parent = send(db_case, "done"), send(db_case, "gone"), send(db_case, "open")
    released = send(db_case, "released", depends_on=[done])
    orphan = send(db_case, "orphan", depends_on=[gone])
    kept = send(db_case, "kept", depends_on=[open_parent])
    # Paths outside the backend: a row finished by hand, a parent deleted before it ran.
    jobs.filter(pk=done).update(status="completed")
    jobs.filter(pk=gone).delete()

    assert Reaper(db_backend).reap_once() == 0  # no lease to reap, but the sweep ran
    assert jobs.get(pk=released).status == "pending"
    assert_settled_by_parent(db_backend, orphan, "cancelled", f"ParentCancelled: parent {gone} was cancelled")
    assert jobs.get(pk=kept).status == "waiting"
    assert db_backend.resolve_dependents() == 0  # idempotent: nothing left to do

    # A waiting job whose edges were all resolved without it being released.
    Dependency.objects.using(db_backend.alias).filter(child=kept).update(outcome="completed")
    assert db_backend.resolve_dependents() == 1
    assert jobs.get(pk=kept).status == "pending"


def test_a_sweep_with_no_open_edge_and_no_waiting_job_asks_one_query(db_case, db_backend):
    from django.test.utils import CaptureQueriesContext

    send(db_case, "plain")  # a job with no parents: neither an edge nor a waiting row
    with CaptureQueriesContext(connections[db_backend.alias]) as queries:
        assert db_backend.resolve_dependents() == 0
    assert len(queries.captured_queries) == 1


def test_waiting_jobs_are_counted_in_the_queue_size(db_case, db_backend):
    parent = send(db_case, "parent")
    send(db_case, "child", depends_on=[parent])
    assert db_backend.size("default") == 2


def test_a_row_that_does_not_verify_never_runs_after_a_failed_parent(db_case, db_backend):
    parent = send(db_case, "parent", "raise")
    child = send(db_case, "child", depends_on=[parent], run_if_parent_fails=True)
    Job.objects.using(db_backend.alias).filter(pk=child).update(signature="forged")
    drain(db_backend)
    assert Job.objects.using(db_backend.alias).get(pk=child).status == "failed"


def _ack_together(backend: QueueBackend, leases: list[Lease]) -> list[BaseException]:
    """Ack ``leases`` from one thread each, released at the same moment; what they raised."""
    start, errors = threading.Barrier(len(leases)), []

    def settle(lease: Lease) -> None:
        try:
            start.wait()
            backend.ack(lease)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)
        finally:
            connections[backend.alias].close()

    threads = [threading.Thread(target=settle, args=(lease,)) for lease in leases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


@pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)
def test_two_parents_finishing_at_once_release_their_child_exactly_once(db_case, db_backend):
    if connections[db_backend.alias].vendor == "sqlite":
        pytest.skip("SQLite has one writer: nothing finishes at once")
    jobs = Job.objects.using(db_backend.alias)
    for _ in range(10):
        first, second = send(db_case, "p1"), send(db_case, "p2")
        child = send(db_case, "child", depends_on=[first, second])
        assert _ack_together(db_backend, [fetch(db_backend), fetch(db_backend)]) == []
        assert jobs.get(pk=child).status == "pending"
        assert fetch(db_backend).envelope.id == child
        jobs.all().delete()
        Dependency.objects.using(db_backend.alias).all().delete()


def test_purging_a_finished_child_drops_its_edges(db_case, db_backend):
    from django_jobs.operations import purge

    parent = send(db_case, "parent")
    send(db_case, "child", depends_on=[parent])
    drain(db_backend)
    assert purge("completed") == 2
    assert not Dependency.objects.using(db_backend.alias).exists()


@pytest.mark.django_db(databases=ALL_DATABASES, transaction=True)
def test_a_long_transaction_that_made_a_job_claimed_ahead_a_parent_does_not_hold_up_the_heartbeat(db_case, db_backend):
    """A dispatch in a transaction left open makes a job claimed ahead a parent: its row stays
    locked until that transaction ends. The heartbeat's extend of the jobs claimed ahead comes
    before the running job's next beat, so it must not wait for that transaction (on PostgreSQL
    it skips the locked row until the next beat): else a transaction open longer than the lease
    lets the running job's lease expire while it runs."""
    if connections[db_backend.alias].vendor != "postgresql":
        pytest.skip("PostgreSQL: rows locked one by one (SQLite has one writer)")
    parents = [send(db_case, f"p{i}") for i in range(2)]
    batch = db_backend.fetch_many("default", 2)
    assert [lease.envelope.id for lease in batch] == parents
    dispatched, release = threading.Event(), threading.Event()

    def long_transaction() -> None:
        try:
            with transaction.atomic(using=db_backend.alias):
                send(db_case, "child", depends_on=[parents[1]])
                dispatched.set()
                release.wait(30)
        finally:
            connections[db_backend.alias].close()

    user = threading.Thread(target=long_transaction)
    user.start()
    try:
        assert dispatched.wait(10)
        before = [lease.expires_at for lease in batch]
        beat = threading.Thread(target=db_backend.extend_ahead, args=(batch, 120), daemon=True)
        beat.start()
        beat.join(10)
        assert not beat.is_alive(), "the extend waited for the user's transaction"
        assert batch[0].expires_at > before[0]
        assert batch[1].expires_at == before[1]  # skipped this beat: extended at the next
    finally:
        release.set()
        user.join()
    db_backend.extend_ahead(batch, 120)
    assert batch[1].expires_at > before[1]
