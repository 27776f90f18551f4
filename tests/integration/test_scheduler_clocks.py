"""Several schedulers on PostgreSQL, each reading its own clock: clocks that disagree, a clock
stepped back, and the tick of a disabled or removed entry left unsent by a broker outage.

The test keeps a "real" time that it advances in steps; each scheduler reads it through its own
offset, and every running scheduler makes a pass at every step. Nothing sleeps.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

import pytest
import redis

from django_jobs.backends.redis import RedisBackend
from django_jobs.models import Job, Schedule, ScheduleTick
from django_jobs.scheduler import REDISPATCH_AFTER, Scheduler, idempotency_key
from django_jobs.schedules import Entry, parse_entry

PG = "postgres"
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.usefixtures("postgres_up", "schedules_on_postgres", "clean_state"),
]

T0 = datetime(2030, 1, 1, 3, 10, tzinfo=UTC)
STEP = timedelta(seconds=0.5)


@pytest.fixture
def schedules_on_postgres(settings):
    settings.DATABASE_ROUTERS = ["tests.routers.SchedulesOnPostgres"]


@dataclass
class Clock:
    """A scheduler's clock: the test's real time, ``offset`` seconds off (set it to step the clock)."""

    time: Time
    offset: float

    def __call__(self) -> datetime:
        return self.time.now + timedelta(seconds=self.offset)


class Time:
    """The test's real time; ``clock(offset)`` reads it ``offset`` seconds off, as a scheduler's
    clock does."""

    def __init__(self, start: datetime) -> None:
        self.now = start

    def clock(self, offset: float) -> Clock:
        return Clock(self, offset)

    def steps(self, seconds: float, step: timedelta = STEP) -> Iterator[datetime]:
        """Advance by ``seconds``, one ``step`` at a time (yielding the new real time)."""
        for _ in range(round(seconds / step.total_seconds())):
            self.now += step
            yield self.now

    def passes(self, seconds: float, schedulers: list[Scheduler], step: timedelta = STEP) -> None:
        """Advance by ``seconds``; every scheduler makes a pass at every step."""
        for _ in self.steps(seconds, step):
            for scheduler in schedulers:
                scheduler.run_pass()


def every_second(name: str) -> Entry:
    return parse_entry(name, {"job": "tests.testapp.jobs.noop", "every": 1, "backend": "pg"})


def jobs_by_tick(name: str) -> Counter[str]:
    keys = Job.objects.using(PG).filter(idempotency_key__startswith=f"schedule:{name}:")
    return Counter(keys.values_list("idempotency_key", flat=True))


# -- clocks that disagree ------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """A scheduler whose clock is ``offset`` seconds off the real time, running from ``start`` to
    ``stop`` (real seconds after T0). A scheduler that starts again is a new ``Run``."""

    offset: float
    start: float
    stop: float


SKEWED = {
    # Two clocks 5 s apart: the one ahead joins the one behind, the one behind leaves, then joins
    # the one ahead (a restart).
    "ahead-joins-behind": [Run(-2, 0, 20), Run(3, 10, 45), Run(-2, 30, 45)],
    # Three: the one furthest ahead joins last, and the first one leaves.
    "three-schedulers": [Run(1, 0, 25), Run(-2, 8, 45), Run(3, 16, 45)],
}


@pytest.mark.django_db(databases=["default", PG])
@pytest.mark.parametrize("runs", SKEWED.values(), ids=SKEWED.keys())
def test_schedulers_whose_clocks_disagree_dispatch_every_tick_exactly_once(runs):
    entry = every_second("skewed")
    time = Time(T0)
    running: dict[Run, Scheduler] = {}
    end = max(run.stop for run in runs)
    for now in time.steps(end):
        elapsed = (now - T0).total_seconds()
        for run in runs:
            if run.start < elapsed <= run.stop and run not in running:
                running[run] = Scheduler({entry.name: entry}, clock=time.clock(run.offset))
            elif elapsed > run.stop:
                running.pop(run, None)
        for scheduler in running.values():
            scheduler.run_pass()

    created = Schedule.objects.using(PG).get(name=entry.name).created_at
    last = entry.previous_tick(time.now + timedelta(seconds=max(run.offset for run in runs if run.stop == end)))
    window = [entry.next_tick(created)]
    while window[-1] < last:
        window.append(entry.next_tick(window[-1]))
    assert len(window) > 40
    expected = Counter({idempotency_key(entry.name, tick): 1 for tick in window})
    found = jobs_by_tick(entry.name)
    assert found == expected, f"never dispatched: {sorted(expected - found)}; more than once: {+(found - expected)}"
    ticks = ScheduleTick.objects.using(PG).filter(schedule_id=entry.name)
    assert sorted(ticks.values_list("tick", flat=True)) == window


# -- a tick left unsent, then its entry disabled or removed ----------------------------------------


def refuse(self, envelope):
    raise redis.ConnectionError("the broker is down")


@pytest.mark.django_db(databases=["default", PG], transaction=True)  # a broker's push runs at commit
@pytest.mark.parametrize("change", ["disabled", "removed"])
def test_a_tick_left_unsent_is_never_sent_once_its_entry_is_disabled_or_removed(
    change, redis_backend, monkeypatch, caplog
):
    hourly = parse_entry("hourly", {"job": "tests.testapp.jobs.noop", "every": 3600, "backend": "redis"})
    tick = hourly.next_tick(T0)
    time = Time(tick - timedelta(seconds=10))
    first = Scheduler({hourly.name: hourly}, clock=time.clock(0))
    first.run_pass()
    with monkeypatch.context() as broker_down:
        broker_down.setattr(RedisBackend, "enqueue", refuse)  # a tick sends one job
        time.now = tick
        assert first.run_pass() == []  # claimed; the push failed after the commit
    [row] = ScheduleTick.objects.using(PG).filter(schedule_id=hourly.name)
    assert (row.tick, row.dispatched_at) == (tick, None)

    # Every scheduler restarts with the entry disabled (or gone), clocks apart; the broker is back.
    after = {"disabled": {hourly.name: replace(hourly, enabled=False)}, "removed": {}}[change]
    schedulers = [Scheduler(after, clock=time.clock(offset)) for offset in (-2, 3)]
    with caplog.at_level(logging.WARNING, logger="django_jobs.scheduler"):
        time.passes(2 * REDISPATCH_AFTER.total_seconds(), schedulers, step=timedelta(seconds=5))
    assert redis_backend.size("default") == 0
    logged = [record for record in caplog.records if "abandoned" in record.getMessage()]

    # Enabled again: the tick left unsent stays unsent; the next one runs on time.
    schedulers = [Scheduler({hourly.name: hourly}, clock=time.clock(offset)) for offset in (-2, 3)]
    time.passes(30, schedulers, step=timedelta(seconds=5))
    assert redis_backend.size("default") == 0
    time.now = hourly.next_tick(tick) - timedelta(seconds=5)
    time.passes(10, schedulers, step=timedelta(seconds=5))
    assert redis_backend.size("default") == 1
    sent = ScheduleTick.objects.using(PG).filter(schedule_id=hourly.name).order_by("tick")
    assert [(t.tick, t.dispatched_at is not None) for t in sent] == [(tick, False), (hourly.next_tick(tick), True)]
    assert sent[0].abandoned_at is not None
    [abandoned] = logged  # by one of the two
    assert (abandoned.levelno, abandoned.job_id, abandoned.outcome) == (logging.WARNING, row.job_id, "abandoned")


# -- a clock stepped back ------------------------------------------------------------------------


@pytest.mark.django_db(databases=["default", PG])
def test_a_clock_stepped_back_runs_no_tick_twice_and_none_of_a_disabled_spell():
    entry = every_second("stepped")
    time = Time(T0)
    clock = time.clock(0)
    time.passes(10, [Scheduler({entry.name: entry}, clock=clock)])
    time.passes(10, [Scheduler({entry.name: replace(entry, enabled=False)}, clock=clock)])
    scheduler = Scheduler({entry.name: entry}, clock=clock)
    time.passes(10, [scheduler])  # from 03:10:20, the latest tick missed while disabled (skip: recent)
    clock.offset = -15  # NTP steps the clock back into the disabled spell
    time.passes(20, [scheduler])

    second = timedelta(seconds=1)
    expected = [T0 + s * second for s in (*range(1, 11), *range(20, 36))]
    assert jobs_by_tick(entry.name) == Counter({idempotency_key(entry.name, tick): 1 for tick in expected})
