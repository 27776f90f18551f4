"""Real scheduler processes on PostgreSQL: two ``jobs_schedule`` racing over the same ticks, one
stopped mid-run, and ``jobs_work --with-scheduler`` dispatching and running a job end to end.

The subprocesses run ``manage.py`` through a launcher that sets ``JOBS["SCHEDULE"]`` from the
environment and routes the schedule tables to PostgreSQL (the test settings keep them in the
SQLite ``default``), so the claims race on a server that takes concurrent writers.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from collections import defaultdict
from itertools import pairwise

import pytest
from django.db.models import Max, Min
from django.utils import timezone

from django_jobs.models import Job, Schedule, ScheduleTick
from django_jobs.scheduler import idempotency_key
from tests.procs import Proc, Procs, processes, wait_until, worker_env
from tests.testapp.models import SideEffect

PG = "postgres"
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.django_db(databases=["default", PG], transaction=True),
    pytest.mark.usefixtures("postgres_up"),
]

LAUNCHER = """
import json, os, sys

from tests import settings

settings.JOBS["SCHEDULE"] = json.loads(os.environ["JOBS_TEST_SCHEDULE"])
settings.DATABASE_ROUTERS = ["tests.routers.SchedulesOnPostgres"]

from django.core.management import execute_from_command_line

execute_from_command_line(["manage.py", *sys.argv[1:]])
"""
START_LINE, STOP_LINE = "django-jobs scheduler started", "django-jobs scheduler stopped"


def start(procs: Procs, schedule: dict[str, dict[str, object]], *args: str) -> Proc:
    """``manage.py ARGS`` with ``JOBS["SCHEDULE"] = schedule`` (killed when ``procs`` ends)."""
    env = worker_env(JOBS_TEST_SCHEDULE=json.dumps(schedule))
    proc = Proc([sys.executable, "-c", LAUNCHER, *args], env)
    procs.started.append(proc)
    proc.wait_for_line(lambda line: line.startswith(START_LINE), 30, "the scheduler's start line")
    return proc


def ticks_by_entry(names: list[str]) -> dict[str, list[ScheduleTick]]:
    found = defaultdict(list)
    for row in ScheduleTick.objects.using(PG).filter(schedule_id__in=names).order_by("tick"):
        found[row.schedule_id].append(row)
    return found


def spans(names: list[str]) -> dict[str, tuple[object, object]]:
    rows = ScheduleTick.objects.using(PG).filter(schedule_id__in=names).values("schedule_id")
    return {r["schedule_id"]: (r["first"], r["last"]) for r in rows.annotate(first=Min("tick"), last=Max("tick"))}


def ticked_for(names: list[str], seconds: float) -> bool:
    found = spans(names)
    return len(found) == len(names) and all((last - first).total_seconds() >= seconds for first, last in found.values())


def ticked_since(names: list[str], since: object, count: int) -> bool:
    """Every entry has ``count`` ticks after ``since``."""
    rows = ScheduleTick.objects.using(PG).filter(schedule_id__in=names, tick__gt=since)
    per_entry = defaultdict(int)
    for name in rows.values_list("schedule_id", flat=True):
        per_entry[name] += 1
    return len(per_entry) == len(names) and min(per_entry.values()) >= count


def test_two_schedulers_race_over_every_tick_and_each_runs_once_then_one_carries_on_alone():
    names = [f"race-{uuid.uuid4().hex[:8]}-{i}" for i in range(5)]
    schedule = {name: {"job": "tests.testapp.jobs.noop", "every": 1, "backend": "pg"} for name in names}
    with processes() as procs:
        one = start(procs, schedule, "jobs_schedule")
        two = start(procs, schedule, "jobs_schedule")
        wait_until(lambda: ticked_for(names, 8), 30, "8 seconds of ticks of every entry", interval=0.2)

        assert one.stop(signal.SIGTERM) == 0, one.output()
        stopped = timezone.now()
        assert one.out[-1].startswith(STOP_LINE), one.output()
        wait_until(lambda: ticked_since(names, stopped, 3), 15, "3 more ticks from the scheduler left", interval=0.2)
        assert two.alive(), two.output()
        assert two.stop(signal.SIGTERM) == 0, two.output()

    ticks = ticks_by_entry(names)
    created = dict(Schedule.objects.using(PG).filter(name__in=names).values_list("name", "created_at"))
    jobs = {job.pk: job for job in Job.objects.using(PG).filter(pk__in=[t.job_id for ts in ticks.values() for t in ts])}
    for name in names:
        rows = ticks[name]
        # One row per tick (the unique claim), one job per row, under the tick's key, on time.
        assert len({row.tick for row in rows}) == len(rows)
        assert all(row.dispatched_at is not None and row.job_id in jobs for row in rows)
        assert [jobs[row.job_id].idempotency_key for row in rows] == [idempotency_key(name, row.tick) for row in rows]
        # No tick missed: consecutive ticks one second apart, from the first to the last.
        steps = {(b.tick - a.tick).total_seconds() for a, b in pairwise(rows)}
        assert steps == {1.0}, f"{name}: gaps between ticks {sorted(steps)}"
        assert rows[0].tick > created[name]  # no tick from before the entry was first synced
    assert len(jobs) == sum(len(rows) for rows in ticks.values())
    assert Job.objects.using(PG).filter(idempotency_key__startswith="schedule:race-").count() == len(jobs)
    # Both schedulers dispatched some, and each dispatch was printed by the one that made it.
    printed = [line for proc in (one, two) for line in proc.out if line.startswith("scheduled ")]
    assert len(printed) == len(jobs)
    assert all(any(line.startswith("scheduled ") for line in proc.out) for proc in (one, two))


def test_jobs_work_with_scheduler_dispatches_and_runs_a_scheduled_job_then_stops_cleanly():
    key = f"sched-{uuid.uuid4().hex[:12]}"
    schedule = {
        "heartbeat": {
            "job": "tests.testapp.jobs.scripted",
            "kwargs": {"action": "ok", "key": key, "db": PG},
            "every": 1,
            "backend": "pg",
        }
    }
    with processes() as procs:
        worker = start(procs, schedule, "jobs_work", "--backend", "pg", "--with-scheduler", "--concurrency", "1")
        assert any(line.startswith("django-jobs worker started") for line in worker.out), worker.output()
        # The entries' lines follow the start line: on a loaded machine, maybe not read yet.
        worker.wait_for_line(lambda line: line.strip().startswith("heartbeat: every second"), 30, "the entry's line")
        [run] = wait_until(lambda: SideEffect.objects.using(PG).filter(key=key)[:1], 30, "a scheduled job's run")
        assert run.pid != worker.pid  # run by a forked worker process
        assert worker.stop(signal.SIGTERM) == 0, worker.output()
        deadline = time.monotonic() + 10
        while _group_alive(worker.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _group_alive(worker.pid), "a process of the pool outlived its supervisor"

    assert any(line.startswith(STOP_LINE) for line in worker.out), worker.output()
    assert any(line.startswith("django-jobs worker stopped") for line in worker.out), worker.output()
    assert not any("died with status" in line for line in worker.err), worker.output()
    dispatched = ScheduleTick.objects.using(PG).filter(schedule_id="heartbeat").values_list("job_id", flat=True)
    assert Job.objects.using(PG).filter(pk__in=list(dispatched), status="completed").exists()


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
