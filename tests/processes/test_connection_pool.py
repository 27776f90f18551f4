"""The database backend through Django's connection pool on PostgreSQL (``OPTIONS["pool"]``,
psycopg_pool), with real ``jobs_work`` processes.

A supervisor connects before it forks (its start-up checks, its reaping at start, the
recovery of a dead process's jobs). With a pool, closing a connection only hands it back to
the pool, which a forked process inherits with the same sockets: two processes would then
write to one server session and read each other's replies. The supervisor closes its pools
before each fork, so every worker process opens its own.
"""

from __future__ import annotations

import re

import pytest

from django_jobs.models import Job
from tests.procs import processes, worker_env
from tests.testapp.jobs import scripted
from tests.testapp.models import SideEffect

PG = "postgres"
JOBS = 300
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.django_db(databases=["default", PG, "postgres_pool"], transaction=True),
    pytest.mark.usefixtures("pg_pool_backend"),
]
STOPPED = re.compile(r"django-jobs worker stopped: process \d+, (\d+) deliveries")


def test_forked_worker_processes_never_share_a_pooled_connection():
    """Before the fix, one of two processes wrote its presence on a session the other was in the
    middle of (``can't change 'autocommit' now: connection in transaction status INTRANS``) and
    delivered nothing for 20 s."""
    ids = [
        scripted.using(backend="pg_pool").dispatch(action="sleep", seconds=0.01, key=f"pooled-{i}", db=PG)
        for i in range(JOBS)
    ]
    with processes() as procs:
        code, worker = procs.run(
            "jobs_work", "--backend", "pg_pool", "--concurrency", "2", "--max", str(JOBS), env=worker_env(), timeout=90
        )

    assert code == 0, worker.output()
    assert not worker.err, worker.output()  # no error, no warning (a thread waiting for a connection)
    delivered = [int(found.group(1)) for line in worker.out if (found := STOPPED.search(line))]
    assert len(delivered) == 2 and min(delivered) > 0 and sum(delivered) == JOBS, worker.output()
    jobs = Job.objects.using(PG).filter(pk__in=ids)
    assert sorted(set(jobs.values_list("status", "attempts"))) == [("completed", 1)]
    runs = SideEffect.objects.using(PG).filter(key__startswith="pooled-")
    assert runs.count() == runs.values("key").distinct().count() == JOBS, "every job ran once"
