"""The public dispatch API and the per-job run options, with the worker run in-process."""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta
from datetime import timezone as datetime_timezone

import pytest
from django.conf import settings
from django.contrib.sessions.models import Session
from django.db import connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_jobs import JobBuilder, Jobs, job
from django_jobs.exceptions import UnknownQueue
from django_jobs.handlers import ShellHandler
from django_jobs.models import Job
from django_jobs.worker import QueueWorker
from tests.api_support import (
    GiveUpHandler,
    alias,
    bare_job,
    configured_job,
    counter,
    drain,
    jobs_settings,
    reentrant,
    reentrant_results,
    row,
    runs,
)
from tests.testapp.jobs import scripted

pytestmark = [pytest.mark.django_db(databases=["default", "postgres"]), pytest.mark.usefixtures("clean_state")]


def other_alias(backend: str) -> str:
    return "postgres" if alias(backend) == "default" else "default"


# -- Jobs.define(...) ----------------------------------------------------------------------------


def test_define_chain_sets_every_field_of_the_row(backend):
    before = timezone.now()
    job_id = (
        Jobs.define("command", "clearsessions")
        .queue("emails")
        .max_retries(5)
        .priority(10)
        .timeout(120)
        .delay(30)
        .idempotency_key("close-month-2026-06")
        .named("close month")
        .dispatch(backend=backend)
    )
    after = timezone.now()

    assert isinstance(job_id, str) and job_id
    job = row(backend, job_id)
    assert job.pk == job_id
    assert (
        job.queue,
        job.handler,
        job.payload,
        job.max_retries,
        job.priority,
        job.timeout,
        job.idempotency_key,
        job.name,
    ) == ("emails", "command", "clearsessions", 5, 10, 120, "close-month-2026-06", "close month")
    assert (job.status, job.attempts, job.backend) == ("pending", 0, backend)
    assert job.signature  # signed at dispatch
    # delay(30) is measured from dispatch.
    assert before + timedelta(seconds=30) <= job.available_at <= after + timedelta(seconds=30)
    # The row went to this backend's database only, and the delay really holds it back.
    assert not Job.objects.using(other_alias(backend)).filter(pk=job_id).exists()
    assert QueueWorker(backend, ["emails"]).process_once().status == "empty"


def test_scheduled_at_sets_available_at(backend):
    when = timezone.now() + timedelta(hours=3)
    job_id = Jobs.define("command", "clearsessions").scheduled_at(when).dispatch(backend=backend)
    assert row(backend, job_id).available_at == when
    # Defaults of a bare define: the first queue, priority 0, no retries, no timeout, no key.
    job = row(backend, job_id)
    assert (job.queue, job.priority, job.max_retries, job.timeout, job.idempotency_key) == ("default", 0, 0, None, None)


def test_scheduled_at_refuses_a_naive_datetime():
    with pytest.raises(ValueError, match="aware"):
        Jobs.define("command", "clearsessions").scheduled_at(timezone.now().replace(tzinfo=None))


def test_dispatch_backend_argument_wins_over_the_default(backend):
    job_id = Jobs.define("command", "clearsessions").dispatch(backend=backend)
    assert Job.objects.using(alias(backend)).filter(pk=job_id).exists()
    assert not Job.objects.using(other_alias(backend)).filter(pk=job_id).exists()


def test_unknown_queue_raises_and_inserts_nothing():
    with pytest.raises(UnknownQueue, match="nope"):
        Jobs.define("command", "clearsessions").queue("nope").dispatch()
    with pytest.raises(UnknownQueue):
        scripted.using(queue="nope").dispatch(action="ok")
    assert Job.objects.count() == 0


# -- @job ------------------------------------------------------------------------------------------


def test_bare_job_registers_and_dispatches_with_the_args_kwargs_payload():
    job_id = bare_job.dispatch(21, label="x")
    job = Job.objects.get(pk=job_id)
    assert job.payload == {"args": [21], "kwargs": {"label": "x"}}
    assert job.handler == "tests.api_support.bare_job" == bare_job.key
    assert (job.queue, job.priority, job.max_retries, job.timeout) == ("default", 0, 0, None)
    result = QueueWorker("default").process_once()
    assert (result.status, result.job_id, result.handler) == ("acked", job_id, "tests.api_support.bare_job")
    assert Job.objects.get(pk=job_id).status == "completed"


def test_job_with_options_applies_them_to_every_dispatch():
    job_id = configured_job.dispatch(7)
    job = Job.objects.get(pk=job_id)
    assert (job.queue, job.max_retries, job.priority, job.timeout, job.name) == ("emails", 3, 4, 30, "welcome mail")
    assert job.payload == {"args": [7], "kwargs": {}}


def test_using_overrides_the_decorator_options(backend):
    before = timezone.now()
    job_id = configured_job.using(
        queue="other",
        priority=5,
        delay=10,
        max_retries=1,
        timeout=2.5,
        idempotency_key="k-1",
        name="renamed",
        backend=backend,
    ).dispatch(user_id=7)
    job = row(backend, job_id)
    assert (job.queue, job.priority, job.max_retries, job.timeout, job.idempotency_key, job.name) == (
        "other",
        5,
        1,
        2.5,
        "k-1",
        "renamed",
    )
    assert job.available_at >= before + timedelta(seconds=10)
    assert job.payload == {"args": [], "kwargs": {"user_id": 7}}
    # using() is per dispatch: the next plain dispatch has the decorator's options again.
    plain = Job.objects.get(pk=configured_job.dispatch(8))
    assert (plain.queue, plain.priority, plain.max_retries) == ("emails", 4, 3)


def test_job_function_stays_directly_callable():
    assert bare_job(4) == 8
    assert scripted("ok", key="direct") == "ok"
    assert runs("direct") == 1  # it really ran, here and now
    assert Job.objects.count() == 0  # and nothing was queued


def test_unknown_options_raise_type_error_at_run_time_too():
    with pytest.raises(TypeError, match="unknown @job option.*queu"):
        job(queu="emails")
    with pytest.raises(TypeError, match="unknown job option.*priorty"):
        scripted.using(priorty=5).dispatch(action="ok")
    with pytest.raises(TypeError, match="unknown job option.*nope"):
        Jobs.define("command").options(nope=1)
    assert Job.objects.count() == 0


def test_builder_returns_an_unsent_builder_and_build_is_its_deprecated_name():
    builder = scripted.using(priority=2).builder("ok", key="b")
    assert isinstance(builder, JobBuilder)
    env = builder.build()  # JobBuilder.build() is the envelope
    assert (env.handler, env.name, env.priority) == (scripted.key, scripted.key, 2)
    assert env.payload == {"args": ["ok"], "kwargs": {"key": "b"}}
    assert isinstance(bare_job.builder(3), JobBuilder)
    with pytest.warns(DeprecationWarning, match=r"builder\(\)") as warned:
        old = scripted.using(priority=2).build("ok", key="b")
    assert warned[0].filename == __file__  # points at the caller
    assert isinstance(old, JobBuilder) and old.build().payload == env.payload
    with pytest.warns(DeprecationWarning, match=r"builder\(\)") as warned:
        assert isinstance(bare_job.build(3), JobBuilder)
    assert warned[0].filename == __file__
    assert Job.objects.count() == 0


def test_scripted_payload_round_trips_through_the_worker(backend):
    job_id = scripted.using(backend=backend).dispatch("ok", key="rt")
    assert row(backend, job_id).payload == {"args": ["ok"], "kwargs": {"key": "rt"}}
    result = QueueWorker(backend).process_once()
    assert (result.status, result.job_id, result.attempt) == ("acked", job_id, 1)
    assert runs("rt") == 1


# -- Jobs.bulk ---------------------------------------------------------------------------------------


# PostgreSQL inserts up to 1,000 rows with one statement (one array per column); SQLite runs the
# one-row INSERT once per row in one executemany call (its log entry: "30 times: INSERT ...").
@pytest.mark.parametrize("backend, count", [("default", 30), ("pg", 300)])
def test_bulk_inserts_many_rows_with_one_insert(backend, count, request):
    if backend == "pg":
        request.getfixturevalue("postgres_up")
    builders = [scripted.using(priority=i % 3).builder("ok", key=f"bulk-{i}") for i in range(count - 1)]
    builders.append(Jobs.define("command", "clearsessions").queue("other"))
    with CaptureQueriesContext(connections[alias(backend)]) as queries:
        ids = Jobs.bulk(builders, backend=backend)
    inserts = [q["sql"] for q in queries.captured_queries if "INSERT" in q["sql"].upper().split(" INTO ")[0]]
    assert len(inserts) == 1
    assert len(ids) == len(set(ids)) == count and all(isinstance(i, str) for i in ids)
    rows = {j.pk: j for j in Job.objects.using(alias(backend)).filter(pk__in=ids)}
    assert set(rows) == set(ids)
    assert rows[ids[0]].payload == {"args": ["ok"], "kwargs": {"key": "bulk-0"}}
    assert rows[ids[-1]].queue == "other" and rows[ids[-1]].handler == "command"
    assert {rows[i].priority for i in ids[:-1]} == {0, 1, 2}


def test_bulk_inserts_a_column_of_ints_and_floats(backend):
    """A float column whose values the caller gave as int and float (a PostgreSQL array holds
    one type: each is stored as the field makes it)."""
    builders = [scripted.using(timeout=30).builder("ok"), scripted.using(timeout=1.5).builder("ok")]
    ids = Jobs.bulk(builders, backend=backend)
    timeouts = dict(Job.objects.using(alias(backend)).filter(pk__in=ids).values_list("pk", "timeout"))
    assert [timeouts[i] for i in ids] == [30.0, 1.5]


def test_bulk_of_nothing_inserts_nothing():
    with CaptureQueriesContext(connections["default"]) as queries:
        assert Jobs.bulk([]) == []
    assert len(queries) == 0


# -- defaults from settings ------------------------------------------------------------------------


def test_default_max_retries_and_default_timeout_apply_when_a_job_sets_none():
    with jobs_settings(DEFAULT_MAX_RETRIES=2, DEFAULT_TIMEOUT=12):
        defaulted = Job.objects.get(pk=Jobs.define("command", "clearsessions").dispatch())
        explicit = Job.objects.get(pk=Jobs.define("command", "clearsessions").max_retries(0).timeout(3).dispatch())
        failing = scripted.dispatch(action="raise", key="dflt")
        statuses = [r.status for r in drain(QueueWorker("default"))]
    assert (defaulted.max_retries, defaulted.timeout) == (2, 12)
    assert (explicit.max_retries, explicit.timeout) == (0, 3)
    # DEFAULT_MAX_RETRIES=2 really means three runs.
    assert statuses.count("requeued") == 2 and statuses[-1] == "dead-lettered"
    assert runs("dflt") == 3
    assert Job.objects.get(pk=failing).attempts == 3


def test_default_timeout_limits_an_attempt():
    with jobs_settings(DEFAULT_TIMEOUT=0.2):
        job_id = scripted.dispatch(action="sleep", seconds=30, key="slow")
        result = QueueWorker("default").process_once()
    assert result.status == "dead-lettered"
    job = Job.objects.get(pk=job_id)
    assert job.status == "failed" and job.last_error.startswith("JobTimeout")


# -- transactions -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend, db", [("default", "default"), ("pg", "postgres")])
def test_database_dispatch_inside_a_rolled_back_atomic_leaves_no_row(backend, db, request):
    if backend == "pg":
        request.getfixturevalue("postgres_up")
    ids = []
    with pytest.raises(RuntimeError, match="abort"), transaction.atomic(using=db):
        ids.append(scripted.using(backend=backend).dispatch(action="ok"))
        # Transactional enqueue: the row is visible inside the transaction...
        assert Job.objects.using(db).filter(pk=ids[0]).exists()
        raise RuntimeError("abort")
    # ...and gone with it.
    assert not Job.objects.using(db).filter(pk=ids[0]).exists()
    assert QueueWorker(backend).process_once().status == "empty"


def test_database_dispatch_inside_a_committed_atomic_is_kept():
    with transaction.atomic():
        job_id = scripted.dispatch(action="ok")
    assert Job.objects.filter(pk=job_id, status="pending").exists()


def test_sync_dispatch_inside_atomic_runs_only_on_commit(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        with transaction.atomic():
            job_id = scripted.using(backend="sync").dispatch(action="ok", key="sync-commit")
            assert isinstance(job_id, str) and job_id
            # Not yet: a worker must never see a job before the data it refers to.
            assert runs("sync-commit") == 0
        assert runs("sync-commit") == 0  # the outer (test) transaction has not committed either
    assert len(callbacks) == 1
    assert runs("sync-commit") == 1
    assert Jobs.backend("sync").last_results[-1].status == "acked"
    assert Job.objects.count() == 0  # the sync backend keeps no row for a success


def test_sync_dispatch_inside_a_rolled_back_atomic_never_runs(django_capture_on_commit_callbacks):
    with (
        django_capture_on_commit_callbacks(execute=True) as callbacks,
        pytest.raises(RuntimeError, match="abort"),
        transaction.atomic(),
    ):
        scripted.using(backend="sync").dispatch(action="ok", key="sync-rollback")
        raise RuntimeError("abort")
    assert callbacks == []
    assert runs("sync-rollback") == 0


def test_sync_permanent_failure_is_recorded_as_a_failed_row(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        job_id = scripted.using(backend="sync").dispatch(action="raise", key="sync-fail")
    assert Jobs.backend("sync").last_results[-1].status == "dead-lettered"
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.backend) == ("failed", "sync")
    assert job.last_error.startswith("RuntimeError: scripted failure")


# -- built-in handlers ------------------------------------------------------------------------------


@pytest.mark.parametrize("payload", ["clearsessions", ["clearsessions"], {"name": "clearsessions"}])
def test_command_handler_runs_a_management_command(payload):
    now = timezone.now()
    Session.objects.create(session_key="expired", session_data="x", expire_date=now - timedelta(days=1))
    Session.objects.create(session_key="live", session_data="x", expire_date=now + timedelta(days=1))
    job_id = Jobs.define("command", payload).dispatch()
    assert QueueWorker("default").process_once().status == "acked"
    assert list(Session.objects.values_list("session_key", flat=True)) == ["live"]
    assert Job.objects.get(pk=job_id).status == "completed"


def test_command_handler_with_an_unknown_command_fails():
    job_id = Jobs.define("command", "no_such_command_here").dispatch()
    assert QueueWorker("default").process_once().status == "dead-lettered"
    assert "no_such_command_here" in Job.objects.get(pk=job_id).last_error


def test_shell_handler_refuses_a_program_not_in_the_allowlist():
    with jobs_settings(ALLOWED_SHELL_COMMANDS=["echo"]):
        job_id = Jobs.define("shell", ["rm", "-rf", "/nonexistent-django-jobs"]).max_retries(3).dispatch()
        results = drain(QueueWorker("default"))
    # HandlerNotAllowed is permanent: one delivery, no retry whatever max_retries says.
    assert [r.status for r in results] == ["dead-lettered"]
    job = Job.objects.get(pk=job_id)
    assert job.status == "failed" and job.last_error.startswith("HandlerNotAllowed")
    assert "'rm'" in job.last_error


def test_shell_handler_refuses_everything_by_default():
    job_id = Jobs.define("shell", ["echo", "hi"]).max_retries(2).dispatch()
    assert [r.status for r in drain(QueueWorker("default"))] == ["dead-lettered"]
    assert Job.objects.get(pk=job_id).last_error.startswith("HandlerNotAllowed")


def test_shell_handler_passes_argv_without_a_shell():
    class Context:
        def __init__(self) -> None:
            self.payload = ["echo", "$(id)", "`id`;", "&&", "*"]

        def remaining(self) -> float:
            return 10.0

    with jobs_settings(ALLOWED_SHELL_COMMANDS=["echo"]):
        assert ShellHandler().handle(Context()) == "$(id) `id`; && *\n"


def test_shell_job_runs_an_allowlisted_program_through_the_worker(tmp_path):
    out = tmp_path / "out.txt"
    literal = "$(id) `id`; echo injected > pwned"
    argv = [sys.executable, "-c", "import sys; open(sys.argv[1], 'w').write(sys.argv[2])", str(out), literal]
    with jobs_settings(ALLOWED_SHELL_COMMANDS=[sys.executable]):
        job_id = Jobs.define("shell", argv).dispatch()
        assert QueueWorker("default").process_once().status == "acked"
    assert out.read_text() == literal  # each argv item arrived verbatim: nothing was expanded
    assert not (tmp_path / "pwned").exists()
    assert Job.objects.get(pk=job_id).status == "completed"


# -- who may run where, and whether to retry ----------------------------------------------------------


def test_queue_handlers_allowlist_rejects_a_handler_on_that_queue(backend):
    with jobs_settings(QUEUE_HANDLERS={"default": ["command"]}):
        blocked = scripted.using(backend=backend, max_retries=3).dispatch(action="ok", key="blocked")
        elsewhere = scripted.using(backend=backend, queue="other").dispatch(action="ok", key="elsewhere")
        worker = QueueWorker(backend, ["default", "other"])
        first, second = worker.process_once(), worker.process_once()
        assert (first.status, first.job_id) == ("rejected", blocked)
        assert counter("jobs_rejected_handler", queue="default") == 1
        # A queue without an allowlist entry accepts any registered handler.
        assert (second.status, second.job_id) == ("acked", elsewhere)
    job = row(backend, blocked)
    assert job.status == "failed" and job.attempts == 0 and job.last_error.startswith("rejected:")
    assert "not allowed on queue 'default'" in job.last_error
    assert runs("blocked") == 0 and runs("elsewhere") == 1


@pytest.mark.parametrize(
    "retry_on, expected_runs",
    [
        ([RuntimeError], 3),
        ([Exception], 3),  # a base class covers its subclasses
        ([ValueError, KeyError], 1),  # RuntimeError is not listed: no retry
    ],
)
def test_retry_on_restricts_retries_to_the_listed_exceptions(retry_on, expected_runs):
    job_id = scripted.using(max_retries=2, retry_on=retry_on).dispatch(action="raise", key="retry-on")
    statuses = [r.status for r in drain(QueueWorker("default"))]
    assert statuses == ["requeued"] * (expected_runs - 1) + ["dead-lettered"]
    assert runs("retry-on") == expected_runs
    assert Job.objects.get(pk=job_id).attempts == expected_runs


def test_retry_on_from_the_builder():
    job_id = (
        Jobs.define(scripted.key, {"args": ["raise"], "kwargs": {"key": "b-retry-on"}})
        .max_retries(4)
        .retry_on(ValueError)
        .dispatch()
    )
    assert [r.status for r in drain(QueueWorker("default"))] == ["dead-lettered"]
    assert Job.objects.get(pk=job_id).attempts == 1


def test_handler_can_retry_has_the_last_word(backend):
    with jobs_settings(HANDLERS={"giveup": "tests.api_support.GiveUpHandler"}):
        job_id = Jobs.define("giveup", {}).max_retries(5).dispatch(backend=backend)
        statuses = [r.status for r in drain(QueueWorker(backend))]
    # max_retries would allow six runs; can_retry says no after the second.
    assert statuses == ["requeued", "dead-lettered"]
    assert GiveUpHandler.calls == [
        ("run", 1),
        ("can_retry", (1, "RuntimeError")),
        ("run", 2),
        ("can_retry", (2, "RuntimeError")),
    ]
    job = row(backend, job_id)
    assert (job.status, job.attempts) == ("failed", 2)


@pytest.mark.parametrize("single_instance", [True, False])
def test_single_instance_requeues_a_delivery_while_the_lock_is_held(backend, single_instance):
    first = reentrant.using(single_instance=single_instance, priority=10, backend=backend).dispatch(
        key="A", backend=backend
    )
    second = reentrant.using(single_instance=single_instance, backend=backend).dispatch(key="B", backend=backend)
    worker = QueueWorker(backend, ["other"])

    outer = worker.process_once()  # runs A, which processes the next delivery (B) while A runs
    assert (outer.status, outer.job_id) == ("acked", first)
    nested = reentrant_results[-1]  # A's own nested result is appended last (B's run appends first)
    assert nested.job_id == second
    if not single_instance:  # control: without the option both run, even at the same time
        assert nested.status == "acked" and runs("B") == 1
        return
    # B arrived while A held the handler's lock: requeued, and not counted as a run.
    assert (nested.status, nested.attempt) == ("requeued", 0)
    job = row(backend, second)
    assert (job.status, job.attempts) == ("pending", 0)
    assert runs("B") == 0
    # Once A is done, B runs normally.
    later = worker.process_once()
    assert (later.status, later.job_id, later.attempt) == ("acked", second, 1)
    assert runs("B") == 1 and row(backend, second).attempts == 1


# -- settings are read lazily --------------------------------------------------------------------------


def test_what_a_dispatch_reads_of_the_settings_follows_a_change_of_them():
    # Read once per settings (queues, retries, the options of a @job): a change is seen at once.
    env = scripted.builder(action="ok").build()
    assert env.queue == "default"
    before = env.max_retries
    changed = {**settings.JOBS, "QUEUES": ["only-now", "default"], "DEFAULT_MAX_RETRIES": before + 3}
    with override_settings(JOBS=changed):
        env = Jobs.define("tests.testapp.jobs.scripted", {"args": [], "kwargs": {}}).build()
        assert (env.queue, env.max_retries) == ("only-now", before + 3)
        assert scripted.builder(action="ok").build().queue == "default"  # its @job names its queue
        with pytest.raises(UnknownQueue):
            scripted.using(queue="gone").builder(action="ok").build()
    with pytest.raises(UnknownQueue):
        scripted.using(queue="only-now").builder(action="ok").build()
    assert Jobs.define("tests.testapp.jobs.scripted").build().max_retries == before


def test_options_checked_once_are_checked_again_after_a_settings_change():
    bound = scripted.using(backoff={"base": 2})  # valid over the global policy of these settings
    bound.builder(action="ok")
    bogus = {**settings.JOBS, "RETRY_BACKOFF_STRATEGY": "bogus"}
    with override_settings(JOBS=bogus), pytest.raises(ValueError, match="unknown backoff strategy"):
        bound.builder(action="ok")
    bound.builder(action="ok")


def test_override_settings_keeps_the_test_transaction():
    first = scripted.dispatch(action="ok")  # builds the default backend instance
    with override_settings(JOBS={**settings.JOBS, "DEFAULT_MAX_RETRIES": 2}):
        second = scripted.dispatch(action="ok")
    assert Job.objects.filter(pk__in=[first, second]).count() == 2


def test_scheduled_at_keeps_the_instant_whatever_its_offset(backend):
    """An offset of seconds and microseconds is a Python ``timezone`` PostgreSQL cannot read:
    the job keeps the same instant, in UTC."""
    odd = datetime_timezone(timedelta(hours=-3, seconds=7, microseconds=500))
    when = (timezone.now() + timedelta(hours=2)).astimezone(odd)
    single = Jobs.define("command", "clearsessions").scheduled_at(when).dispatch(backend=backend)
    [bulked] = Jobs.bulk([Jobs.define("command", "clearsessions").scheduled_at(when)], backend=backend)
    assert row(backend, single).available_at == row(backend, bulked).available_at == when


@pytest.mark.parametrize("zone", ["UTC", "Europe/Amsterdam"])
def test_scheduled_at_with_use_tz_off_keeps_local_times(backend, zone):
    """With ``USE_TZ = False`` Django keeps naive times in ``TIME_ZONE``: an aware ``scheduled_at``
    is kept as one of them, later or earlier than now as it was given."""
    with override_settings(USE_TZ=False, TIME_ZONE=zone):
        later = datetime.now(UTC) + timedelta(hours=3)
        due_id = Jobs.define("command", "clearsessions").scheduled_at(datetime.now(UTC) - timedelta(minutes=1))
        job_id = Jobs.define("command", "clearsessions").scheduled_at(later).dispatch(backend=backend)
        [bulked] = Jobs.bulk([Jobs.define("command", "clearsessions").scheduled_at(later)], backend=backend)
        due = due_id.dispatch(backend=backend)
        local = timezone.make_naive(later, timezone.get_default_timezone())
        assert row(backend, job_id).available_at == row(backend, bulked).available_at == local
        result = QueueWorker(backend).process_once()
        assert (result.status, result.job_id) == ("acked", due)  # the one due runs; the later two wait
        assert QueueWorker(backend).process_once().status == "empty"
