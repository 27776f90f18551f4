"""Red-team regressions: promises of the docs attacked from outside, one test per break found.

Each test names the promise it checks (the page and its words) and the attack that broke it.
"""

from __future__ import annotations

import pytest

from django_jobs.models import Job, JobStatus
from tests.procs import processes, wait_until, worker_env
from tests.testapp.jobs import scripted

PROCESS_DB = pytest.mark.django_db(databases=["default"], transaction=True)
FINAL = ("retrying", "failed", "completed")


@pytest.mark.slow
@PROCESS_DB
def test_redteam_redis_fast_failure_then_worker_death_never_runs_the_job_uncounted(redis_up):
    """docs/reliability.md: "A job runs at most `max_retries + 1` times, counting runs lost to
    crashes"; docs/leases.md: the supervisor recovers a dead process's claims, and only a worker
    that freezes or dies *with its whole process group* within 50 ms of a start has that job
    handed back uncounted.

    Attack: job A fails in well under 50 ms (its requeue waits for the batch's next write), and
    the very next job B kills its worker process (``os._exit``). The supervisor lives. A's failed
    run must count: with ``max_retries=1``, A runs at most twice."""
    pairs = [
        (
            scripted.using(backend="redis", max_retries=1).dispatch(action="raise"),
            scripted.using(backend="redis", max_retries=0).dispatch(action="exit"),
        )
        for _ in range(3)
    ]
    with processes() as procs:
        worker = procs.worker("--backend", "redis", env=worker_env())

        def settled() -> bool:
            rows = Job.objects.filter(id__in=[a for a, _ in pairs] + [b for _, b in pairs])
            return rows.filter(status=JobStatus.FAILED).count() == 2 * len(pairs)

        wait_until(settled, 60, "every job to end failed")
        worker.stop()
    for a, _ in pairs:
        runs = [line for line in worker.job_lines() if a in line and line.split()[0] in FINAL]
        assert len(runs) <= 2, f"job {a} (max_retries=1) ran {len(runs)} times\n{worker.output()}"
        assert Job.objects.get(id=a).attempts == 2
