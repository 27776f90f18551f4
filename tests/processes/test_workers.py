"""Worker presence from real processes: ``manage.py jobs_work --concurrency 2`` on the PostgreSQL
backend. Each forked worker process writes its ``Worker`` row and its ``Throughput`` counts (in
``default``, where the router sends them) every ``Worker.BEAT``; a clean stop marks the row
stopped, a SIGKILL leaves it to go stale.

Every wait polls with a deadline; beats come every 5 s, so deadlines allow a few of them.
"""

from __future__ import annotations

import os
import signal
from datetime import datetime

import pytest
from django.db.models import Sum

from django_jobs.models import Job, Throughput, Worker
from tests.procs import pid_alive, processes, wait_until, worker_env
from tests.testapp.jobs import scripted

PG = "postgres"
BEAT = Worker.BEAT.total_seconds()
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.django_db(databases=["default", PG], transaction=True),
    pytest.mark.usefixtures("postgres_up"),
]


def children(pid: int) -> set[int]:
    """The processes ``pid`` forked (Linux)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(child) for child in f.read().split()}


def rows(pids: set[int]) -> dict[int, Worker]:
    return {worker.pid: worker for worker in Worker.objects.filter(pid__in=pids)}


def last_seen(pid: int) -> datetime:
    seen: datetime = Worker.objects.get(pid=pid).last_seen
    return seen


def test_worker_processes_report_their_job_counts_clean_stops_and_deaths():
    with processes() as procs:
        supervisor = procs.worker("--backend", "pg", "--concurrency", "2", "--prefetch", "1", env=worker_env())
        pids = wait_until(lambda: len(children(supervisor.pid)) == 2 and children(supervisor.pid), 10, "2 processes")
        first = wait_until(lambda: len(found := rows(pids)) == 2 and found, 3 * BEAT, "a Worker row per process")
        for row in first.values():
            assert (row.backend, row.queues, row.stopped_at, row.state()) == ("pg", ["default"], None, "running")
        assert len({row.id for row in first.values()}) == 2

        # The process running the slow job shows it while it runs (a beat falls within 7 s).
        job_id = scripted.using(backend="pg").dispatch(action="sleep", seconds=7, db=PG)
        runner = wait_until(
            lambda: next((pid for pid, row in rows(pids).items() if row.current_job == job_id), None),
            3 * BEAT,
            "the slow job as a worker's current job",
        )
        assert rows(pids)[runner].current_job_started is not None
        wait_until(lambda: Job.objects.using(PG).get(pk=job_id).status == "completed", 20, "the job to complete")
        counted = Throughput.objects.filter(backend="pg", queue="default", worker__in=[r.id for r in first.values()])
        wait_until(lambda: counted.aggregate(n=Sum("completed"))["n"] == 1, 3 * BEAT, "its completion counted")
        wait_until(lambda: rows({runner})[runner].current_job == "", 3 * BEAT, "the job in hand cleared")

        # SIGKILL one process: its row is never written again, while the other's advances.
        [victim] = pids - {runner}
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: not pid_alive(victim), 10, f"process {victim} to die")
        frozen = last_seen(victim)
        for _ in range(2):
            before = last_seen(runner)
            wait_until(lambda before=before: last_seen(runner) > before, 3 * BEAT, "a beat of the surviving process")
        killed = rows({victim})[victim]
        assert (killed.last_seen, killed.stopped_at) == (frozen, None)
        # The supervisor replaced it; the new process has a row of its own.
        replacement = wait_until(lambda: children(supervisor.pid) - pids, 10, "a replacement process")
        pids |= replacement
        wait_until(lambda: len(rows(pids)) == 3, 3 * BEAT, "the replacement's row")

        assert supervisor.stop(signal.SIGTERM) == 0, supervisor.output()

    final = rows(pids)
    assert final[victim].stopped_at is None and final[victim].last_seen == frozen
    stopped = {pid for pid, row in final.items() if row.stopped_at is not None}
    assert stopped == pids - {victim}, supervisor.output()
    assert all(final[pid].state() == "stopped" for pid in stopped)
    assert final[runner].processed == 1
