"""In-Django half of the benchmark: run as a subprocess by bench/run.py.

    python bench/driver.py dispatch --mode single|atomic|bulk --n N
    python bench/driver.py stats
    python bench/driver.py clear
    python bench/driver.py analyze
    python bench/driver.py probe --n K

The system under test and the database come from the environment (see
settings.py). Each command prints one JSON object on the last line of stdout.
Timings here exclude interpreter start, Django set-up and the first
connection: only the dispatch loop itself is timed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

HERE = Path(__file__).resolve().parent
for entry in (str(HERE), str(HERE.parent)):
    if entry not in sys.path:
        sys.path.append(entry)  # after PYTHONPATH, so run.py --ref can put an exported django_jobs first
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

import django

django.setup()

from django.db import connection, transaction
from django.db.models import Count, Max, Min

SYSTEM = os.environ.get("BENCH_SYSTEM", "jobs")


def model():
    if SYSTEM == "jobs":
        from django_jobs.models import Job

        return Job
    from django_tasks_db.models import DBTaskResult

    return DBTaskResult


# --- dispatch --------------------------------------------------------------


def dispatch_one_factory():
    import benchjobs

    if SYSTEM == "jobs":
        return benchjobs.noop_job.dispatch
    return benchjobs.noop_task.enqueue


def dispatch(mode: str, n: int) -> dict:
    import benchjobs

    connection.ensure_connection()
    if mode == "bulk":
        if SYSTEM != "jobs":
            return {"error": "django-tasks-db has no bulk enqueue"}
        from django_jobs import Jobs

        t0 = time.perf_counter()
        ids = Jobs.bulk([benchjobs.noop_job.builder() for _ in range(n)])
        elapsed = time.perf_counter() - t0
        return {"seconds": elapsed, "returned_ids": len(ids), "rows": model().objects.count()}

    one = dispatch_one_factory()
    if mode == "single":  # autocommit: one transaction per job, the common case
        t0 = time.perf_counter()
        for _ in range(n):
            one()
        elapsed = time.perf_counter() - t0
    elif mode == "atomic":  # every dispatch inside one transaction.atomic()
        t0 = time.perf_counter()
        with transaction.atomic():
            for _ in range(n):
                one()
        elapsed = time.perf_counter() - t0
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return {"seconds": elapsed, "rows": model().objects.count()}


# --- row statistics --------------------------------------------------------


def _iso(dt):
    return dt.isoformat() if dt is not None else None


def stats() -> dict:
    m = model()
    by_status = {row["status"]: row["c"] for row in m.objects.values("status").annotate(c=Count("pk"))}
    out: dict = {"total": sum(by_status.values()), "by_status": by_status}
    if SYSTEM == "jobs":
        agg = m.objects.aggregate(
            first_created=Min("created_at"),
            first_finished=Min("finished_at"),
            last_finished=Max("finished_at"),
        )
        done = by_status.get("completed", 0)
        first_start = None
    else:
        agg = m.objects.aggregate(
            first_created=Min("enqueued_at"),
            first_started=Min("started_at"),
            first_finished=Min("finished_at"),
            last_finished=Max("finished_at"),
        )
        done = by_status.get("SUCCESSFUL", 0)
        first_start = agg["first_started"]
    out["completed"] = done
    out["unfinished"] = out["total"] - done - by_status.get("failed", 0) - by_status.get("FAILED", 0)
    first_f, last_f = agg["first_finished"], agg["last_finished"]
    out["first_finished"] = _iso(first_f)
    out["last_finished"] = _iso(last_f)
    out["first_started"] = _iso(first_start)
    out["finished_span_seconds"] = (last_f - first_f).total_seconds() if first_f and last_f else None
    out["started_to_last_finished_seconds"] = (last_f - first_start).total_seconds() if first_start and last_f else None
    return out


def clear() -> dict:
    table = connection.ops.quote_name(model()._meta.db_table)
    with connection.cursor() as cur:
        if connection.vendor == "postgresql":
            cur.execute(f"TRUNCATE {table}")
        else:
            cur.execute(f"DELETE FROM {table}")
    return {"cleared": model()._meta.db_table}


def analyze() -> dict:
    """Give PostgreSQL's planner statistics, as autovacuum would in production."""
    if connection.vendor != "postgresql":
        return {"analyzed": False}
    with connection.cursor() as cur:
        cur.execute(f"ANALYZE {connection.ops.quote_name(model()._meta.db_table)}")
    return {"analyzed": True}


# --- probe: queries per job --------------------------------------------------


def probe(n: int) -> dict:
    """Count SQL statements per dispatched and per drained job, in-process.

    The worker loop runs in this process so that CaptureQueriesContext sees
    its queries: django-tasks-db's ``db_worker`` command through call_command;
    for django-jobs, ``jobs_work`` always forks its worker processes (even with
    --concurrency 1), so the probe runs the loop each forked process runs,
    ``QueueWorker.run(max_jobs=n)``, directly. Not timed.
    """
    from django.core.management import call_command
    from django.test.utils import CaptureQueriesContext

    clear()
    connection.ensure_connection()
    one = dispatch_one_factory()
    with CaptureQueriesContext(connection) as ctx:
        for _ in range(n):
            one()
    dispatch_q = len(ctx.captured_queries)
    dispatch_sample = [q["sql"][:160] for q in ctx.captured_queries[: min(len(ctx.captured_queries), 4)]]

    sink = io.StringIO()
    with CaptureQueriesContext(connection) as ctx, redirect_stdout(sink):
        if SYSTEM == "jobs":
            from django_jobs import registry
            from django_jobs.worker import QueueWorker

            registry.autodiscover()
            QueueWorker(None, ["default"]).run(max_jobs=n)
        else:
            call_command(
                "db_worker", "--batch", "--no-startup-delay", "--no-reload", "--max-tasks", str(n), stdout=sink
            )
    drain_q = len(ctx.captured_queries)
    per_job = [q["sql"][:160] for q in ctx.captured_queries]
    st = stats()
    clear()
    return {
        "n": n,
        "dispatch_queries_per_job": dispatch_q / n,
        "drain_queries_per_job": (drain_q / n) if drain_q else None,
        "drained": st["completed"],
        "dispatch_sample": dispatch_sample,
        # the statements of the middle job, roughly: a slice from the middle of the drain
        "drain_sample": per_job[len(per_job) // 2 : len(per_job) // 2 + max(1, drain_q // n) + 2],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dispatch")
    d.add_argument("--mode", choices=["single", "atomic", "bulk"], required=True)
    d.add_argument("--n", type=int, required=True)
    sub.add_parser("stats")
    sub.add_parser("clear")
    sub.add_parser("analyze")
    p = sub.add_parser("probe")
    p.add_argument("--n", type=int, default=50)
    args = parser.parse_args()

    if args.cmd == "dispatch":
        result = dispatch(args.mode, args.n)
    elif args.cmd == "stats":
        result = stats()
    elif args.cmd == "clear":
        result = clear()
    elif args.cmd == "analyze":
        result = analyze()
    else:
        result = probe(args.n)
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
