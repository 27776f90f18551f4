"""What one dispatch costs, on PostgreSQL (the database engine) and Redis: where its time goes.

For each engine it prints, from one process (the figures of a shared machine are noisy: compare
them within a run, never with another machine's):

- ``--n`` dispatches one by one (``noop.dispatch(i)``, as the anchors harness enqueues), in
  autocommit: dispatches per second, and the CPU time of this process per dispatch (what the
  waits for the server leave out: steadier than the wall time on a shared machine);
- one ``Jobs.bulk`` of ``--n`` builders (their making included): jobs per second, and how many
  times the one-by-one rate that is;
- a ``cProfile`` of ``--profile`` dispatches one by one: the functions that cost the most time
  of their own (``tottime``), in microseconds per dispatch.

It uses the PostgreSQL database ``bench_dispatch_cost`` (dropped and created again) and Redis
DB 0 under a prefix of its own, whose keys it deletes at the end.

``--python-only`` measures django-jobs' own Python instead, which the machine's load hardly
moves: on Redis, with redis-py's command execution replaced by a stub that sends nothing (the
same stub for any version of django-jobs, pipelines included), the best of 5 timings of a
dispatch and of a bulk's job, in µs.

    python bench/dispatch_cost.py [--n 5000] [--profile 2000] [--top 20] [--engines postgres,redis]
    python bench/dispatch_cost.py --python-only

Not a test: nothing asserts on time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.history_cost import configure, recreate_postgres

DATABASE = "bench_dispatch_cost"
REDIS_URL = "redis://127.0.0.1:6379/0"
PREFIX = f"bench-dispatch-cost-{os.getpid()}"
BACKENDS = {
    "postgres": {"ENGINE": "database"},
    "redis": {"ENGINE": "redis", "OPTIONS": {"URL": REDIS_URL, "PREFIX": PREFIX}},
}


def one_by_one(n: int) -> tuple[float, float]:
    """Dispatches per second of ``n`` dispatches, one call each, and µs of CPU per dispatch."""
    from bench.history_cost_jobs import noop

    start, cpu = time.perf_counter(), time.process_time()
    for i in range(n):
        noop.dispatch(i)
    return n / (time.perf_counter() - start), (time.process_time() - cpu) / n * 1e6


def bulk(n: int) -> float:
    """Jobs per second of one ``Jobs.bulk`` of ``n`` jobs, its builders made in the time."""
    from bench.history_cost_jobs import noop
    from django_jobs import Jobs

    start = time.perf_counter()
    Jobs.bulk([noop.builder(i) for i in range(n)])
    return n / (time.perf_counter() - start)


def profile(n: int, top: int) -> str:
    """The ``top`` functions by their own time over ``n`` dispatches, in µs per dispatch."""
    from bench.history_cost_jobs import noop

    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(n):
        noop.dispatch(i)
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    total = stats.total_tt  # type: ignore[attr-defined]
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)  # type: ignore[attr-defined]
    lines = [
        f"profiled: {total / n * 1e6:.0f} µs per dispatch (cProfile's own cost included)",
        "| µs/dispatch (own) | µs/dispatch (with callees) | calls/dispatch | function |",
        "|---:|---:|---:|---|",
    ]
    for (path, line, name), (_, calls, own, cumulative, _) in rows[:top]:
        where = f"{Path(path).name}:{line}" if line else path
        lines.append(f"| {own / n * 1e6:.1f} | {cumulative / n * 1e6:.1f} | {calls / n:g} | {name} ({where}) |")
    return "\n".join(lines)


def python_only(n: int) -> None:
    """Print the µs of django-jobs' Python per Redis dispatch, one by one and in a bulk, with
    nothing sent (see the module's docstring)."""
    import timeit

    import redis.client

    from bench.history_cost_jobs import noop
    from django_jobs import Jobs

    redis.Redis.execute_command = lambda self, *args, **options: 1  # type: ignore[method-assign]
    redis.client.Pipeline.execute = lambda self, raise_on_error=True: [1] * len(self.command_stack)  # type: ignore[method-assign]
    noop.dispatch(0)
    single = min(timeit.repeat(lambda: noop.dispatch(1), number=n, repeat=5)) / n
    many = min(timeit.repeat(lambda: Jobs.bulk([noop.builder(i) for i in range(n)]), number=1, repeat=5)) / n
    print(
        f"django-jobs' Python per Redis dispatch: {single * 1e6:.1f} µs one by one, {many * 1e6:.1f} µs a job in a bulk"
    )


def clean_redis() -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(f"{PREFIX}:*", count=1000):
        client.delete(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=5000, help="dispatches one by one, and jobs in the bulk")
    parser.add_argument("--profile", type=int, default=2000, help="dispatches profiled")
    parser.add_argument("--top", type=int, default=20, help="functions shown")
    parser.add_argument("--engines", default="postgres,redis")
    parser.add_argument("--python-only", action="store_true", help="django-jobs' own Python on Redis, nothing sent")
    args = parser.parse_args()
    engines = ["redis"] if args.python_only else args.engines.split(",")
    recreate_postgres(DATABASE)
    with tempfile.TemporaryDirectory() as workdir:
        configure("postgres", workdir, DATABASE, BACKENDS={e: BACKENDS[e] for e in engines}, DEFAULT_BACKEND=engines[0])
        from django.conf import settings
        from django.core.management import call_command
        from django.test import override_settings

        call_command("migrate", verbosity=0)
        if args.python_only:
            python_only(args.n)
            return
        try:
            for engine in engines:
                with override_settings(JOBS={**settings.JOBS, "DEFAULT_BACKEND": engine}):
                    one_by_one(200)  # connect, load the scripts, warm the caches
                    bulk(200)  # the same for a bulk's statement
                    single, cpu = one_by_one(args.n)
                    many = bulk(args.n)
                    table = profile(args.profile, args.top)
                print(f"## {engine}\n")
                print(f"one by one: {single:,.0f} dispatches/s ({1e6 / single:.0f} µs each, {cpu:.0f} µs of CPU)")
                print(f"bulk of {args.n:,}: {many:,.0f} jobs/s, {many / single:.1f}x one by one\n")
                print(table, "\n")
        finally:
            if "redis" in engines:
                clean_redis()


if __name__ == "__main__":
    main()
