"""Where a django-jobs Redis worker spends its time per job, in-process (not part of the timed bench).

    python -m peers.profile_djjobs --n 3000 [--top 30] [--out /tmp/djjobs.prof]

Flushes Redis database ``BENCH_REDIS_DB`` (12), bulk-enqueues N no-op jobs, then runs the loop
each ``jobs_work`` process runs, ``QueueWorker("redis").run(max_jobs=N)``, first plain (µs per
job, wall clock) and then again under cProfile, and prints the functions by own time and by
cumulative time, per job. Run with ``PYTHONPATH=<repo>:bench`` and
``DJANGO_SETTINGS_MODULE=peers.settings`` (the harness's environment).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "peers.settings")

import django

django.setup()

from django_jobs import Jobs
from django_jobs.worker import QueueWorker
from peers.common import REDIS_DB, redis_client
from peers.djjobs_tasks import noop


def fill(n: int) -> None:
    redis_client().flushdb()
    Jobs.bulk([noop.builder() for _ in range(n)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", default=None, help="also dump the raw profile here")
    args = parser.parse_args()
    print(f"Redis db {REDIS_DB}: {args.n} no-op jobs, QueueWorker('redis').run(max_jobs={args.n}) in-process")

    fill(args.n)
    worker = QueueWorker("redis")
    t0, c0 = time.perf_counter(), time.process_time()
    done = worker.run(max_jobs=args.n)
    plain, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(
        f"plain: {done} jobs, {plain / done * 1e6:.0f} us/job wall ({done / plain:,.0f} jobs/s), "
        f"{cpu / done * 1e6:.0f} us/job CPU in this process, load {os.getloadavg()[0]:.2f}"
    )

    fill(args.n)
    worker = QueueWorker("redis")
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    done = worker.run(max_jobs=args.n)
    profiler.disable()
    profiled = time.perf_counter() - t0
    print(f"profiled: {profiled / done * 1e6:.0f} us/job")
    if args.out:
        profiler.dump_stats(args.out)
    stats = pstats.Stats(profiler)
    for key in ("tottime", "cumulative"):
        print(f"\n--- by {key} (calls per job, us per job) ---")
        rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2] if key == "tottime" else kv[1][3], reverse=True)
        for (path, line, func), (cc, nc, tt, ct, _callers) in rows[: args.top]:
            where = f"{os.path.relpath(path) if path.startswith('/') else path}:{line}({func})"
            print(f"{nc / done:8.2f} {tt / done * 1e6:8.1f} {ct / done * 1e6:8.1f}  {where[-110:]}")
    redis_client().flushdb()


if __name__ == "__main__":
    main()
