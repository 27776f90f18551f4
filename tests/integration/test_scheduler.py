"""The scheduler in-process: which ticks are due, the claim that makes each run once, the
dispatch through each kind of backend, and the loop's survival of an outage.

Every pass is given its ``now``: no test sleeps or reads the wall clock to decide what is due.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError
from django.utils import timezone

from django_jobs.backends.database import DatabaseBackend
from django_jobs.metrics import get_collector
from django_jobs.models import Job, Schedule, ScheduleTick
from django_jobs.scheduler import GRACE, MAX_BACKOFF, REDISPATCH_AFTER, Scheduler, idempotency_key
from django_jobs.schedules import Entry, parse_entry
from django_jobs.signals import job_dispatching
from django_jobs.testing import run_jobs
from django_jobs.worker import QueueWorker
from tests.testapp import jobs as testjobs

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("clean_state")]

REMEMBER = "tests.testapp.jobs.remember"
# Ten past three: a whole minute, so "every 60 s" ticks fall on it.
T0 = datetime(2030, 1, 1, 3, 10, tzinfo=UTC)
MINUTE = timedelta(minutes=1)


def entry(name: str = "report", **raw: object) -> Entry:
    return parse_entry(name, {"job": REMEMBER, "every": 60, **raw})


def scheduler(*entries: Entry, at: datetime = T0, **options: object) -> Scheduler:
    """A scheduler of ``entries``, synced at ``at`` (its clock stays there)."""
    made = Scheduler({e.name: e for e in entries}, clock=lambda: at, **options)
    made.sync(at)
    return made


def ticks(name: str = "report") -> list[ScheduleTick]:
    return list(ScheduleTick.objects.filter(schedule_id=name).order_by("tick"))


@pytest.fixture(autouse=True)
def no_calls():
    testjobs.calls.clear()
    yield
    testjobs.calls.clear()


# -- sync ---------------------------------------------------------------------------------------


def test_sync_writes_a_row_per_entry_and_disables_removed_ones_keeping_their_ticks():
    daily = parse_entry("b", {"job": REMEMBER, "daily": "03:00"})
    first = scheduler(entry("a"), daily, at=T0)
    first.run_pass(T0 + MINUTE)
    rows = {row.name: row for row in Schedule.objects.all()}
    assert set(rows) == {"a", "b"}
    assert rows["a"].enabled and rows["a"].in_settings and rows["a"].created_at == T0
    assert rows["b"].description == daily.describe()
    assert rows["b"].next_run == datetime(2030, 1, 2, 3, 0, tzinfo=UTC)
    assert rows["a"].definition["every"] == 60

    later = T0 + 10 * MINUTE
    scheduler(entry("a"), at=later)  # "b" left the settings
    b = Schedule.objects.get(name="b")
    assert (b.enabled, b.in_settings, b.next_run) == (False, False, None)
    a = Schedule.objects.get(name="a")
    assert a.enabled and a.created_at == T0  # an existing row keeps when it was first synced
    assert len(ticks("a")) == 1  # "a" ran once; nothing was deleted


# -- which tick is due --------------------------------------------------------------------------


def test_a_pass_records_itself_on_its_entries_rows_every_15_s_at_most():
    """What the admin reads to warn that no scheduler runs: one write per 15 s, not per pass."""
    paused = entry("paused", enabled=False)
    made = scheduler(entry("a"), paused)
    Schedule.objects.create(name="elsewhere")  # another scheduler's entry

    def passed() -> dict[str, datetime | None]:
        return dict(Schedule.objects.values_list("name", "last_pass_at"))

    made.run_pass(T0 + timedelta(seconds=1))
    first = T0 + timedelta(seconds=1)
    assert passed() == {"a": first, "paused": first, "elsewhere": None}
    made.run_pass(T0 + timedelta(seconds=15))
    assert passed()["a"] == first  # not yet: 14 s later
    made.run_pass(T0 + timedelta(seconds=16))
    assert passed()["a"] == T0 + timedelta(seconds=16)
    made.run_pass(T0)  # its clock went back: recorded at once, or it would look gone for a while
    assert passed()["a"] == T0


def test_a_due_tick_is_dispatched_once_and_a_second_scheduler_finds_nothing():
    one, two = scheduler(entry()), scheduler(entry())
    now = T0 + MINUTE + timedelta(seconds=0.4)
    [done] = one.run_pass(now)
    assert done.tick == T0 + MINUTE and done.name == "report"
    assert two.run_pass(now) == []
    [row] = ticks()
    assert (row.tick, row.job_id, row.manual) == (T0 + MINUTE, done.job_id, False)
    assert row.dispatched_at == now  # a database backend's job committed with the claim
    job = Job.objects.get(pk=done.job_id)
    assert job.idempotency_key == f"schedule:report:{(T0 + MINUTE).isoformat()}"
    schedule = Schedule.objects.get(name="report")
    assert (schedule.last_run, schedule.last_job_id, schedule.next_run) == (T0 + MINUTE, done.job_id, T0 + 2 * MINUTE)


def test_a_scheduler_that_read_the_tick_as_due_before_the_other_claimed_it_dispatches_nothing(monkeypatch):
    """The race itself: both decided the tick is due; the unique claim lets one dispatch."""
    one, two = scheduler(entry()), scheduler(entry())
    now = T0 + MINUTE
    assert len(one.run_pass(now)) == 1
    monkeypatch.setattr(two, "_due", lambda entry, created, claims, now: T0 + MINUTE)  # a stale read
    assert two.run_pass(now) == []
    assert len(ticks()) == 1 and Job.objects.count() == 1


def test_nothing_is_due_between_ticks():
    made = scheduler(entry())
    assert made.run_pass(T0 + MINUTE)
    for seconds in (1, 30, 59.9):
        assert made.run_pass(T0 + MINUTE + timedelta(seconds=seconds)) == []
    assert len(ticks()) == 1


def test_a_new_entry_does_not_run_for_ticks_before_it_was_synced():
    synced = T0 + timedelta(seconds=20)
    made = scheduler(entry(missed="catch_up_once"), at=synced)
    assert made.run_pass(synced + timedelta(seconds=5)) == []  # T0 was due before the entry existed
    [done] = made.run_pass(T0 + MINUTE)
    assert done.tick == T0 + MINUTE


def test_skip_after_downtime_runs_nothing_for_the_past_and_the_next_tick_on_time():
    made = scheduler(entry(every=300))
    made.run_pass(T0 + 5 * MINUTE)
    back = T0 + timedelta(hours=5, minutes=2)  # 08:12: the 08:10 tick is older than the grace
    assert made.run_pass(back) == []
    next_tick = T0 + timedelta(hours=5, minutes=5)
    assert Schedule.objects.get(name="report").next_run == next_tick
    [done] = made.run_pass(next_tick)
    assert done.tick == next_tick
    assert [row.tick for row in ticks()] == [T0 + 5 * MINUTE, next_tick]


def test_skip_runs_a_tick_missed_by_less_than_the_grace():
    made = scheduler(entry(every=300))
    [done] = made.run_pass(T0 + 5 * MINUTE + GRACE - timedelta(seconds=1))
    assert done.tick == T0 + 5 * MINUTE


def test_catch_up_once_after_downtime_dispatches_exactly_one_job():
    made = scheduler(entry(missed="catch_up_once"))
    made.run_pass(T0 + MINUTE)
    back = T0 + timedelta(days=3, seconds=30)
    [done] = made.run_pass(back)
    assert done.tick == T0 + timedelta(days=3)  # the latest tick only
    assert made.run_pass(back) == []
    assert Job.objects.count() == 2 and len(ticks()) == 2


def test_a_disabled_entry_is_not_dispatched():
    made = scheduler(entry(enabled=False))
    assert made.run_pass(T0 + MINUTE) == []
    assert Schedule.objects.get(name="report").enabled is False


# -- the dispatch -------------------------------------------------------------------------------


def test_the_job_runs_with_the_entrys_args_and_kwargs_on_its_queue():
    made = scheduler(entry(args=[1, "two"], kwargs={"three": 3}, queue="other", priority=7))
    [done] = made.run_pass(T0 + MINUTE)
    job = Job.objects.get(pk=done.job_id)
    assert (job.queue, job.priority, job.handler) == ("other", 7, REMEMBER)
    assert [r.status for r in run_jobs("other")] == ["acked"]
    assert testjobs.calls == [((1, "two"), {"three": 3})]


def test_a_handlers_key_is_dispatched_with_its_payload(settings):
    settings.JOBS = {**settings.JOBS, "HANDLERS": {"give-up": "tests.api_support.GiveUpHandler"}}
    made = scheduler(parse_entry("handler", {"job": "give-up", "payload": {"retry_until": 1}, "every": 60}))
    [done] = made.run_pass(T0 + MINUTE)
    job = Job.objects.get(pk=done.job_id)
    assert (job.handler, job.payload) == ("give-up", {"retry_until": 1})
    assert job.signature  # signed as every dispatch is


def test_a_dispatch_that_fails_leaves_no_claim_and_the_tick_runs_next_pass(monkeypatch, caplog):
    """Database backend: the claim and the job commit together, or neither does."""
    made = scheduler(entry(missed="catch_up_once"), entry("other-entry"))
    original = DatabaseBackend.enqueue

    def insert_then_fail(self, envelope):  # a tick sends one job: enqueue, not enqueue_many
        original(self, envelope)
        raise DatabaseError("the insert was lost")

    monkeypatch.setattr(DatabaseBackend, "enqueue", insert_then_fail)
    with caplog.at_level(logging.DEBUG, logger="django_jobs.scheduler"):
        assert made.run_pass(T0 + MINUTE) == []
        assert made.run_pass(T0 + MINUTE) == []  # the same tick fails again: logged once
    assert ScheduleTick.objects.count() == 0 and Job.objects.count() == 0
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert sorted(r.getMessage().split(":")[0] for r in errors) == ["schedule 'other-entry'", "schedule 'report'"]
    assert {(r.handler, r.job_id) for r in errors} == {(REMEMBER, None)}  # the log fields

    monkeypatch.undo()
    assert sorted(d.name for d in made.run_pass(T0 + MINUTE)) == ["other-entry", "report"]
    assert Job.objects.count() == 2


def test_one_broken_entry_does_not_stop_the_others(caplog):
    made = scheduler(replace(entry("broken"), backend="not-configured"), entry("fine"))
    with caplog.at_level(logging.ERROR, logger="django_jobs.scheduler"):
        assert [d.name for d in made.run_pass(T0 + MINUTE)] == ["fine"]
    [record] = caplog.records
    assert "schedule 'broken'" in record.getMessage() and record.exc_info


def test_a_vanished_job_is_an_entrys_failure():
    gone = replace(entry("gone"), job="tests.testapp.jobs.no_such_job")  # its code was removed since
    made = scheduler(gone, entry("fine"))
    assert [d.name for d in made.run_pass(T0 + MINUTE)] == ["fine"]


@pytest.mark.django_db(transaction=True)
def test_a_redis_entrys_job_is_pushed_at_commit_then_marked_dispatched(redis_up):
    made = scheduler(entry(backend="redis", kwargs={"to": "redis"}))
    [done] = made.run_pass(T0 + MINUTE)
    [row] = ticks()
    assert row.job_id == done.job_id and row.dispatched_at is not None  # set once the push returned
    assert not Job.objects.exists()  # a broker keeps it
    result = QueueWorker("redis", ["default"]).process_once()
    assert (result.status, result.job_id) == ("acked", done.job_id)
    assert testjobs.calls == [((), {"to": "redis"})]


def test_a_claimed_but_undispatched_tick_is_sent_again_under_the_same_key():
    """A scheduler died between its commit and its push: the row stays undispatched."""
    hourly = entry(every=3600)  # no other tick falls due meanwhile
    made = scheduler(hourly)
    tick = T0 + MINUTE
    schedule = Schedule.objects.get(name="report")
    ScheduleTick.objects.create(schedule=schedule, tick=tick, job_id="lost", claimed_at=tick)
    now = tick + REDISPATCH_AFTER
    assert made.run_pass(now - timedelta(seconds=1)) == []  # claimed under REDISPATCH_AFTER ago: left alone
    done = made.run_pass(now + timedelta(seconds=1))
    assert [d.tick for d in done] == [tick]
    [row] = ticks()
    assert row.job_id == done[0].job_id != "lost" and row.dispatched_at is not None
    assert Job.objects.get(pk=row.job_id).idempotency_key == idempotency_key("report", tick)
    assert scheduler(hourly).run_pass(now + timedelta(seconds=2)) == []  # sent once


def test_run_now_makes_a_manual_tick_that_leaves_the_schedule_alone():
    made = scheduler(entry())
    asked = T0 + timedelta(seconds=20)
    made.clock = lambda: asked
    job_id = made.run_now("report")
    [row] = ticks()
    assert (row.tick, row.manual, row.job_id) == (asked, True, job_id)
    assert Job.objects.get(pk=job_id).idempotency_key == idempotency_key("report", asked)
    [done] = made.run_pass(T0 + MINUTE)  # the schedule's next tick runs all the same
    assert done.tick == T0 + MINUTE


def test_a_tick_a_receiver_cancels_is_spent():
    def cancel(sender, request, **kwargs):
        request.cancel("maintenance")

    job_dispatching.connect(cancel, sender=testjobs.remember)
    try:
        made = scheduler(entry())
        assert made.run_pass(T0 + MINUTE) == []
        assert made.run_pass(T0 + MINUTE) == []
    finally:
        job_dispatching.disconnect(cancel, sender=testjobs.remember)
    [row] = ticks()
    assert row.job_id == "" and row.dispatched_at is not None
    assert not Job.objects.exists()


def test_each_dispatch_is_counted_logged_and_reported(caplog):
    reported = []
    made = scheduler(entry(queue="emails"), on_dispatch=reported.append)
    before = get_collector().get("jobs_scheduled", queue="emails")
    with caplog.at_level(logging.INFO, logger="django_jobs.scheduler"):
        [done] = made.run_pass(T0 + MINUTE)
    assert get_collector().get("jobs_scheduled", queue="emails") == before + 1
    assert reported == [done] and made.dispatched == 1
    [record] = caplog.records
    assert (record.job_id, record.queue, record.handler, record.outcome) == (
        done.job_id,
        "emails",
        REMEMBER,
        "scheduled",
    )


# -- the loop -----------------------------------------------------------------------------------


class Waits(threading.Event):
    """A stop event whose waits return at once and are recorded; set after ``limit`` waits."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.waited = limit, []

    def wait(self, timeout: float | None = None) -> bool:
        self.waited.append(timeout)
        if len(self.waited) >= self.limit:
            self.set()
        return self.is_set()


def test_the_loop_survives_an_outage_logging_it_once_and_backing_off(monkeypatch, caplog):
    made = scheduler(entry())
    passes = []

    def run_pass(now=None):
        passes.append(now)
        if len(passes) <= 7:
            raise DatabaseError("connection refused")
        return []

    monkeypatch.setattr(made, "run_pass", run_pass)
    stop = Waits(limit=9)
    with caplog.at_level(logging.WARNING, logger="django_jobs.scheduler"):
        made.run(stop)
    assert stop.waited[:7] == [1, 2, 4, 8, 16, MAX_BACKOFF, MAX_BACKOFF]
    assert 0 < stop.waited[7] <= 1  # passes again: until the next tick, a poll at most
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "scheduler: a pass failed; retrying with a backoff until one succeeds",
        "scheduler: passes succeed again",
    ]


def test_the_loop_waits_until_the_next_tick_at_most_a_poll():
    made = scheduler(entry(), at=T0 + timedelta(seconds=59.75), poll=5)
    stop = Waits(limit=1)
    made.run(stop)
    assert stop.waited == [pytest.approx(0.25)]


def test_the_loop_syncs_before_its_first_pass():
    made = Scheduler({"report": entry()}, clock=lambda: T0)
    made.run(Waits(limit=1))
    assert Schedule.objects.filter(name="report", created_at=T0).exists()


# -- jobs_schedule ------------------------------------------------------------------------------


def test_jobs_schedule_once_prints_the_entries_and_what_it_dispatched(settings):
    settings.JOBS = {**settings.JOBS, "SCHEDULE": {"report": {"job": REMEMBER, "every": 60, "missed": "catch_up_once"}}}
    Schedule.objects.create(name="report", created_at=timezone.now() - 2 * MINUTE)  # synced before
    out = StringIO()
    call_command("jobs_schedule", "--once", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "django-jobs scheduler started: 1 entry, a pass every 1s at most"
    assert lines[1].startswith(f"  report: {entry().describe()}, next run ")
    [job] = Job.objects.all()
    assert lines[2].startswith("scheduled report (tick ") and lines[2].endswith(
        f"job {job.pk} {REMEMBER} queue=default"
    )
    assert lines[3:] == ["django-jobs scheduler stopped: 1 job(s) dispatched"]


@pytest.mark.parametrize(
    ("args", "schedule", "message"),
    [
        (["--interval", "0"], {}, "--interval must be a positive number of seconds"),
        (["--once"], {"report": {"job": REMEMBER}}, "report"),
    ],
)
def test_jobs_schedule_refuses_bad_options_and_entries_in_one_line(settings, args, schedule, message):
    settings.JOBS = {**settings.JOBS, "SCHEDULE": schedule}
    with pytest.raises(CommandError, match=message) as raised:
        call_command("jobs_schedule", *args)
    assert "\n" not in str(raised.value)
    assert not Schedule.objects.exists()
