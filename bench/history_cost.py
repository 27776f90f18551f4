"""What the attempt history and kept results cost per job, on the database backend.

Three kinds of job, drained in one process by a real worker loop (``QueueWorker.run``):

- ``plain``: succeeds, keeps no result (the default): no history row is written;
- ``keep_result``: succeeds and keeps its return value (what ``django.tasks`` results use);
- ``fails_once``: fails its first attempt, then succeeds (one history row for the failure);
- ``fails_once_no_history``: the same with ``HISTORY_LIMIT = 0`` (what the history costs it).

For each it prints the SQL statements per job (exact, from Django's query log) and the drain
rate relative to ``plain`` (one run: compare ratios, not absolute rates, on a shared machine).

    python bench/history_cost.py --db postgres --jobs 2000
    python bench/history_cost.py --db sqlite --jobs 2000
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("BENCH_SYSTEM", "jobs")


def configure(db: str, workdir: str, name: str = "bench_history", **jobs: object) -> None:
    """Django for a benchmark: PostgreSQL database ``name`` or SQLite ``<workdir>/<name>.sqlite3``;
    ``jobs``: more ``JOBS`` settings."""
    import django
    from django.conf import settings

    if db == "postgres":
        database = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "HOST": "127.0.0.1",
            "USER": "postgres",
            "CONN_MAX_AGE": None,
        }
    else:
        database = {"ENGINE": "django.db.backends.sqlite3", "NAME": os.path.join(workdir, f"{name}.sqlite3")}
    settings.configure(
        SECRET_KEY="bench-only-not-a-secret-0123456789abcdefghijklmnopqrstuvwxyz",
        USE_TZ=True,
        INSTALLED_APPS=["django_jobs"],
        DATABASES={"default": database},
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        JOBS={"IMPORTS": ["bench.history_cost_jobs"], **jobs},
    )
    django.setup()


def recreate_postgres(name: str = "bench_history") -> None:
    import psycopg

    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name}")
        conn.execute(f"CREATE DATABASE {name}")


def drain(kind: str, jobs: int) -> tuple[float, float]:
    """Dispatch ``jobs`` of ``kind``, drain them; return (jobs/s, SQL statements per job)."""
    from django.db import connection

    from bench.history_cost_jobs import flaky, noop
    from django_jobs import Jobs
    from django_jobs.models import Job, JobAttempt
    from django_jobs.worker import QueueWorker

    Job.objects.all().delete()
    JobAttempt.objects.all().delete()
    if kind == "plain":
        builders = [noop.builder(i) for i in range(jobs)]
    elif kind == "keep_result":
        builders = [noop.using(keep_result=True).builder(i) for i in range(jobs)]
    else:  # fails_once, with or without the history
        builders = [flaky.using(max_retries=1).builder(i + (jobs if "no_history" in kind else 0)) for i in range(jobs)]
    Jobs.bulk(builders)
    worker = QueueWorker(queues=["default"])
    statements = 0

    def count(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        nonlocal statements
        statements += 1
        return execute(sql, params, many, context)

    start = time.perf_counter()
    with connection.execute_wrapper(count):
        worker.run(once=False, max_jobs=jobs * (2 if "fails" in kind else 1), sleep=0.01, reap=False)
    elapsed = time.perf_counter() - start
    assert Job.objects.filter(status="completed").count() == jobs, "every job must complete"
    return jobs / elapsed, statements / jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", choices=["postgres", "sqlite"], default="sqlite")
    parser.add_argument("--jobs", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        if args.db == "postgres":
            recreate_postgres()
        configure(args.db, workdir, RETRY_BACKOFF_STRATEGY="none")
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        from django.conf import settings
        from django.test import override_settings

        results = {kind: drain(kind, args.jobs) for kind in ("plain", "keep_result", "fails_once")}
        with override_settings(JOBS={**settings.JOBS, "HISTORY_LIMIT": 0}):
            results["fails_once_no_history"] = drain("fails_once_no_history", args.jobs)
    base = results["plain"][0]
    print(f"{args.db}, {args.jobs} jobs per kind, one worker process")
    print(f"{'kind':<22} {'statements/job':>15} {'drain vs plain':>15}")
    for kind, (rate, statements) in results.items():
        print(f"{kind:<22} {statements:>15.2f} {rate / base:>14.2f}x")


if __name__ == "__main__":
    main()
