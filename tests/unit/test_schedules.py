"""The entries of ``JOBS["SCHEDULE"]``: validation, ticks (DST included), words. Fixed datetimes only."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.test import override_settings

from django_jobs import registry, schedules
from django_jobs.schedules import Entry, ScheduleError, entries, errors, parse_entry
from tests.api_support import jobs_settings

JOB = "tests.testapp.jobs.scripted"
PARIS, NEW_YORK = "Europe/Paris", "America/New_York"


def utc(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)  # type: ignore[misc]


def entry(**raw: Any) -> Entry:
    return parse_entry("nightly", {"job": JOB, **raw})


def ticks(schedule: Entry, after: datetime, count: int) -> list[datetime]:
    """The next ``count`` ticks after ``after``, each checked against previous_tick."""
    found = []
    for _ in range(count):
        tick = schedule.next_tick(after)
        assert tick > after and schedule.previous_tick(tick) == tick
        assert schedule.previous_tick(tick - timedelta(microseconds=1)) <= after
        found.append(tick)
        after = tick
    return found


# -- every: fixed instants since the epoch -------------------------------------------------------------


def test_every_ticks_are_multiples_of_the_interval_since_the_epoch():
    schedule = entry(every=300)
    assert schedule.next_tick(utc(2026, 5, 4, 10, 2, 30)) == utc(2026, 5, 4, 10, 5)
    assert schedule.previous_tick(utc(2026, 5, 4, 10, 2, 30)) == utc(2026, 5, 4, 10, 0)
    assert ticks(entry(every=7), utc(1970, 1, 1), 2) == [utc(1970, 1, 1, 0, 0, 7), utc(1970, 1, 1, 0, 0, 14)]


def test_every_is_the_same_instants_in_every_zone():
    # Kolkata is UTC+05:30: the ticks stay on UTC multiples of 5 minutes (local :30, :35, ...).
    after = utc(2026, 3, 29, 0, 58)
    expected = [utc(2026, 3, 29, 1, 0), utc(2026, 3, 29, 1, 5)]
    for zone in ("UTC", "Asia/Kolkata", PARIS):
        assert ticks(entry(every=300, timezone=zone), after, 2) == expected


@pytest.mark.parametrize(("written", "seconds"), [(1, 1), ("30s", 30), ("5m", 300), ("2h", 7200), ("5 m", 300)])
def test_every_accepts_seconds_or_a_unit(written, seconds):
    assert entry(every=written).trigger == {"every": seconds}


def test_previous_tick_after_a_year_of_downtime_is_one_computation():
    # A year of every-second ticks (31.5 million) is not iterated: the answer is arithmetic.
    schedule = entry(every=1)
    assert schedule.previous_tick(utc(2027, 5, 4, 10, 2, 30) + timedelta(microseconds=999_999)) == utc(
        2027, 5, 4, 10, 2, 30
    )
    assert entry(cron="* * * * *").previous_tick(utc(2027, 5, 4, 10, 2, 30)) == utc(2027, 5, 4, 10, 2)


# -- due or not: a tick exactly at `at` -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("trigger", "tick"),
    [
        ({"every": 300}, utc(2026, 5, 4, 10, 5)),
        ({"hourly": 15}, utc(2026, 5, 4, 10, 15)),
        ({"daily": "03:00"}, utc(2026, 5, 4, 3, 0)),
        ({"weekly": "mon 09:00"}, utc(2026, 5, 4, 9, 0)),  # 2026-05-04 is a Monday
        ({"monthly": "4 03:00"}, utc(2026, 5, 4, 3, 0)),
        ({"cron": "0 3 * * *"}, utc(2026, 5, 4, 3, 0)),
    ],
)
def test_a_tick_exactly_at_the_moment_is_the_previous_tick_not_the_next(trigger, tick):
    schedule = entry(**trigger, timezone="UTC")
    assert schedule.previous_tick(tick) == tick
    assert schedule.next_tick(tick) > tick
    assert schedule.next_tick(tick - timedelta(microseconds=1)) == tick
    assert schedule.previous_tick(tick - timedelta(microseconds=1)) < tick


# -- calendar triggers ---------------------------------------------------------------------------------


def test_hourly():
    schedule = entry(hourly=15, timezone="UTC")
    assert ticks(schedule, utc(2026, 5, 4, 10, 20), 2) == [utc(2026, 5, 4, 11, 15), utc(2026, 5, 4, 12, 15)]
    assert schedule.previous_tick(utc(2026, 5, 4, 10, 14)) == utc(2026, 5, 4, 9, 15)
    assert entry(hourly=True).trigger == {"hourly": 0}


def test_hourly_in_a_zone_with_a_half_hour_offset():
    # Kolkata is UTC+05:30: minute 15 local is minute 45 UTC.
    assert entry(hourly=15, timezone="Asia/Kolkata").next_tick(utc(2026, 5, 4, 10, 0)) == utc(2026, 5, 4, 10, 45)


def test_daily_weekly_monthly():
    daily = entry(daily="03:00", timezone=PARIS)  # CEST: UTC+2
    assert ticks(daily, utc(2026, 5, 4, 1, 0), 2) == [utc(2026, 5, 5, 1, 0), utc(2026, 5, 6, 1, 0)]
    weekly = entry(weekly="Monday 09:00", timezone="UTC")
    assert weekly.trigger == {"weekly": "mon 09:00"}
    assert ticks(weekly, utc(2026, 5, 4, 9, 0), 2) == [utc(2026, 5, 11, 9, 0), utc(2026, 5, 18, 9, 0)]
    assert weekly.previous_tick(utc(2026, 5, 10, 23, 59)) == utc(2026, 5, 4, 9, 0)
    monthly = entry(monthly="1 03:00", timezone="UTC")
    assert ticks(monthly, utc(2026, 12, 15), 2) == [utc(2027, 1, 1, 3, 0), utc(2027, 2, 1, 3, 0)]


def test_monthly_on_day_31_skips_the_months_without_one():
    schedule = entry(monthly="31 03:00", timezone="UTC")
    assert ticks(schedule, utc(2026, 1, 1), 4) == [
        utc(2026, 1, 31, 3, 0),
        utc(2026, 3, 31, 3, 0),
        utc(2026, 5, 31, 3, 0),
        utc(2026, 7, 31, 3, 0),
    ]
    assert schedule.previous_tick(utc(2026, 3, 30)) == utc(2026, 1, 31, 3, 0)
    leap = entry(monthly="29 00:00", timezone="UTC")
    assert leap.next_tick(utc(2027, 1, 30)) == utc(2027, 3, 29)
    assert leap.next_tick(utc(2028, 1, 30)) == utc(2028, 2, 29)


def test_cron():
    schedule = entry(cron="0 9 * * 1-5", timezone="UTC")  # weekdays at 09:00
    assert ticks(schedule, utc(2026, 5, 8, 10, 0), 2) == [utc(2026, 5, 11, 9, 0), utc(2026, 5, 12, 9, 0)]
    assert schedule.previous_tick(utc(2026, 5, 10, 12, 0)) == utc(2026, 5, 8, 9, 0)
    assert entry(cron="  0  3 * *   * ").trigger == {"cron": "0 3 * * *"}


def test_times_are_read_in_the_settings_time_zone_by_default():
    with override_settings(TIME_ZONE=NEW_YORK):
        schedule = entry(daily="03:00")
    assert schedule.timezone == NEW_YORK
    assert schedule.next_tick(utc(2026, 5, 4)) == utc(2026, 5, 4, 7, 0)  # EDT: UTC-4


def test_naive_datetimes_are_refused():
    with pytest.raises(ValueError, match="aware"):
        entry(every=60).next_tick(datetime(2026, 5, 4))


# -- daylight saving time ------------------------------------------------------------------------------
# Paris: 2026-03-29 02:00 CET -> 03:00 CEST (01:00 UTC); 2026-10-25 03:00 CEST -> 02:00 CET (01:00 UTC).
# New York: 2026-03-08 02:00 EST -> 03:00 EDT (07:00 UTC); 2026-11-01 02:00 EDT -> 01:00 EST (06:00 UTC).


def test_a_time_the_clocks_skip_runs_at_the_end_of_the_gap():
    paris = entry(daily="02:30", timezone=PARIS)
    assert ticks(paris, utc(2026, 3, 27, 12), 3) == [
        utc(2026, 3, 28, 1, 30),  # 02:30 CET
        utc(2026, 3, 29, 1, 0),  # 02:30 does not exist: 03:00 CEST, the first instant after the gap
        utc(2026, 3, 30, 0, 30),  # 02:30 CEST
    ]
    new_york = entry(daily="02:30", timezone=NEW_YORK)
    assert ticks(new_york, utc(2026, 3, 7, 12), 3) == [
        utc(2026, 3, 8, 7, 0),  # 03:00 EDT
        utc(2026, 3, 9, 6, 30),
        utc(2026, 3, 10, 6, 30),
    ]


@pytest.mark.parametrize(
    ("zone", "daily", "day", "once"),
    [
        (NEW_YORK, "01:30", utc(2026, 11, 1), utc(2026, 11, 1, 5, 30)),  # 01:30 EDT, not 01:30 EST
        (PARIS, "02:30", utc(2026, 10, 24, 12), utc(2026, 10, 25, 0, 30)),  # 02:30 CEST, not 02:30 CET
    ],
)
def test_a_time_that_occurs_twice_runs_once_at_its_first_occurrence(zone, daily, day, once):
    schedule = entry(daily=daily, timezone=zone)
    first, second = ticks(schedule, day, 2)
    assert first == once and second == once + timedelta(days=1, hours=1)  # the next day in winter time
    # 40 minutes after it, the clocks have gone back: the wall time is 40 minutes before it
    # (the second pass of the repeated hour), and the latest tick is still the first occurrence.
    assert schedule.previous_tick(once + timedelta(minutes=40)) == once
    assert schedule.next_tick(once + timedelta(minutes=50)) == second


def test_hourly_follows_real_hours_across_both_transitions():
    # The skipped hour has no tick; the repeated hour has two (the clock shows :30 twice).
    paris = entry(hourly=30, timezone=PARIS)
    assert ticks(paris, utc(2026, 3, 29, 0, 0), 2) == [utc(2026, 3, 29, 0, 30), utc(2026, 3, 29, 1, 30)]  # 01:30, 03:30
    assert ticks(paris, utc(2026, 10, 24, 23, 59), 3) == [
        utc(2026, 10, 25, 0, 30),  # 02:30 CEST
        utc(2026, 10, 25, 1, 30),  # 02:30 CET
        utc(2026, 10, 25, 2, 30),  # 03:30 CET
    ]
    assert paris.previous_tick(utc(2026, 10, 25, 1, 10)) == utc(2026, 10, 25, 0, 30)
    new_york = entry(hourly=30, timezone=NEW_YORK)
    expected = [utc(2026, 11, 1, hour, 30) for hour in (4, 5, 6, 7)]  # 00:30 EDT, 01:30 EDT, 01:30 EST, 02:30 EST
    assert ticks(new_york, utc(2026, 11, 1, 4, 0), 4) == expected
    assert ticks(new_york, utc(2026, 3, 8, 6, 0), 2) == [utc(2026, 3, 8, 6, 30), utc(2026, 3, 8, 7, 30)]  # 01:30, 03:30


@pytest.mark.parametrize("zone", [PARIS, NEW_YORK])
def test_cron_reads_wall_clock_times_as_daily_does(zone):
    cron, daily = entry(cron="30 2 * * *", timezone=zone), entry(daily="02:30", timezone=zone)
    for start in (utc(2026, 3, 6), utc(2026, 3, 27), utc(2026, 10, 23), utc(2026, 10, 30)):
        assert ticks(cron, start, 4) == ticks(daily, start, 4)
    moments = [utc(2026, 3, 29, 1, 0), utc(2026, 10, 25, 1, 10), utc(2026, 11, 1, 6, 40), utc(2026, 3, 8, 7, 0)]
    assert [cron.previous_tick(at) for at in moments] == [daily.previous_tick(at) for at in moments]


def test_cron_times_the_clocks_skip_run_once_at_the_end_of_the_gap():
    # 02:00, 02:20 and 02:40 do not exist on 2026-03-29: one tick at 03:00 CEST.
    schedule = entry(cron="*/20 2 * * *", timezone=PARIS)
    assert ticks(schedule, utc(2026, 3, 28, 12), 2) == [utc(2026, 3, 29, 1, 0), utc(2026, 3, 30, 0, 0)]


# -- words and definitions -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("trigger", "zone", "words"),
    [
        ({"every": 1}, PARIS, "every second"),
        ({"every": 30}, PARIS, "every 30 seconds"),
        ({"every": 90}, "UTC", "every 90 seconds"),
        ({"every": "5m"}, "UTC", "every 5 minutes"),
        ({"every": 3600}, "UTC", "every hour"),
        ({"every": "2h"}, "UTC", "every 2 hours"),
        ({"hourly": 15}, "UTC", "hourly at :15"),
        ({"hourly": True}, PARIS, "hourly at :00 (Europe/Paris)"),
        ({"daily": "3:00"}, "UTC", "daily at 03:00"),
        ({"daily": "03:00"}, PARIS, "daily at 03:00 (Europe/Paris)"),
        ({"weekly": "MON 09:00"}, "UTC", "weekly on Monday at 09:00"),
        ({"monthly": "1 03:00"}, "UTC", "monthly on day 1 at 03:00"),
        ({"cron": "0 3 * * *"}, "UTC", "cron 0 3 * * *"),
        ({"cron": "0 3 * * *"}, PARIS, "cron 0 3 * * * (Europe/Paris)"),
    ],
)
def test_describe(trigger, zone, words):
    assert entry(**trigger, timezone=zone).describe() == words


def test_a_definition_is_json_and_reads_back_to_the_same_entry():
    job_entry = entry(cron="0 3 * * *", kwargs={"action": "ok"}, queue="other", priority=3, missed="catch_up_once")
    handler_entry = parse_entry("ping", {"job": "url", "payload": {"url": "https://example.com"}, "every": "5m"})
    for schedule in (job_entry, handler_entry):
        definition = json.loads(json.dumps(schedule.as_definition()))
        assert parse_entry(schedule.name, definition) == schedule
    assert job_entry.as_definition() == {
        "job": JOB,
        "args": [],
        "kwargs": {"action": "ok"},
        "cron": "0 3 * * *",
        "timezone": "UTC",
        "queue": "other",
        "backend": None,
        "priority": 3,
        "enabled": True,
        "missed": "catch_up_once",
    }
    assert handler_entry.as_definition()["payload"] == {"url": "https://example.com"}
    assert "args" not in handler_entry.as_definition()


# -- validation ----------------------------------------------------------------------------------------


BAD_ENTRIES = [
    ({"every": 60}, "'job'"),  # no job
    ({"job": "", "every": 60}, "'job'"),
    ({"job": JOB, "args": "x", "every": 60}, "'args'"),
    ({"job": JOB, "args": [object()], "every": 60}, "'args'"),
    ({"job": JOB, "kwargs": [], "every": 60}, "'kwargs'"),
    ({"job": JOB, "kwargs": {1: "x"}, "every": 60}, "'kwargs'"),
    ({"job": "url", "payload": {"when": datetime(2026, 1, 1, tzinfo=UTC)}, "every": 60}, "'payload'"),
    ({"job": "url", "payload": {}, "args": [], "every": 60}, "'payload'"),
    ({"job": "url", "payload": ["a", "list"], "every": 60}, "'payload'"),
    ({"job": JOB}, "trigger"),
    ({"job": JOB, "every": 60, "daily": "03:00"}, "'every', 'daily'"),
    ({"job": JOB, "crn": "0 3 * * *"}, "did you mean 'cron'?"),
    ({"job": JOB, "cron": "0 3 * * * *"}, "'cron'"),  # six fields: seconds are for 'every'
    ({"job": JOB, "cron": "61 * * * *"}, "'cron'"),
    ({"job": JOB, "cron": "0 0 30 2 *"}, "'cron'"),  # 30 February never comes
    ({"job": JOB, "cron": "R 3 * * *"}, "'cron'"),  # random: each scheduler would pick its own minute
    ({"job": JOB, "cron": 3}, "'cron'"),
    ({"job": JOB, "every": 0}, "'every'"),
    ({"job": JOB, "every": 0.5}, "'every'"),
    ({"job": JOB, "every": True}, "'every'"),
    ({"job": JOB, "every": "5x"}, "'every'"),
    ({"job": JOB, "hourly": 60}, "'hourly'"),
    ({"job": JOB, "hourly": False}, "'hourly'"),
    ({"job": JOB, "daily": "24:00"}, "'daily'"),
    ({"job": JOB, "daily": "3pm"}, "'daily'"),
    ({"job": JOB, "weekly": "funday 09:00"}, "'weekly'"),
    ({"job": JOB, "weekly": "mon"}, "'weekly'"),
    ({"job": JOB, "monthly": "32 03:00"}, "'monthly'"),
    ({"job": JOB, "monthly": "0 03:00"}, "'monthly'"),
    ({"job": JOB, "every": 60, "timezone": "Europe/Pariss"}, "did you mean 'Europe/Paris'?"),
    ({"job": JOB, "every": 60, "timezone": 1}, "'timezone'"),
    ({"job": JOB, "every": 60, "queue": "emials"}, "did you mean 'emails'?"),
    ({"job": JOB, "every": 60, "backend": "nope"}, "'backend'"),
    ({"job": JOB, "every": 60, "priority": "high"}, "'priority'"),
    ({"job": JOB, "every": 60, "priority": True}, "'priority'"),
    ({"job": JOB, "every": 60, "enabled": "yes"}, "'enabled'"),
    ({"job": JOB, "every": 60, "missed": "always"}, "'missed'"),
    ("0 3 * * *", "must be a dict"),
]


@pytest.mark.parametrize(("raw", "fragment"), BAD_ENTRIES, ids=[str(raw) for raw, _ in BAD_ENTRIES])
def test_a_bad_entry_names_itself_and_the_key(raw, fragment):
    with pytest.raises(ScheduleError) as info:
        parse_entry("nightly", raw)
    message = str(info.value)
    assert message.startswith("SCHEDULE['nightly']") and fragment in message, message


@pytest.mark.parametrize("name", ["", 3, "x" * 201])
def test_an_entry_name_must_be_a_short_string(name):
    with pytest.raises(ScheduleError, match="SCHEDULE key"):
        parse_entry(name, {"job": JOB, "every": 60})


def test_a_cron_entry_without_croniter_says_which_extra_installs_it(monkeypatch):
    def missing() -> None:
        raise ImportError("No module named 'croniter'")

    monkeypatch.setattr(schedules, "_import_croniter", missing)
    with pytest.raises(ScheduleError, match=r"SCHEDULE\['nightly'\]\['cron'\] needs croniter: ") as info:
        entry(cron="0 3 * * *")
    assert "pip install 'django-reliable-jobs[cron]'" in str(info.value)
    # The other calendar triggers need no croniter.
    assert entry(daily="03:00").next_tick(utc(2026, 5, 4)) == utc(2026, 5, 4, 3, 0)


# -- the whole setting ---------------------------------------------------------------------------------


def test_errors_names_each_bad_entry_of_the_setting():
    schedule = {
        "good": {"job": JOB, "kwargs": {"action": "ok"}, "cron": "0 3 * * *", "timezone": PARIS, "queue": "other"},
        "handler": {"job": "command", "payload": {"name": "check"}, "every": "5m"},
        "typo": {"job": "tests.testapp.jobs.scriptd", "every": 60},
        "bad-cron": {"job": JOB, "cron": "0 3 * *"},
        "payload-for-a-job": {"job": JOB, "payload": {"a": 1}, "daily": "03:00"},
        "args-for-a-handler": {"job": "command", "args": ["check"], "daily": "03:00"},
        "args-that-do-not-fit": {"job": "tests.api_support.bare_job", "kwargs": {"y": 1}, "daily": "03:00"},
        "removed-handler": {"job": "shell", "payload": {}, "daily": "03:00"},
        "nothing-close": {"job": "zzz", "every": 60},
    }
    registry.autodiscover()  # as a worker does: the jobs modules register their @job functions
    with jobs_settings(SCHEDULE=schedule, HANDLERS={"shell": None}):
        problems = errors()
    assert [problem.split("]")[0] for problem in problems] == [f"SCHEDULE[{name!r}" for name in list(schedule)[2:]], (
        problems
    )
    typo, _, payload_for_a_job, args_for_a_handler, do_not_fit, removed, nothing_close = problems
    assert "unknown job 'tests.testapp.jobs.scriptd' (did you mean 'tests.testapp.jobs.scripted'?)" in typo
    assert "'payload'" in payload_for_a_job and "takes 'args'/'kwargs'" in payload_for_a_job
    assert "takes 'payload'" in args_for_a_handler
    assert "bare_job()" in do_not_fit and "'x'" in do_not_fit
    assert "unknown job 'shell'" in removed
    assert "register it with @job" in nothing_close


def test_entries_parses_the_setting_and_stops_at_a_bad_entry():
    good = {"job": JOB, "every": 60}
    with (
        jobs_settings(SCHEDULE={"a": good, "b": {**good, "daily": "03:00"}}),
        pytest.raises(ScheduleError, match=r"SCHEDULE\['b'\] needs exactly one trigger"),
    ):
        entries()
    with jobs_settings(SCHEDULE={"a": good, "c": {**good, "every": "1h"}}):
        assert entries() == {"a": parse_entry("a", good), "c": parse_entry("c", {**good, "every": 3600})}
    with jobs_settings(SCHEDULE=[good]):
        [problem] = errors()
        assert problem.startswith("SCHEDULE must be a dict")
