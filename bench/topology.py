#!/usr/bin/env python
"""Drain throughput of the Redis backend on one Redis and on a Redis Cluster, in one run.

    flock /tmp/bench.lock python bench/topology.py --n 20000 --rounds 1

Each cell pre-dispatches N no-op jobs (``enqueue_many``, spread evenly over the cell's queues),
then starts one ``jobs_work --concurrency 1`` process per queue (worker i consumes queue i)
and polls the backlog (ready + delayed + leased, every queue) every 50 ms. Drain jobs/s is
what left the backlog between the first poll after every worker forked its process (start-up
done) and the poll that saw it empty, over that time: interpreter start and Django set-up are
excluded. Beside it, the busiest
server's load: the CPU seconds the busiest Redis server (``INFO cpu``, user + sys) spent during
the drain over its wall time (1.0: that server was the bottleneck; the shared Redis also serves
whatever else runs on the machine), and the workers' CPU time per job (``/proc``: the worker
processes, user + sys, over the same span). Cells:

* ``1 queue``: one queue (``default``), one worker, as the anchors harness drains;
* ``3 queues``: ``emails``, ``default`` and ``other``, whose hash tags fall on the three
  primaries of the test cluster (slots 3728, 5718, 11361), three workers.

The single Redis is ``--single`` (default DB 12 of the shared Redis), the cluster ``--cluster``
(scripts/services.d/redis-cluster.sh). Keys live under their own prefix, deleted before each
cell. Prints a markdown table (median over rounds); nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SHAPES = {"1 queue": ["default"], "3 queues": ["emails", "default", "other"]}
TOPOLOGIES = {"redis": "single Redis", "redis_cluster": "Redis Cluster (3 primaries)"}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20000, help="jobs per cell (default 20000)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--single", default="redis://127.0.0.1:6379/12")
    parser.add_argument("--cluster", default="redis://127.0.0.1:7000/0")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a drain may take")
    return parser.parse_args()


def main() -> int:
    args = parse()
    workdir = Path(tempfile.mkdtemp(prefix="bench-topology-"))
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="settings",
        BENCH_SYSTEM="jobs",
        BENCH_DB="sqlite",
        BENCH_SQLITE_PATH=str(workdir / "bench.sqlite3"),
        BENCH_REDIS_URL=args.single,
        BENCH_REDIS_CLUSTER_URL=args.cluster,
        BENCH_REDIS_PREFIX=f"benchtopo{os.getpid()}",
        BENCH_QUEUES=",".join(dict.fromkeys(q for queues in SHAPES.values() for q in queues)),
        PYTHONPATH=os.pathsep.join([str(HERE), str(REPO), env.get("PYTHONPATH", "")]),
    )
    os.environ.update(env)
    sys.path[:0] = [str(HERE), str(REPO)]
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    figures: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for round_ in range(args.rounds):
        for shape, queues in SHAPES.items():
            for backend, label in TOPOLOGIES.items():
                rate, load, per_job = drain(backend, queues, args.n, env, workdir, args.timeout)
                figures.setdefault((shape, backend), []).append((rate, load, per_job))
                print(
                    f"round {round_ + 1}: {shape}, {label}: {rate:.0f} jobs/s, load {load:.2f}, "
                    f"workers {per_job * 1e6:.0f} µs CPU a job",
                    file=sys.stderr,
                )
    labels = " | ".join(f"{label}: jobs/s (busiest server's load; worker CPU a job)" for label in TOPOLOGIES.values())
    print(f"| cell (N={args.n}, {args.rounds} round(s)) | {labels} | cluster / single |")
    print("|---|" + "---:|" * (len(TOPOLOGIES) + 1))
    for shape, queues in SHAPES.items():
        cells = [tuple(statistics.median(f[i] for f in figures[(shape, b)]) for i in (0, 1, 2)) for b in TOPOLOGIES]
        shown = " | ".join(f"{rate:.0f} ({load:.2f}; {per_job * 1e6:.0f} µs)" for rate, load, per_job in cells)
        print(f"| {shape}, {len(queues)} worker(s) | {shown} | {cells[1][0] / cells[0][0]:.2f} |")
    return 0


def drain(
    name: str, queues: list[str], n: int, env: dict[str, str], workdir: Path, timeout: float
) -> tuple[float, float, float]:
    """Drain jobs/s of ``n`` jobs over ``queues``, one worker each, on backend ``name``; the
    busiest server's CPU seconds per second of the drain; the workers' CPU seconds per job."""
    from benchjobs import noop_job

    from django_jobs.backends import get_backend

    backend = get_backend(name)
    clear(backend)
    envelopes = [noop_job.using(backend=name, queue=queues[i % len(queues)]).builder().build() for i in range(n)]
    for start in range(0, n, 1000):
        backend.enqueue_many(envelopes[start : start + 1000])
    assert backlog(backend, queues) == n, "not every job was stored"
    workers = []
    for i, queue in enumerate(queues):
        log = open(workdir / f"{name}-{queue}-{i}.log", "wb")  # noqa: SIM115 (the child keeps it)
        command = [sys.executable, str(HERE / "manage.py"), "jobs_work", queue, "--backend", name]
        workers.append(
            subprocess.Popen(
                [*command, "--concurrency", "1", "--verbosity", "0"], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        )
        log.close()
    try:
        deadline, first, cpu, spent = time.monotonic() + timeout, None, cpu_seconds(backend), 0.0
        while (left := backlog(backend, queues)) > 0:
            if first is None and all(children(worker.pid) for worker in workers):
                first, cpu, spent = (time.monotonic(), left), cpu_seconds(backend), process_cpu(workers)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: {left} jobs left after {timeout} s (logs in {workdir})")
            time.sleep(0.05)
        end, busy = time.monotonic(), [after - before for before, after in zip(cpu, cpu_seconds(backend), strict=True)]
        spent = process_cpu(workers) - spent
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(30)
    assert first is not None
    return first[1] / (end - first[0]), max(busy) / (end - first[0]), spent / first[1]


def children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def process_cpu(workers: list[subprocess.Popen[bytes]]) -> float:
    """CPU seconds (user + sys) the worker processes and their descendants use now."""
    ticks = os.sysconf("SC_CLK_TCK")
    pending, total = [w.pid for w in workers], 0.0
    while pending:
        pid = pending.pop()
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(stat[11]) + int(stat[12])) / ticks  # utime, stime
        pending += children(pid)
    return total


def cpu_seconds(backend: object) -> list[float]:
    """CPU seconds (user + sys) each server of ``backend`` has used since it started."""
    from django_jobs.backends import redis_connection

    infos = [server.info("cpu") for server in redis_connection.servers(backend.client)]  # type: ignore[attr-defined]
    return [float(info["used_cpu_user"]) + float(info["used_cpu_sys"]) for info in infos]


def backlog(backend: object, queues: list[str]) -> int:
    return sum(backend.size(q) for q in queues)  # type: ignore[attr-defined]


def clear(backend: object) -> None:
    """Delete this run's keys (on every primary of a cluster)."""
    from django_jobs.backends import redis_connection

    client = backend.client  # type: ignore[attr-defined]
    prefix = backend.prefix  # type: ignore[attr-defined]
    for server in redis_connection.servers(client):
        keys = list(server.scan_iter(match=f"{prefix}:*", count=1000))
        for start in range(0, len(keys), 500):
            server.delete(*keys[start : start + 500])


if __name__ == "__main__":
    raise SystemExit(main())
