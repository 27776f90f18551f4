"""Limits across real ``manage.py jobs_work`` processes: a concurrency limit is never exceeded by
four workers together, and a rate holds in every window of its period.

The handler is ``tests.testapp.jobs.timed``: each run appends its start and end times (and its
pid) to a file in one ``O_APPEND`` write. The limits reach the workers through
``JOBS_TEST_LIMITS``. Two workers claim one job at a time (``--prefetch 1``); two claim batches
(the default), so jobs claimed ahead wait for their limits too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from django_jobs import Jobs
from tests.procs import processes, wait_until, worker_env
from tests.testapp.jobs import timed

PG = "postgres"
HANDLER_KEY = "handler:tests.testapp.jobs.timed"
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(databases=["default", PG], transaction=True),
    pytest.mark.usefixtures("postgres_up"),
]


@pytest.fixture(params=["pg", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "redis":
        request.getfixturevalue("redis_up")
    return str(request.param)


def ran(path: Path) -> int:
    """How many runs the jobs recorded in ``path``."""
    return len(path.read_text().splitlines()) if path.exists() else 0


def run_limited(
    backend: str, table: dict[str, dict[str, object]], path: Path, count: int, seconds: float
) -> list[tuple[float, float]]:
    """Four workers under ``table`` run ``count`` timed jobs; their (start, end) times."""
    env = worker_env(JOBS_TEST_LIMITS=json.dumps(table))
    with processes() as procs:
        workers = [procs.worker("--backend", backend, "--prefetch", "1", env=env) for _ in range(2)]
        workers += [procs.worker("--backend", backend, env=env) for _ in range(2)]
        for _ in range(count):
            timed.using(backend=backend).dispatch(str(path), seconds)
        queue = Jobs.backend(backend)  # a completed Redis job leaves no row: count the runs, then the queue
        wait_until(lambda: ran(path) == count and queue.size("default") == 0, 90, f"{count} limited jobs", interval=0.2)
        for worker in workers:
            assert worker.stop() == 0, worker.output()
    deferred = [line for worker in workers for line in worker.job_lines("deferred")]
    assert deferred, "the limit held no job back"
    assert all(f"limit {HANDLER_KEY} " in line for line in deferred), deferred
    runs = [tuple(map(float, line.split()[:2])) for line in path.read_text().splitlines()]
    assert len(runs) == count
    return sorted(runs)  # type: ignore[arg-type]


def test_four_workers_never_run_more_jobs_at_once_than_the_concurrency_limit(backend, tmp_path):
    runs = run_limited(backend, {HANDLER_KEY: {"concurrency": 2}}, tmp_path / "runs", count=16, seconds=0.3)

    events = sorted([(start, 1) for start, _ in runs] + [(end, -1) for _, end in runs])  # an end before a start
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    assert 0 < peak <= 2


def test_a_rate_holds_in_every_window_of_its_period(backend, tmp_path):
    """5 starts per 2 s. A start is counted when it is granted, or at the time reserved for it;
    the job starts when a worker picks it up, a little later (the pick-up slack, documented:
    up to the worker's poll interval plus a fetch). So any window of the period less that slack
    holds at most 5 starts, and the 20 jobs take at least three periods."""
    count, period, slack = 5, 2.0, 0.5
    runs = run_limited(backend, {HANDLER_KEY: {"rate": "5/2s"}}, tmp_path / "runs", count=20, seconds=0.0)

    starts = [start for start, _ in runs]
    for first in starts:
        assert sum(first <= start < first + period - slack for start in starts) <= count, starts
    assert starts[-1] - starts[0] >= 3 * period - slack, starts
