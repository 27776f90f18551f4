"""Maintenance commands (jobs_purge, jobs_retry, jobs_stats, jobs_reap), run in-process with call_command."""

from __future__ import annotations

import json
import os
from datetime import UTC, timedelta
from io import StringIO
from typing import Any
from unittest import mock

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.core.serializers.json import DjangoJSONEncoder
from django.test import override_settings
from django.utils import timezone

from django_jobs import Jobs, operations
from django_jobs.history import attempts_of
from django_jobs.locks import CacheLock
from django_jobs.models import Job
from django_jobs.pool import WorkerPool
from django_jobs.reaper import Reaper
from django_jobs.worker import QueueWorker
from tests.api_support import drain, runs
from tests.testapp.jobs import scripted

pytestmark = [pytest.mark.django_db(databases=["default", "postgres"]), pytest.mark.usefixtures("clean_state")]


def run(*args: str, **options) -> str:
    out = StringIO()
    call_command(*args, stdout=out, **options)
    return out.getvalue()


def finished(action: str, queue: str = "default", **opts) -> str:
    """A job on ``queue`` that ran to its end: completed (``ok``) or failed (``raise``)."""
    job_id = scripted.using(queue=queue, **opts).dispatch(action=action)
    drain(QueueWorker("default", [queue]))
    return job_id


# -- jobs_purge ---------------------------------------------------------------------------------------


def test_purge_deletes_by_status():
    ok1, ok2 = finished("ok"), finished("ok")
    bad = finished("raise")
    pending = scripted.dispatch(action="ok")
    assert run("jobs_purge", "--status", "completed") == "deleted 2 completed job(s)\n"
    assert set(Job.objects.values_list("pk", flat=True)) == {bad, pending}
    assert not Job.objects.filter(pk__in=[ok1, ok2]).exists()
    assert run("jobs_purge", "--status", "failed") == "deleted 1 failed job(s)\n"
    assert list(Job.objects.values_list("pk", flat=True)) == [pending]  # never a live job


def test_purge_by_queue_and_age():
    fresh = finished("ok")
    old = finished("ok")
    old_other = finished("ok", queue="other")
    Job.objects.filter(pk__in=[old, old_other]).update(finished_at=timezone.now() - timedelta(days=3))
    assert run("jobs_purge", "--status", "completed", "--before", "2d", "--queue", "default") == (
        "deleted 1 completed job(s)\n"
    )
    assert set(Job.objects.values_list("pk", flat=True)) == {fresh, old_other}
    assert run("jobs_purge", "--status", "completed", "--before", "48h") == "deleted 1 completed job(s)\n"
    assert list(Job.objects.values_list("pk", flat=True)) == [fresh]


def test_purge_dry_run_counts_without_deleting():
    finished("raise")
    finished("raise", queue="emails")
    assert run("jobs_purge", "--status", "failed", "--dry-run") == "would delete 2 failed job(s)\n"
    assert run("jobs_purge", "--status", "failed", "--queue", "emails", "--dry-run") == (
        "would delete 1 failed job(s)\n"
    )
    assert Job.objects.filter(status="failed").count() == 2


def test_purge_reaches_a_database_backend_on_another_alias(postgres_up):
    scripted.using(backend="pg").dispatch(action="ok")
    drain(QueueWorker("pg"))
    assert run("jobs_purge", "--status", "completed") == "deleted 1 completed job(s)\n"
    assert not Job.objects.using("postgres").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["jobs_purge"],  # --status is required
        ["jobs_purge", "--status", "pending"],  # live jobs are never purged
        ["jobs_purge", "--status", "completed", "--before", "yesterday"],
        ["jobs_purge", "--status", "completed", "--before", "-5d"],
        ["jobs_retry"],  # nothing to retry given
        ["jobs_retry", "abc", "--all-failed"],  # both
        ["jobs_stats", "--bogus"],
        ["jobs_reap", "--interval", "soon"],
    ],
)
def test_bad_options_raise_command_error(argv):
    with pytest.raises(CommandError):
        run(*argv)


@pytest.fixture
def nothing_starts():
    """A worker pool or a reaper loop that starts fails the test at once (instead of forking
    workers inside pytest, or spinning forever on a zero interval)."""
    with (
        mock.patch.object(WorkerPool, "install_signal_handlers"),
        mock.patch.object(WorkerPool, "run", side_effect=AssertionError("a worker pool started")),
        mock.patch.object(Reaper, "run", side_effect=AssertionError("a reaper loop started")),
    ):
        yield


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["jobs_work", "--backend", "nope"], "unknown backend 'nope'"),
        (["jobs_work", "--backend", "nope", "--once"], "unknown backend 'nope'"),
        (["jobs_work", "--backend", "Redis"], "did you mean 'redis'?"),
        (["jobs_work", "nope"], "unknown queue(s) nope"),
        (["jobs_work", "default", "emials"], "did you mean 'emails'?"),
        (["jobs_work", "--sleep", "0"], "--sleep must be a positive number"),
        (["jobs_work", "--sleep", "-1"], "--sleep must be a positive number"),
        (["jobs_work", "--sleep", "nan"], "--sleep must be a positive number"),
        (["jobs_work", "--max", "-1"], "--max must be at least 1"),
        (["jobs_work", "--max", "0"], "--max must be at least 1"),
        (["jobs_work", "--concurrency", "0"], "--concurrency must be at least 1"),
        (["jobs_work", "--max-time", "0"], "--max-time must be a positive number"),
        (["jobs_work", "--max-time", "-3"], "--max-time must be a positive number"),
        (["jobs_reap", "--interval", "0"], "--interval must be a positive number"),
        (["jobs_reap", "--loop", "--interval", "-5"], "--interval must be a positive number"),
        (["jobs_reap", "--loop", "--interval", "0"], "--interval must be a positive number"),
        (["jobs_reap", "--backend", "nope"], "unknown backend 'nope'"),
        (["jobs_reap", "nope"], "unknown queue(s) nope"),
        (["jobs_purge", "--status", "completed", "--before", "99999999999d"], "too large"),
        (["jobs_purge", "--status", "completed", "--before", "9" * 400], "too large"),
        (["jobs_stats", "--backend", "nope"], "unknown backend 'nope'"),
    ],
)
def test_bad_values_are_one_line_command_errors(argv, message):
    with pytest.raises(CommandError) as info:
        run(*argv)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.usefixtures("nothing_starts")
def test_a_backend_whose_engine_cannot_be_imported_is_refused_before_starting():
    backends = {**settings.JOBS["BACKENDS"], "gone": {"ENGINE": "myproject.queues.NoSuchBackend"}}
    with (
        override_settings(JOBS={**settings.JOBS, "BACKENDS": backends}),
        pytest.raises(CommandError, match="backend 'gone'"),
    ):
        run("jobs_work", "--backend", "gone", "--once")


@pytest.mark.usefixtures("nothing_starts")
def test_bad_signing_settings_stop_jobs_work_before_it_starts():
    with (
        override_settings(JOBS={**settings.JOBS, "SIGNING_KEY_FALLBACKS": "old-key"}),
        pytest.raises(CommandError, match="SIGNING_KEY_FALLBACKS"),
    ):
        run("jobs_work", "--once")


def test_jobs_work_exits_non_zero_when_its_pool_gives_up():
    with (
        mock.patch.object(WorkerPool, "install_signal_handlers"),
        mock.patch.object(WorkerPool, "run", return_value=1),
        pytest.raises(CommandError, match="keep dying at start-up"),
    ):
        run("jobs_work")  # a bounded run of one process (--once, --max) does not use the pool


# -- jobs_retry ---------------------------------------------------------------------------------------


def test_retry_keeps_the_newest_history_limit_attempts(failed_job):
    job_id = failed_job(runs=3)
    with override_settings(JOBS={**settings.JOBS, "HISTORY_LIMIT": 2}):
        assert run("jobs_retry", job_id) == "retried 1 job(s)\n"
        assert [a.attempt for a in attempts_of(job_id)] == [2, 3]
        assert QueueWorker("default").process_once().job_id == job_id  # fails again: attempt 1
        outcomes = [(a.attempt, a.outcome) for a in attempts_of(job_id)]
        assert outcomes == [(2, "retrying"), (3, "failed"), (1, "retrying")]


def test_retry_by_ids():
    first = finished("raise")
    second = finished("raise")
    untouched = finished("raise")
    done = finished("ok")
    err = StringIO()
    assert run("jobs_retry", first, second, done, "nope", stderr=err) == "retried 2 job(s)\n"
    assert err.getvalue().splitlines() == [
        "nope: no such job",
        f"{done}: not failed or cancelled (it is completed); left alone",
    ]
    for job_id in (first, second):
        job = Job.objects.get(pk=job_id)
        assert (job.status, job.attempts, job.last_error) == ("pending", 0, "")
        assert job.available_at <= timezone.now()
    assert Job.objects.get(pk=untouched).status == "failed"
    assert Job.objects.get(pk=done).status == "completed"
    # They really run again (and fail again: one run each since the reset).
    assert {r.job_id for r in drain(QueueWorker("default"))} == {first, second}
    assert Job.objects.get(pk=first).attempts == 1


def test_retry_all_failed_on_one_queue():
    on_default = finished("raise")
    on_other = [finished("raise", queue="other"), finished("raise", queue="other")]
    assert run("jobs_retry", "--all-failed", "--queue", "other") == "retried 2 job(s)\n"
    assert set(Job.objects.filter(status="pending").values_list("pk", flat=True)) == set(on_other)
    assert Job.objects.get(pk=on_default).status == "failed"
    assert run("jobs_retry", "--all-failed") == "retried 1 job(s)\n"
    assert Job.objects.filter(status="failed").count() == 0


def test_retry_reaches_a_database_backend_on_another_alias(postgres_up):
    job_id = scripted.using(backend="pg").dispatch(action="raise")
    drain(QueueWorker("pg"))
    assert run("jobs_retry", job_id) == "retried 1 job(s)\n"
    assert Job.objects.using("postgres").get(pk=job_id).status == "pending"


def test_retry_that_retries_none_of_the_given_ids_exits_non_zero():
    done = finished("ok")
    err = StringIO()
    with pytest.raises(CommandError, match="none of the given jobs was retried"):
        run("jobs_retry", "does-not-exist", done, stderr=err)
    assert err.getvalue().splitlines() == [
        "does-not-exist: no such job",
        f"{done}: not failed or cancelled (it is completed); left alone",
    ]
    assert Job.objects.get(pk=done).status == "completed"
    # --all-failed with nothing failed is not an error (a cron job's quiet day).
    assert run("jobs_retry", "--all-failed") == "retried 0 job(s)\n"


def test_jobs_work_says_when_a_failed_run_will_be_retried():
    job_id = scripted.using(max_retries=3, backoff={"strategy": "fixed", "base": 4, "jitter": False}).dispatch(
        action="raise"
    )

    [line] = [line for line in run("jobs_work", "--once").splitlines() if job_id in line]

    assert line.split()[0] == "retrying" and "attempt=1" in line
    assert "retry 2/4 in 4.0s" in line and "RuntimeError: scripted failure" in line


def test_jobs_work_ends_with_a_summary_and_lists_the_jobs_at_verbosity_2():
    scripted.dispatch(action="ok")
    scripted.using(max_retries=0).dispatch(action="raise")

    lines = run("jobs_work", "--max", "2", verbosity=2).splitlines()

    assert lines[0].startswith("django-jobs worker started: backend=default queues=default")
    assert lines[1].startswith("registered jobs (") and "tests.testapp.jobs.scripted" in lines[1]
    assert [line.split()[0] for line in lines[2:4]] == ["completed", "failed"]
    assert lines[-1].startswith(f"django-jobs worker stopped: process {os.getpid()}, 2 deliveries in ")
    assert lines[-1].endswith(": 1 completed, 1 failed")


def test_jobs_work_at_verbosity_0_prints_only_its_start_line():
    scripted.dispatch(action="ok")
    lines = run("jobs_work", "--once", verbosity=0).splitlines()
    assert len(lines) == 1 and lines[0].startswith("django-jobs worker started")


def test_jobs_work_colours_its_words_only_on_a_terminal_or_when_forced():
    green_completed = "\x1b[32;1mcompleted\x1b[0m"
    for _ in range(3):
        scripted.dispatch(action="ok")
    forced = run("jobs_work", "--once", force_color=True).splitlines()[1]
    assert forced.startswith(green_completed)
    plain = run("jobs_work", "--once").splitlines()[1]  # not a terminal: no colour
    assert plain.startswith("completed ") and "\x1b" not in plain
    assert "\x1b" not in run("jobs_work", "--once", no_color=True)


def test_jobs_work_says_deferred_for_a_job_that_waits_for_its_lock():
    assert CacheLock("django_jobs:single:tests.testapp.jobs.scripted", "another-delivery", 60).acquire()
    job_id = scripted.using(single_instance=True).dispatch(action="ok")

    [line] = [line for line in run("jobs_work", "--once").splitlines() if job_id in line]

    assert line.split()[0] == "deferred" and "retry" not in line


def test_jobs_work_shows_no_attempt_for_a_rejected_message():
    job_id = scripted.dispatch(action="ok")
    Job.objects.filter(pk=job_id).update(signature="0" * 64)  # tampered: rejected, never run

    [line] = [line for line in run("jobs_work", "--once").splitlines() if job_id in line]

    assert line.split()[0] == "rejected" and "attempt=" not in line, line


def test_jobs_work_warns_under_its_start_line_when_its_redis_keeps_nothing_on_disk(redis_up):
    out, err = StringIO(), StringIO()
    call_command("jobs_work", "--backend", "redis", "--once", stdout=out, stderr=err)
    assert out.getvalue().startswith("django-jobs worker started: backend=redis")
    [warning] = err.getvalue().splitlines()
    assert warning.startswith("WARNING: Redis at ") and warning.endswith("a restart loses every queued job")

    err = StringIO()
    call_command("jobs_work", "--once", stdout=StringIO(), stderr=err)
    assert err.getvalue() == ""  # the database keeps its jobs


# -- jobs_list ----------------------------------------------------------------------------------------


def test_list_shows_the_newest_jobs_with_their_first_error_line():
    failed = finished("raise", max_retries=1)
    done = finished("ok")
    pending = scripted.dispatch(action="ok")

    lines = run("jobs_list").splitlines()

    assert lines[0].split()[:5] == ["id", "status", "queue", "runs", "changed"]
    by_id = {line.split()[0]: line for line in lines[1:]}
    assert set(by_id) == {failed, done, pending}
    assert by_id[failed].split()[1:4] == ["failed", "default", "2/2"]
    assert "RuntimeError: scripted failure" in by_id[failed]  # the first line of the error only
    assert "Traceback" not in by_id[failed]
    assert by_id[done].split()[1:4] == ["completed", "default", "1/1"]
    assert by_id[pending].split()[1:4] == ["pending", "default", "0/1"]
    assert lines[1].split()[0] == pending  # the newest change first


def test_list_filters_by_status_queue_and_limit_and_prints_json():
    failed = finished("raise")
    finished("raise", queue="other")
    finished("ok")

    rows = json.loads(run("jobs_list", "--status", "failed", "--queue", "default", "--json"))

    assert [row["id"] for row in rows] == [failed]
    assert rows[0]["last_error"].startswith("RuntimeError: scripted failure") and "Traceback" in rows[0]["last_error"]
    assert set(rows[0]) == set(operations.LISTED)
    assert len(json.loads(run("jobs_list", "--limit", "2", "--json"))) == 2
    assert run("jobs_list", "--status", "in_progress") == "no jobs\n"


def test_list_says_who_asked_a_running_job_to_abort_and_when():
    running = scripted.dispatch(action="ok")
    assert Jobs.backend("default").fetch("default") is not None
    Jobs.abort(running, "admin:boss")
    asked_at = Job.objects.get(pk=running).abort_requested_at

    [line] = run("jobs_list", "--status", "in_progress").splitlines()[1:]
    [row] = json.loads(run("jobs_list", "--status", "in_progress", "--json"))

    when = asked_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    assert line.split()[:2] == [running, "in_progress"]
    assert line.endswith(f"  abort requested by admin:boss at {when} UTC")
    assert (row["abort_requested"], row["abort_requested_at"]) == ("admin:boss", DjangoJSONEncoder().default(asked_at))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--status", "lost"], "invalid choice: 'lost'"),
        (["--limit", "0"], "--limit must be at least 1"),
        (["--backend", "nope"], "nope"),
    ],
)
def test_list_refuses_bad_options(argv, message):
    with pytest.raises(CommandError, match=message):
        run("jobs_list", *argv)


# -- jobs_stats ---------------------------------------------------------------------------------------


def make_stats_rows() -> None:
    """default queue: 2 pending, 1 delayed, 1 in progress, 1 failed, 1 completed; other: 1 pending."""
    finished("raise")
    finished("ok")
    scripted.using(priority=10).dispatch(action="ok")
    assert Jobs.backend("default").fetch("default") is not None  # now in progress
    scripted.dispatch(action="ok")
    scripted.dispatch(action="ok")
    scripted.using(delay=3600).dispatch(action="ok")
    scripted.using(queue="other").dispatch(action="ok")


def test_stats_json_matches_the_rows():
    make_stats_rows()
    rows = json.loads(run("jobs_stats", "--json", "--backend", "default"))
    by_queue = {(r["backend"], r["queue"]): r for r in rows}
    assert set(by_queue) == {("default", "default"), ("default", "other"), ("default", "emails")}
    assert by_queue["default", "default"] == {
        "backend": "default",
        "queue": "default",
        "pending": 2,
        "delayed": 1,
        "in_progress": 1,
        "failed": 1,
        "waiting": 0,
    }
    assert by_queue["default", "other"] == {
        "backend": "default",
        "queue": "other",
        "pending": 1,
        "delayed": 0,
        "in_progress": 0,
        "failed": 0,
        "waiting": 0,
    }
    assert by_queue["default", "emails"] == {
        "backend": "default",
        "queue": "emails",
        "pending": 0,
        "delayed": 0,
        "in_progress": 0,
        "failed": 0,
        "waiting": 0,
    }


def test_stats_table_covers_every_backend(postgres_up, redis_up, beanstalk_up):
    make_stats_rows()
    scripted.using(backend="pg", queue="emails").dispatch(action="ok")
    lines = run("jobs_stats").splitlines()
    assert lines[0].split() == ["backend", "queue", "pending", "delayed", "in_progress", "failed", "waiting"]
    table = {tuple(line.split()[:2]): line.split()[2:] for line in lines[1:]}
    assert table["default", "default"] == ["2", "1", "1", "1", "0"]
    assert table["default", "other"] == ["1", "0", "0", "0", "0"]
    assert table["pg", "emails"] == ["1", "0", "0", "0", "0"]
    assert table["pg", "default"] == ["0", "0", "0", "0", "0"]
    assert ("sync", "default") in table
    assert table["redis", "default"][:4] == ["0", "0", "0", "0"]
    assert table["beanstalk", "default"] == ["0", "0", "0", "0", "-"]  # no dependencies there
    assert len(table) == len(settings.JOBS["BACKENDS"]) * len(settings.JOBS["QUEUES"])


@override_settings(
    JOBS={
        **settings.JOBS,
        "BACKENDS": {
            **settings.JOBS["BACKENDS"],
            "down": {"ENGINE": "redis", "OPTIONS": {"URL": "redis://127.0.0.1:1/0"}},
        },
    }
)
def test_stats_reports_an_unreachable_backend_and_still_shows_the_others():
    lines = run("jobs_stats").splitlines()
    assert any(line.startswith("down") and "unavailable: ConnectionError" in line for line in lines)
    assert any(line.split()[:2] == ["default", "default"] for line in lines)


# -- jobs_reap -----------------------------------------------------------------------------------------


def test_reap_recovers_expired_leases_and_prints_the_count():
    retried = scripted.using(max_retries=1).dispatch(action="ok", key="reaped")
    spent = scripted.using(queue="other").dispatch(action="ok")
    live = scripted.dispatch(action="ok")
    backend = Jobs.backend("default")
    for queue in ("default", "other", "default"):
        assert backend.fetch(queue) is not None
    # Two workers "died": their leases ran out. The third is still within its lease.
    Job.objects.filter(pk__in=[retried, spent]).update(leased_until=timezone.now() - timedelta(seconds=1))

    assert run("jobs_reap") == "reaped 2 expired lease(s)\n"
    job = Job.objects.get(pk=retried)
    assert (job.status, job.attempts) == ("pending", 1)  # the lost run counts; a retry is left
    assert job.last_error.startswith("WorkerLost")
    job = Job.objects.get(pk=spent)
    assert (job.status, job.attempts) == ("failed", 1)  # max_retries 0: no retry left
    assert Job.objects.get(pk=live).status == "in_progress"
    assert run("jobs_reap") == "reaped 0 expired lease(s)\n"
    # The requeued job runs again.
    assert QueueWorker("default").process_once().job_id == retried
    assert runs("reaped") == 1


def test_reap_limited_to_a_queue():
    on_default = scripted.dispatch(action="ok")
    on_other = scripted.using(queue="other").dispatch(action="ok")
    backend = Jobs.backend("default")
    backend.fetch("default"), backend.fetch("other")
    Job.objects.update(leased_until=timezone.now() - timedelta(seconds=1))
    assert run("jobs_reap", "other") == "reaped 1 expired lease(s)\n"
    assert Job.objects.get(pk=on_other).status == "failed"
    assert Job.objects.get(pk=on_default).status == "in_progress"


def test_reap_on_the_pg_backend(postgres_up):
    job_id = scripted.using(backend="pg", max_retries=2).dispatch(action="ok")
    assert Jobs.backend("pg").fetch("default") is not None
    Job.objects.using("postgres").filter(pk=job_id).update(leased_until=timezone.now() - timedelta(seconds=1))
    assert run("jobs_reap", "--backend", "pg") == "reaped 1 expired lease(s)\n"
    assert Job.objects.using("postgres").get(pk=job_id).status == "pending"


def test_jobs_work_refuses_a_database_without_its_migrations():
    from django.db.migrations.recorder import MigrationRecorder

    applied = MigrationRecorder.applied_migrations

    def without_the_newest(self: MigrationRecorder) -> dict[tuple[str, str], Any]:
        return {key: value for key, value in applied(self).items() if key != ("django_jobs", "0003_notify_trigger")}

    with (
        mock.patch.object(MigrationRecorder, "applied_migrations", without_the_newest),
        pytest.raises(
            CommandError, match=r"lacks django-jobs' migrations 0003_notify_trigger: run `manage.py migrate`"
        ),
    ):
        run("jobs_work", "--once")


def test_jobs_work_starts_when_its_database_cannot_be_reached_yet():
    from django.db import OperationalError
    from django.db.migrations.recorder import MigrationRecorder

    key = f"unreached-{timezone.now().timestamp()}"
    scripted.dispatch(action="ok", key=key)
    # The check cannot ask the database: the worker starts and waits for it, as in an outage.
    with mock.patch.object(MigrationRecorder, "applied_migrations", side_effect=OperationalError("down")):
        run("jobs_work", "--once")
    assert runs(key) == 1


@pytest.mark.parametrize("name", ["jobs_work", "jobs_reap", "jobs_purge", "jobs_retry", "jobs_stats", "jobs_list"])
def test_every_option_of_every_command_has_help_text(name):
    from django.core.management import load_command_class

    parser = load_command_class("django_jobs", name).create_parser("manage.py", name)
    ours = [a for a in parser._actions if a.dest not in BASE_OPTIONS]
    assert ours, name
    assert [a.dest for a in ours if not a.help] == []


# Django's own options, documented by Django.
BASE_OPTIONS = {
    "help", "version", "verbosity", "settings", "pythonpath", "traceback", "no_color", "force_color", "skip_checks",
}  # fmt: skip
