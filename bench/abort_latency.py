"""Abort latency: from ``Jobs.abort`` to the job's ``cancelled`` state, for a cooperative job.

ONE real worker (``python -m django jobs_work --concurrency 1``) with every setting at its
default (a 60 s lease, so a beat every 20 s; ``ABORT_GRACE`` 10 s), on django-jobs' database
backend on PostgreSQL or on its Redis backend. ``--aborts`` times (20): a job that looks at
``current_job().aborted`` every 10 ms (``bench.soak_jobs.until_aborted``) is dispatched; once it
has started (it pushes its id to a Redis list) and run 1 s plus a random fraction of a second
(so the request lands anywhere between two reads of the flag), the script calls
``Jobs.abort`` and reads the job's ``Job`` row every 5 ms until it is ``cancelled`` (on Redis,
the record the worker writes as it settles the job). Reported: the median and the max, in ms.

    python bench/abort_latency.py --backend postgres
    python bench/abort_latency.py --backend redis

It runs on ``bench/soak.py``'s settings and helpers, with a database (``bench_abort_latency``)
and a Redis database (14) of its own: ``SOAK_PG_NAME`` and ``SOAK_REDIS_URL`` change them. A run
of 20 aborts takes under a minute. It is not a test and asserts nothing on time; it exits 1 if
a job does not end ``cancelled`` within ``TIMEOUT`` seconds or the worker does not exit 0.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("SOAK_PG_NAME", "bench_abort_latency")
os.environ.setdefault("SOAK_REDIS_URL", "redis://127.0.0.1:6379/14")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.soak import BACKENDS, Worker, clear_redis, drop_database, load_average, recreate_database, redis_client

STARTED_KEY = "soak:abort-latency:started"  # the list ``until_aborted`` pushes its id to
TIMEOUT = 60.0  # seconds a job may take to start, or to end once aborted
POLL = 0.005


def wait(what: str, done: Callable[[], object], worker: Worker) -> float:
    """Poll ``done()`` every ``POLL`` seconds until it is true; the moment (``time.time()``)."""
    deadline = time.monotonic() + TIMEOUT
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {TIMEOUT:.0f} s waiting for {what}\n{worker.tail()}")
        worker.check()
        time.sleep(POLL)
    return time.time()


def one_abort(backend: str, worker: Worker) -> float:
    """Dispatch a cooperative job, abort it a second or two into its run: seconds to ``cancelled``."""
    from bench.soak_jobs import until_aborted
    from django_jobs import Jobs
    from django_jobs.models import Job

    client = redis_client()
    job_id = until_aborted.using(backend=backend).dispatch(STARTED_KEY)
    wait("the job to start", lambda: job_id.encode() in client.lrange(STARTED_KEY, 0, -1), worker)
    time.sleep(1 + random.random())
    asked = time.time()
    if Jobs.abort(job_id, "bench") != "aborting":
        raise RuntimeError(f"job {job_id} was not running when it was aborted")
    cancelled = Job.objects.filter(pk=job_id, status="cancelled")
    return wait("the job to end cancelled", cancelled.exists, worker) - asked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=list(BACKENDS), required=True)
    parser.add_argument("--aborts", type=int, default=20, help="jobs aborted one after the other (default 20)")
    args = parser.parse_args()
    import django

    django.setup()
    backend, latencies = BACKENDS[args.backend], []
    clear_redis()
    recreate_database()
    try:
        with tempfile.TemporaryDirectory(prefix="abort-latency-") as tmp:
            worker = Worker(backend, Path(tmp) / "worker.log")
            try:
                for _ in range(args.aborts):
                    latencies.append(one_abort(backend, worker) * 1000)
            finally:
                code = worker.stop()
    finally:
        drop_database()
        clear_redis()
    print(
        f"| {args.backend} | {len(latencies)} | {statistics.median(latencies):,.0f} ms | {max(latencies):,.0f} ms "
        f"| {load_average():.2f} |"
    )
    print("(backend, aborts, median, max, 1-minute load average)")
    if code != 0:
        print(f"the worker exited with {code}", file=sys.stderr)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
