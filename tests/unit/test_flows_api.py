"""The public API of dependencies, chains and groups: what each builds, and the refusals."""

from __future__ import annotations

import pytest

from django_jobs import Jobs, chain, group, job, operations, signing
from django_jobs.envelope import MESSAGE_PARENTS, Envelope
from django_jobs.exceptions import BadSignature, DependenciesNotSupported
from django_jobs.flows import edges_verdict
from django_jobs.history import attempts_of
from django_jobs.models import Job
from tests.testapp.jobs import flow_step, noop, scripted
from tests.testapp.models import SideEffect


def test_depends_on_is_a_signed_option():
    env = scripted.using(depends_on=["a" * 32, "b" * 32], run_if_parent_fails=True).builder().build()
    assert env.options["parents"] == ["a" * 32, "b" * 32]
    assert env.options["run_if_parent_fails"] is True
    env.options["parents"] = ["c" * 32]
    with pytest.raises(BadSignature):
        signing.verify(env)


def test_the_builder_adds_parents_once_and_leaves_out_empty_options():
    builder = Jobs.define("command", "clearsessions").depends_on("p1", "p2").depends_on("p1", "p3")
    assert builder.build().options["parents"] == ["p1", "p2", "p3"]
    # No parents: nothing about them travels, run_if_parent_fails included.
    assert "parents" not in noop.using(run_if_parent_fails=True).builder().build().options
    assert noop.using(depends_on=[]).builder().build().options == {}


@pytest.mark.parametrize(
    ("value", "error"),
    [("abc", TypeError), ([1], TypeError), ([""], ValueError), (["x" * 65], ValueError)],
)
def test_bad_parent_ids_are_refused(value, error):
    with pytest.raises(error):
        noop.using(depends_on=value).builder()


def test_depends_on_is_per_dispatch_not_per_job():
    with pytest.raises(TypeError, match="using"):
        job(depends_on=["x"])


def test_a_chain_names_each_step_parent_of_the_next():
    a, b, c = chain(noop.prepare(), noop.prepare(), scripted.prepare(action="ok")).build()
    assert "parents" not in a.options
    assert b.options["parents"] == [a.id]
    assert c.options["parents"] == [b.id]
    assert "result_of" not in c.options and "keep_result" not in a.options


def test_a_chain_that_passes_results_keeps_them_and_names_the_one_to_pass():
    first, second, last = chain(
        flow_step.prepare([], "a"), flow_step.prepare(key="b"), flow_step.prepare(key="c"), pass_result=True
    ).build()
    assert first.options == {"keep_result": True}
    assert second.options == {"keep_result": True, "parents": [first.id], "result_of": first.id}
    assert last.options == {"parents": [second.id], "result_of": second.id}
    assert second.payload == {"args": [], "kwargs": {"key": "b"}}


def test_a_prepared_call_is_checked_when_it_is_built():
    # Without a parent's result first, flow_step misses its first argument.
    with pytest.raises(TypeError, match="previous"):
        chain(flow_step.prepare([], "a"), flow_step.prepare(key="b")).build()
    with pytest.raises(TypeError, match="after the parent's result"):
        chain(noop.prepare(), noop.prepare(), pass_result=True).build()
    with pytest.raises(TypeError, match="unexpected keyword"):
        flow_step.prepare(nope=1)


def test_a_group_callback_waits_for_every_member_whatever_they_did():
    *members, callback = group(noop.prepare(), noop.prepare()).then(scripted.prepare()).build()
    assert callback.options["parents"] == [m.id for m in members]
    assert callback.options["run_if_parent_fails"] is True
    *_, strict = group(noop.prepare()).then(scripted.prepare(), only_if_all_succeeded=True).build()
    assert "run_if_parent_fails" not in strict.options
    assert [e.options for e in group(noop.prepare(), noop.prepare()).build()] == [{}, {}]


def test_a_callback_of_more_parents_than_a_message_lists_has_them_beside_its_message():
    members = [noop.prepare() for _ in range(MESSAGE_PARENTS + 1)]
    *built, callback = group(*members).then(scripted.prepare()).build()
    assert "parents" not in callback.options and callback.options["run_if_parent_fails"] is True
    assert callback.parents == [member.id for member in built]  # in order, for the backend to store
    signing.verify(callback)
    assert len(callback.to_bytes()) < 1000  # its message does not grow with the group
    assert Envelope.from_bytes(callback.to_bytes()).parents == []  # they never travel
    *listed, last = group(*members[:MESSAGE_PARENTS]).then(noop.prepare()).build()
    assert last.options["parents"] == last.parents == [member.id for member in listed]


def test_depends_on_takes_many_parents_at_once():
    ids = [f"{n:032x}" for n in range(100_000)]
    env = noop.using(depends_on=[*ids, ids[0]]).builder().depends_on(*ids[:10]).build()
    assert env.parents == ids and "parents" not in env.options


def test_chains_and_groups_take_prepared_calls_on_one_backend():
    with pytest.raises(ValueError, match="at least one"):
        chain()
    with pytest.raises(TypeError, match="prepare"):
        group(noop)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one backend"):
        chain(noop.prepare(), noop.using(backend="redis").prepare()).dispatch()


def test_a_backend_without_dependencies_refuses_a_job_with_parents():
    with pytest.raises(DependenciesNotSupported, match="'beanstalk'.*configured: .*'sync'"):
        noop.using(backend="beanstalk", depends_on=["p"]).dispatch()
    with pytest.raises(DependenciesNotSupported):
        chain(noop.prepare(), noop.prepare()).dispatch(backend="beanstalk")
    with pytest.raises(DependenciesNotSupported):  # parents beside the message count too
        noop.using(backend="beanstalk", depends_on=[f"p{n}" for n in range(MESSAGE_PARENTS + 1)]).dispatch()


def test_edges_verdict():
    assert edges_verdict([("a", "completed"), ("b", None)], False).state == "waiting"
    assert edges_verdict([("a", "completed"), ("b", "completed")], False).state == "ready"
    failed = edges_verdict([("a", None), ("b", "failed")], False)
    assert failed == ("failed", "b", "ParentFailed: parent b failed")
    assert failed.error_class == "django_jobs.exceptions.ParentFailed"
    assert edges_verdict([("a", "cancelled")], False).reason == "ParentCancelled: parent a was cancelled"
    assert edges_verdict([("a", "cancelled"), ("b", "failed")], True).state == "ready"


@pytest.mark.django_db
def test_the_sync_backend_runs_a_chain_inline_in_order(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):  # a broker's push waits for the commit
        flow = chain(flow_step.prepare([], "s1"), flow_step.prepare(key="s2"), pass_result=True)
        ids = flow.dispatch(backend="sync")
    assert list(SideEffect.objects.values_list("key", flat=True).order_by("id")) == ["s1", "s2"]
    assert Job.objects.get(pk=ids[0]).result == ["s1"]  # kept for the next step, which got it first
    assert [r.status for r in Jobs.backend("sync").last_results[-2:]] == ["acked", "acked"]


@pytest.mark.django_db
def test_the_sync_backend_settles_a_child_of_a_failed_parent_without_running_it(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        failing, child, tolerant = chain(
            flow_step.prepare(None, "f1", action="raise"),
            flow_step.prepare(None, "f2"),
            flow_step.using(run_if_parent_fails=True).prepare(None, "f3"),
        ).dispatch(backend="sync")
    assert list(SideEffect.objects.values_list("key", flat=True).order_by("id")) == ["f1", "f3"]
    row = Job.objects.get(pk=child)
    assert (row.status, row.last_error, row.attempts) == ("failed", f"ParentFailed: parent {failing} failed", 0)
    [entry] = attempts_of(child)
    assert (entry.outcome, entry.worker_id, entry.attempt) == ("failed", "flow", 1)
    # The next step runs although its parent failed: it was prepared with run_if_parent_fails.
    assert Jobs.backend("sync").outcomes[tolerant] == "completed"


@pytest.mark.django_db
def test_the_sync_backend_runs_a_retried_dependent_of_a_failed_parent(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        failing, child = chain(
            flow_step.prepare(None, "r1", action="raise"), flow_step.using(keep_result=True).prepare(None, "r2")
        ).dispatch(backend="sync")
    assert Job.objects.get(pk=child).status == "failed"

    assert operations.retry_jobs(Job.objects.filter(pk=child)).retried == 1  # the admin's retry

    assert list(SideEffect.objects.values_list("key", flat=True).order_by("id")) == ["r1", "r2"]
    assert (Job.objects.get(pk=child).status, Jobs.backend("sync").outcomes[failing]) == ("completed", "failed")


@pytest.mark.django_db
def test_the_sync_backend_sees_parents_beside_the_message(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        failing = flow_step.using(backend="sync").dispatch(None, "p", action="raise")
        # Parents it did not run count as completed: the failed one decides.
        parents = [*(f"{n:032x}" for n in range(MESSAGE_PARENTS)), failing]
        child = flow_step.using(backend="sync", depends_on=parents).dispatch(None, "c")
    assert list(SideEffect.objects.values_list("key", flat=True)) == ["p"]
    assert Job.objects.get(pk=child).last_error == f"ParentFailed: parent {failing} failed"
