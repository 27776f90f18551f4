"""Soak: a worker's memory over many jobs, and how fast an idle worker picks a job up.

For django-jobs' database backend on PostgreSQL and for its Redis backend, each with ONE real
worker process (``python -m django jobs_work --concurrency 1 --verbosity 0``):

1. **RSS over N jobs.** N no-op jobs are dispatched with ``Jobs.bulk`` in chunks of 5,000:
   four chunks before the worker starts, then one whenever fewer than 20,000 are waiting, so
   the queue never runs dry (the fewest queued at a sample is reported; dispatching a chunk
   takes about as long as draining one). Every 0.5 s the script reads the queue's size
   (``backend.size``: jobs done = dispatched - waiting or in progress) and the RSS (``VmRSS``
   in ``/proc/<pid>/status``) of the process that runs the jobs: ``jobs_work`` without
   ``--max`` is a supervisor that forks one child, found in
   ``/proc/<supervisor>/task/*/children``.
   Reported: RSS after the first 5,000 jobs (warm) and after all N, the growth between them,
   the child's peak RSS (``VmHWM``), and jobs/s from the warm sample on. The worker is then
   stopped with SIGTERM and must exit 0. On PostgreSQL every job must end ``completed``.
2. **Idle pick-up latency.** A second worker is started on the empty queue and left idle for
   1 s. For 3 more idle seconds the script counts what the worker sends: TCP data segments
   sent by the supervisor's and the child's sockets (``ss -tinp``, ``data_segs_out``: about one
   per query or command, this worker's only) and a server-side counter (PostgreSQL:
   ``xact_commit + xact_rollback`` of the bench database in ``pg_stat_database``: the worker's,
   plus autovacuum's, give or take a second of statistics flushing; Redis: the total
   ``calls`` of ``INFO commandstats``, server-wide, so it includes every other client of the
   server). Then K jobs are dispatched one at a time, 0.3-0.4 s apart; each pushes
   ``time.time()`` at its start minus ``time.time()`` just before its dispatch to a Redis
   list. Reported: p50, p90 and max of those delays in ms.

It is not a test and asserts nothing on time; it exits 1 if a worker does not exit 0 or jobs
are lost. Other load on the machine barely moves the RSS figures but does move latency and
jobs/s: the 1-minute load average is recorded with each measurement.

    python bench/soak.py --backend both --jobs 100000 --latency-jobs 25
    python bench/soak.py --backend redis --jobs 10000          # plumbing check, ~1 min

PostgreSQL (127.0.0.1:5432, user postgres, no password) is needed for both backends: the
database ``bench_soak`` is created, migrated and dropped. Redis database 13 on
127.0.0.1:6379 is flushed before and after; the script refuses to run if it holds keys that
are not its own. ``SOAK_PG_*`` and ``SOAK_REDIS_URL`` change them (see
``bench/soak_settings.py``). A markdown table per backend is printed and everything,
including the RSS samples, is written to ``bench/results/soak-<UTC time>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.soak_settings"

from bench import soak_settings as conf  # (needs ROOT on sys.path)

BACKENDS = {"postgres": "database", "redis": "redis"}  # --backend choice -> JOBS["BACKENDS"] name
QUEUE = "default"
POLL = 0.5  # seconds between samples (once the warm sample is taken, and when no chunk is due)
BACKLOG_CHUNKS = 4  # chunks kept waiting ahead of the worker
STALL = 120.0  # seconds without progress before a soak is given up
IDLE_WARMUP = 1.0
IDLE_WINDOW = 3.0


# -- processes --------------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    """The child processes of ``pid``, from ``/proc/<pid>/task/*/children``."""
    found: list[int] = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found += [int(child) for child in path.read_text().split()]
    return found


def memory_mb(pid: int, field_name: str = "VmRSS") -> float:
    """A ``kB`` line of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field_name}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field_name} for process {pid}")


def segments_sent(pids: set[int]) -> dict[str, int] | None:
    """TCP data segments sent so far by the established sockets of ``pids``, by remote port
    (``ss -tinp``); ``None`` where ``ss`` is missing. A socket shared by several processes
    (inherited across fork) counts once."""
    try:
        out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    sent: dict[str, int] = {}
    port: str | None = None
    for line in out.stdout.splitlines():
        if not line[:1].isspace():  # a socket; its TCP information follows on the next line
            owners = {int(pid) for pid in re.findall(r"pid=(\d+)", line)}
            port = line.split()[3].rpartition(":")[2] if owners & pids else None
        elif port is not None and (match := re.search(r"data_segs_out:(\d+)", line)):
            sent[port] = sent.get(port, 0) + int(match.group(1))
    return sent


class Worker:
    """One ``jobs_work --concurrency 1`` supervisor and the forked child that runs the jobs."""

    def __init__(self, backend: str, log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "django", "jobs_work", "--backend", backend]
        self.log = log
        self.child = 0  # not forked yet
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                [*command, "--concurrency", "1", "--verbosity", "0"],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            self.child = self._wait_for_child()
        except BaseException:
            self.stop()
            raise

    def _wait_for_child(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check()
            if found := children(self.process.pid):
                return found[0]
            time.sleep(0.05)
        raise RuntimeError(f"the worker forked no child in {timeout:.0f} s\n{self.tail()}")

    @property
    def pids(self) -> set[int]:
        return {self.process.pid, self.child}

    def check(self) -> None:
        """Raise if the supervisor has exited or its child is not the one first seen."""
        if self.process.poll() is not None:
            raise RuntimeError(f"the worker exited with {self.process.returncode}\n{self.tail()}")
        if self.child and self.child not in children(self.process.pid):
            raise RuntimeError(f"the worker's child {self.child} is gone (restarted?)\n{self.tail()}")

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then the exit status (``None``: still running after ``timeout``, killed)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


# -- services ---------------------------------------------------------------------------------


def pg_admin() -> Any:
    """An autocommit connection to the server's ``postgres`` database (each query sees fresh statistics)."""
    import psycopg

    return psycopg.connect(host=conf.PG_HOST, port=conf.PG_PORT, user=conf.PG_USER, dbname="postgres", autocommit=True)


def recreate_database() -> None:
    with pg_admin() as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{conf.PG_NAME}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{conf.PG_NAME}"')
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def drop_database() -> None:
    from django.db import connections

    connections.close_all()
    with pg_admin() as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{conf.PG_NAME}" WITH (FORCE)')


def redis_client() -> Any:
    import redis

    return redis.Redis.from_url(conf.SOAK_REDIS_URL)


def clear_redis() -> None:
    """Flush the bench's Redis database, refusing if it holds keys that are not the bench's."""
    client = redis_client()
    foreign = [key for key in client.scan_iter(count=1000) if not key.startswith(conf.SOAK_REDIS_PREFIX.encode())]
    if foreign:
        shown = ", ".join(key.decode(errors="replace") for key in foreign[:3])
        raise SystemExit(f"{conf.SOAK_REDIS_URL} holds keys that are not the benchmark's ({shown}, ...): not flushing")
    client.flushdb()


def server_count(backend: str) -> int:
    """PostgreSQL: transactions of the bench database so far. Redis: commands the whole server ran."""
    if backend == "database":
        with pg_admin() as admin:
            row = admin.execute(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s", [conf.PG_NAME]
            ).fetchone()
        return int(row[0])
    stats = redis_client().info("commandstats")
    return sum(int(entry["calls"]) for entry in stats.values())


def load_average() -> float:
    return os.getloadavg()[0]


# -- measurements -----------------------------------------------------------------------------


@dataclass
class Sample:
    seconds: float  # since the worker started
    done: int
    dispatched: int
    queued: int  # waiting or in progress
    rss_mb: float


@dataclass
class Soak:
    jobs: int
    warm_after: int
    samples: list[Sample] = field(default_factory=list)
    peak_rss_mb: float = 0.0
    exit_code: int | None = None
    load_start: float = 0.0
    load_end: float = 0.0

    @property
    def warm(self) -> Sample:
        return next(s for s in self.samples if s.done >= self.warm_after)

    @property
    def final(self) -> Sample:
        return self.samples[-1]

    @property
    def growth_mb(self) -> float:
        return self.final.rss_mb - self.warm.rss_mb

    @property
    def fewest_queued(self) -> int | None:
        """The fewest jobs queued at a sample taken before the last chunk went: 0 means the
        worker may have waited for jobs."""
        return min((s.queued for s in self.samples if s.dispatched < self.jobs), default=None)

    @property
    def jobs_per_second(self) -> float:
        """Between the warm sample and the last one taken while jobs were still left (the final
        sample comes up to ``POLL`` seconds after the last job): start-up is left out."""
        busy = [s for s in self.samples if s.done < self.jobs and s.seconds > self.warm.seconds]
        end = busy[-1] if busy else self.final
        if end is self.warm:  # a run too short for two samples: the overall rate
            return self.final.done / self.final.seconds
        return (end.done - self.warm.done) / (end.seconds - self.warm.seconds)


@dataclass
class Idle:
    seconds: float
    segments_by_port: dict[str, int] | None
    server_delta: int
    server_counter: str


@dataclass
class Latency:
    idle: Idle
    latencies_ms: list[float]
    exit_code: int | None = None
    load: float = 0.0

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        if len(ordered) == 1:
            return ordered[0]
        return statistics.quantiles(ordered, n=100, method="inclusive")[round(q * 100) - 1]


def dispatch_noops(backend: str, count: int) -> None:
    from bench.soak_jobs import noop
    from django_jobs import Jobs

    Jobs.bulk([noop.builder() for _ in range(count)], backend=backend)


def run_soak(backend: str, jobs: int, chunk: int, warm_after: int, workdir: Path) -> Soak:
    """Keep a worker's queue full until ``jobs`` no-ops are done, sampling its RSS.

    The first ``BACKLOG_CHUNKS`` chunks are dispatched before the worker starts: dispatching a
    chunk takes about as long as draining it, so a worker started on an empty queue would wait
    for each chunk at first."""
    from django_jobs import Jobs

    queue = Jobs.backend(backend)
    result = Soak(jobs=jobs, warm_after=min(warm_after, jobs), load_start=load_average())
    dispatched = done = 0
    while dispatched < min(jobs, BACKLOG_CHUNKS * chunk):
        dispatched += top_up(backend, jobs - dispatched, chunk)
    worker = Worker(backend, workdir / f"soak-{backend}.log")
    try:
        start = last_progress = time.monotonic()
        while done < jobs:
            if dispatched < jobs and dispatched - done < BACKLOG_CHUNKS * chunk:  # one chunk, then a sample
                dispatched += top_up(backend, jobs - dispatched, chunk)
            else:  # samples closer together until the warm one is taken
                time.sleep(POLL if done >= result.warm_after else POLL / 5)
            worker.check()
            queued = queue.size(QUEUE)
            now = time.monotonic()
            if dispatched - queued > done:
                done, last_progress = dispatched - queued, now
            result.samples.append(Sample(round(now - start, 3), done, dispatched, queued, memory_mb(worker.child)))
            if now - last_progress > STALL:
                raise RuntimeError(f"no job done for {STALL:.0f} s ({done}/{jobs} done)\n{worker.tail()}")
        result.peak_rss_mb = memory_mb(worker.child, "VmHWM")
    finally:
        result.exit_code = worker.stop()
    result.load_end = load_average()
    check_all_done(backend, jobs)
    return result


def top_up(backend: str, left: int, chunk: int) -> int:
    """Dispatch one chunk (fewer if fewer are ``left``); return how many."""
    count = min(chunk, left)
    dispatch_noops(backend, count)
    return count


def check_all_done(backend: str, jobs: int) -> None:
    """Every no-op completed (PostgreSQL: by status; Redis: none failed, none left)."""
    from django_jobs import Jobs
    from django_jobs.models import Job

    if backend == "database":
        completed = Job.objects.filter(status="completed").count()
        if completed != jobs:
            raise RuntimeError(f"{completed} of {jobs} jobs completed")
    else:
        stats = Jobs.backend(backend).stats(QUEUE)
        if any(stats.values()):
            raise RuntimeError(f"jobs left or failed after the soak: {stats}")


def measure_idle(backend: str, worker: Worker) -> Idle:
    """What an idle worker sends in ``IDLE_WINDOW`` seconds."""
    counter_before, segments_before = server_count(backend), segments_sent(worker.pids)
    time.sleep(IDLE_WINDOW)
    counter_after, segments_after = server_count(backend), segments_sent(worker.pids)
    segments = None
    if segments_before is not None and segments_after is not None:
        ports = sorted(set(segments_before) | set(segments_after))
        segments = {port: segments_after.get(port, 0) - segments_before.get(port, 0) for port in ports}
    counter = "pg_stat_database xact_commit+xact_rollback" if backend == "database" else "INFO commandstats calls"
    return Idle(IDLE_WINDOW, segments, counter_after - counter_before, counter)


def run_latency(backend: str, count: int, workdir: Path) -> Latency:
    """Start a worker, let it idle, count what it sends, then time ``count`` pick-ups."""
    from bench.soak_jobs import stamp

    client = redis_client()
    client.delete(conf.SOAK_LATENCY_KEY)
    worker = Worker(backend, workdir / f"latency-{backend}.log")
    try:
        time.sleep(IDLE_WARMUP)
        idle = measure_idle(backend, worker)
        result = Latency(idle=idle, latencies_ms=[], load=load_average())
        for _ in range(count):
            stamp.using(backend=backend).dispatch(time.time(), conf.SOAK_LATENCY_KEY)
            time.sleep(random.uniform(0.3, 0.4))
        deadline = time.monotonic() + 30
        while client.llen(conf.SOAK_LATENCY_KEY) < count and time.monotonic() < deadline:
            worker.check()
            time.sleep(0.1)
        result.latencies_ms = [float(value) * 1000 for value in client.lrange(conf.SOAK_LATENCY_KEY, 0, -1)]
    finally:
        exit_code = worker.stop()
    result.exit_code = exit_code
    if len(result.latencies_ms) != count:
        raise RuntimeError(f"{len(result.latencies_ms)} of {count} latency jobs ran\n{worker.tail()}")
    return result


# -- report -----------------------------------------------------------------------------------


def table(name: str, soak: Soak, latency: Latency) -> str:
    idle = latency.idle
    by_port = ", ".join(f"{n} to :{port}" for port, n in (idle.segments_by_port or {}).items()) or "none"
    sent = "n/a (no ss)" if idle.segments_by_port is None else f"{sum(idle.segments_by_port.values())} ({by_port})"
    p50, p90 = latency.quantile(0.5), latency.quantile(0.9)
    queued = "n/a (all sent before the worker started)" if soak.fewest_queued is None else f"{soak.fewest_queued:,}"
    rows = [
        (f"RSS after {soak.warm.done:,} jobs (warm)", f"{soak.warm.rss_mb:.1f} MB"),
        (f"RSS after {soak.final.done:,} jobs", f"{soak.final.rss_mb:.1f} MB"),
        ("RSS growth", f"{soak.growth_mb:+.1f} MB"),
        ("peak RSS (VmHWM)", f"{soak.peak_rss_mb:.1f} MB"),
        ("jobs/s (from the warm sample on)", f"{soak.jobs_per_second:,.0f}"),
        ("fewest jobs queued at a sample (before the last chunk)", queued),
        (
            f"pick-up latency p50 / p90 / max ({len(latency.latencies_ms)} jobs)",
            f"{p50:.1f} / {p90:.1f} / {max(latency.latencies_ms):.1f} ms",
        ),
        (f"idle {idle.seconds:.0f} s: TCP data segments the worker sent", sent),
        (f"idle {idle.seconds:.0f} s: {idle.server_counter}", f"{idle.server_delta:,}"),
        ("worker exit codes (soak, latency)", f"{soak.exit_code}, {latency.exit_code}"),
        ("load average (soak start, end; latency)", f"{soak.load_start:.2f}, {soak.load_end:.2f}; {latency.load:.2f}"),
    ]
    lines = [f"### {name}", "", "| measure | value |", "|---|---|"]
    lines += [f"| {label} | {value} |" for label, value in rows]
    return "\n".join(lines)


NOTES = """\
RSS: the forked child that runs the jobs (/proc/<pid>/status). jobs/s: from the warm sample to
the last one with jobs still queued, sampled every 0.5 s. Latency: job start minus the moment
just before its dispatch, one worker idle in wait_for_work. Idle: "TCP data segments" are
counted on the worker's own sockets (about one per query or command). The PostgreSQL counter
covers the bench database only, autovacuum included, flushed about once a second (+-1); the
Redis one covers the whole server, other clients included (an upper bound). Trust the segments."""


def metadata(args: argparse.Namespace) -> dict[str, Any]:
    import django

    import django_jobs

    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], check=False, cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return {
        "utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "args": vars(args),
        "commit": commit,
        "django_jobs_from": str(Path(django_jobs.__file__).parent),
        "python": platform.python_version(),
        "django": django.get_version(),
        "cpus": os.cpu_count(),
        "pg_database": conf.PG_NAME,
        "redis_url": conf.SOAK_REDIS_URL,
    }


def write_json(report: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"soak-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return path


def summary(soak: Soak, latency: Latency) -> dict[str, Any]:
    return {
        "rss_warm_mb": soak.warm.rss_mb,
        "rss_warm_after_jobs": soak.warm.done,
        "rss_final_mb": soak.final.rss_mb,
        "rss_growth_mb": soak.growth_mb,
        "peak_rss_mb": soak.peak_rss_mb,
        "jobs_per_second": soak.jobs_per_second,
        "jobs_per_second_overall": soak.final.done / soak.final.seconds,
        "fewest_queued": soak.fewest_queued,
        "latency_ms": {"p50": latency.quantile(0.5), "p90": latency.quantile(0.9), "max": max(latency.latencies_ms)},
        "exit_codes": {"soak": soak.exit_code, "latency": latency.exit_code},
    }


# -- main -------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["postgres", "redis", "both"], default="both")
    parser.add_argument("--jobs", type=int, default=100_000, help="no-op jobs for the RSS soak (default 100000)")
    parser.add_argument("--latency-jobs", type=int, default=25, help="jobs timed one by one (default 25)")
    parser.add_argument("--chunk", type=int, default=5000, help="jobs per Jobs.bulk call (default 5000)")
    parser.add_argument("--warm", type=int, default=5000, help="jobs done before the warm RSS sample (default 5000)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="directory for the JSON")
    args = parser.parse_args()
    if min(args.jobs, args.latency_jobs, args.chunk, args.warm) < 1:
        parser.error("--jobs, --latency-jobs, --chunk and --warm must be at least 1")
    return args


def measure(name: str, args: argparse.Namespace, workdir: Path) -> tuple[Soak, Latency]:
    backend = BACKENDS[name]
    print(f"{name}: soak of {args.jobs:,} jobs ...", flush=True)
    soak = run_soak(backend, args.jobs, args.chunk, args.warm, workdir)
    print(f"{name}: idle worker and {args.latency_jobs} pick-ups ...", flush=True)
    latency = run_latency(backend, args.latency_jobs, workdir)
    return soak, latency


def main() -> int:
    args = parse_args()
    names = list(BACKENDS) if args.backend == "both" else [args.backend]
    import django

    django.setup()
    report: dict[str, Any] = {"meta": metadata(args), "results": {}}
    tables: list[str] = []
    try:
        clear_redis()  # the latency jobs report through Redis, whichever backend carries them
        recreate_database()
        with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
            for name in names:
                try:
                    soak, latency = measure(name, args, Path(tmp))
                except RuntimeError as exc:  # a worker died or jobs were lost: the other backend still runs
                    print(f"{name}: FAILED: {exc}", file=sys.stderr)
                    report["results"][name] = {"ok": False, "error": str(exc)}
                    continue
                report["results"][name] = {
                    "ok": soak.exit_code == 0 and latency.exit_code == 0,
                    "summary": summary(soak, latency),
                    "soak": asdict(soak),
                    "latency": asdict(latency),
                }
                tables.append(table(name, soak, latency))
    finally:
        drop_database()
        clear_redis()
    print("\n\n".join(tables))
    print(f"\n{NOTES}")
    print(f"\nJSON: {write_json(report, args.out)}")
    failed = [name for name, result in report["results"].items() if not result["ok"]]
    if failed:
        print(f"failed (an error, or a worker that did not exit 0): {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
