"""The database backend through Django's connection pool on PostgreSQL (``OPTIONS["pool"]``),
in one process: each thread that queries takes its own connection from the pool and keeps it
until it closes it. (The conformance suite runs through the pool too: tests/backend_params.py
``PG_DJANGO_POOL``; forked worker processes: tests/processes/test_connection_pool.py.)"""

from __future__ import annotations

import pytest
from django.conf import settings
from django.db import connections
from django.test import override_settings

from django_jobs.worker import QueueWorker
from tests.backend_params import ALL_DATABASES
from tests.testapp.jobs import scripted

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(databases=ALL_DATABASES, transaction=True),
    pytest.mark.usefixtures("pg_pool_backend"),
]


def test_a_worker_run_hands_its_heartbeats_connection_back_to_the_pool():
    """The heartbeat thread ends with the run: its connection goes back to the pool. Kept, every
    run took one of the pool's four for good, and the heartbeat of the fifth waited for one
    while its job's lease expired."""
    pool = connections["postgres_pool"].pool  # a new one: closed after each test
    with override_settings(JOBS={**settings.JOBS, "LEASE_TIMEOUT": 0.3}):  # a beat every 0.1 s
        for run in range(6):
            job_id = scripted.using(backend="pg_pool").dispatch(action="sleep", seconds=0.35, db="postgres")
            results = []
            QueueWorker("pg_pool", prefetch=1).run(max_jobs=1, on_result=results.append, reap=False)
            assert [(r.status, r.job_id) for r in results] == [("acked", job_id)], f"run {run + 1}"
            stats = pool.get_stats()
            assert stats["pool_size"] - stats["pool_available"] <= 1, stats  # the main thread's, if any
