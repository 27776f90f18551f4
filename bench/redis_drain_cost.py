"""CPU per job of a Redis worker's drain, in one process: no start-up, no job body.

``QueueWorker.run`` drains ``--n`` jobs dispatched to a private ``redis-server`` (started on a
free loopback port, stopped at the end), with the attempt history in PostgreSQL (database
``bench_redis_drain`` on 127.0.0.1, created if missing), as the anchors harness's Redis cell has
it. ``--mode noop``: jobs that do nothing; ``--mode retry``: jobs that fail their first run and
succeed on the second (``max_retries=1``, no backoff), as the harness's retry variant. It prints
the CPU time (``time.process_time``: every thread of the process) and the wall time per job of
each round, then their medians; ``--profile PATH`` writes a cProfile of the last round.
``--supervised``: the worker tells a supervisor's shared memory of its jobs and of its failed
runs not written yet, as a ``jobs_work`` pool process does (its failed runs' requeues then wait
for the batch); without it, it runs as ``jobs_work --once`` or ``--max N`` with one process does. A
comparison, not a test: nothing asserts on time.

    python bench/redis_drain_cost.py --mode retry --n 2000 --rounds 5 --supervised
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("BENCH_SYSTEM", "jobs")

DATABASE = "bench_redis_drain"


def private_redis(workdir: str) -> tuple[subprocess.Popen[bytes], int]:
    """A throwaway redis-server on a free loopback port, checked to be this one (by its pid)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            if client.info("server")["process_id"] != server.pid:
                server.kill()
                raise SystemExit(f"port {port} is another redis-server's")
            return server, port
        except redis.ConnectionError:
            time.sleep(0.05)
    server.kill()
    raise SystemExit("redis-server did not start")


def configure(port: int) -> None:
    import django
    import psycopg
    from django.conf import settings

    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE]).fetchone():
            conn.execute(f"CREATE DATABASE {DATABASE}")
    settings.configure(
        SECRET_KEY="bench-only-not-a-secret-0123456789abcdefghijklmnopqrstuvwxyz",
        USE_TZ=True,
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_jobs"],
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": DATABASE,
                "HOST": "127.0.0.1",
                "USER": "postgres",
                "CONN_MAX_AGE": None,
            }
        },
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        CACHES={"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}},
        JOBS={
            "DEFAULT_BACKEND": "bench",
            "BACKENDS": {"bench": {"ENGINE": "redis", "OPTIONS": {"URL": f"redis://127.0.0.1:{port}/0"}}},
            "IMPORTS": ["bench.redis_drain_jobs"],
            "RETRY_BACKOFF_STRATEGY": "none",
        },
    )
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("noop", "retry"), default="noop")
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", help="write a cProfile of the last round here")
    parser.add_argument("--supervised", action="store_true", help="as a jobs_work pool process runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        server, port = private_redis(workdir)
        try:
            configure(port)
            measure(args)
        finally:
            server.kill()
            server.wait()


def measure(args: argparse.Namespace) -> None:
    from bench import redis_drain_jobs
    from django_jobs.backends import get_backend
    from django_jobs.models import JobAttempt
    from django_jobs.pool import ACKS_BYTES, CLAIMS_BYTES, Recorder, Shared
    from django_jobs.worker import QueueWorker

    backend = get_backend()
    job = redis_drain_jobs.noop if args.mode == "noop" else redis_drain_jobs.fails_once
    deliveries = args.n if args.mode == "noop" else 2 * args.n
    cpu, wall = [], []
    for round_ in range(args.rounds):
        backend.client.flushdb()
        for i in range(args.n):
            job.dispatch(i)
        rows = JobAttempt.objects.count()
        profile = cProfile.Profile() if args.profile and round_ == args.rounds - 1 else None
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if profile is not None:
            profile.enable()
        worker = QueueWorker(backend)
        if args.supervised:
            context = multiprocessing.get_context("fork")
            shared = Shared(context.Array("c", CLAIMS_BYTES, lock=False), context.Array("c", ACKS_BYTES, lock=False))
            worker.supervisor = Recorder(shared)
        done = worker.run(max_jobs=deliveries, reap=False)
        if profile is not None:
            profile.disable()
            profile.dump_stats(args.profile)
        cpu.append((time.process_time() - cpu0) / args.n * 1e6)
        wall.append((time.perf_counter() - wall0) / args.n * 1e6)
        recorded = JobAttempt.objects.count() - rows
        print(
            f"round {round_ + 1}: {args.mode}, {args.n} jobs, {done} deliveries, {recorded} attempt rows: "
            f"CPU {cpu[-1]:.0f} us a job, wall {wall[-1]:.0f} us"
        )
    print(f"median: CPU {statistics.median(cpu):.0f} us a job, wall {statistics.median(wall):.0f} us")


if __name__ == "__main__":
    main()
