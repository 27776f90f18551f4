"""Worker start-up: spawn of ``jobs_work --concurrency 1`` -> first job done, and where it goes.

It measures what the anchors harness (``../shared/bench-anchors``) reports as "worker start-up s",
with the harness's own settings (``benches.dj_jobs_settings``), job and counter, on PostgreSQL (the
``database`` engine) and Redis, and prints per engine:

- each step's wall time (median and minimum of ``--runs`` starts) and CPU time (median), from
  ``startup_probe.py``, which runs the same command with each step timestamped: the interpreter,
  ``django.setup()``, loading the command, the system checks, ``_validate.migrated``, the fork,
  the worker process's set-up, its first claim, the job; and, beside them, the reaper's pass at
  start and the presence thread's first beat;
- the spawn -> first-job-done time of the harness's exact command
  (``python -m django jobs_work --concurrency 1 --verbosity 0``), median and minimum;
- one start under ``-X importtime``: the import time of each top-level package, and the
  django-jobs modules the worker process holds at its first job's end.

Run it from the repository root with the harness's venv (``django_jobs`` installed from this
checkout; ``PYTHONPATH=<another checkout>`` measures that one's), and never beside a harness run:
like the harness, it flushes Redis DB 11 (``BENCH_REDIS_DB``) and empties the bench database's
job table. For instance::

    flock /tmp/bench.lock /tmp/benchvenv/bin/python bench/startup.py --runs 7

The environment is passed on as it is: with ``PYTHONDONTWRITEBYTECODE=1`` and an editable
install, every start compiles django-jobs' modules from source; ``--cached-bytecode`` measures
with compiled modules instead (kept under a temporary ``PYTHONPYCACHEPREFIX``).

Not a test: nothing asserts on time.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
PROBE = HERE / "startup_probe.py"  # runs the command with its steps timestamped
PROBE_OUT = "STARTUP_PROBE_OUT"  # where the probe writes its events
ENGINES = {"postgres": "database", "redis": "redis"}
COMMAND = ["jobs_work", "--concurrency", "1", "--verbosity", "0"]
# Phases: (label, from event, to event), each event the first of its name in any process.
PHASES = [
    ("interpreter start", "spawn", "main"),
    ("import django.core.management", "main", "management"),
    ("django.setup()", "setup.begin", "setup.end"),
    ("load jobs_work (its imports)", "load.begin", "load.end"),
    ("system checks", "checks.begin", "checks.end"),
    ("handle: arguments, settings, job modules", "handle.begin", "migrated.begin"),
    ("_validate.migrated", "migrated.begin", "migrated.end"),
    ("supervisor: until the fork", "migrated.end", "fork"),
    ("fork -> worker built", "fork", "worker.built"),
    ("worker built -> run", "worker.built", "run.begin"),
    ("run -> first claim", "run.begin", "deliver.begin"),
    ("beside: the reaper's pass at start", "reap.begin", "reap.end"),
    ("beside: the presence thread's first beat", "beat.begin", "beat.end"),
    ("first claim -> job starts", "deliver.begin", "job.begin"),
    ("job body", "job.begin", "job.end"),
]
# django-jobs modules a worker of each engine never runs (on these settings: no admin, no SCHEDULE)
# or runs only after its first (plain) job, and other packages it never needs. (asyncio and
# redis.asyncio are not listed: Django's asgiref and redis-py's own __init__ import them.)
_NEVER = (
    r"admin|dashboard|charts|scheduler|schedules|operations|contrib|tasks|management\.commands\.jobs_schedule"
    r"|health|dependencies|flows"
)
UNWANTED = {
    "postgres": re.compile(
        rf"^django_jobs\.({_NEVER}|backends\.(redis|redis_limits|beanstalk|servicebus|sync|db_limits))(\.|$)"
    ),
    "redis": re.compile(rf"^django_jobs\.({_NEVER}|backends\.(database|db_limits|beanstalk|servicebus|sync))(\.|$)"),
}
FOREIGN = re.compile(r"^(django\.contrib\.admin|prometheus_client|croniter)(\.|$)")


def environment(args: argparse.Namespace, engine: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(args.anchors), env.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
        DJANGO_SETTINGS_MODULE="benches.dj_jobs_settings",
        BENCH_DJJ_DB="pg",
        BENCH_DJJ_ENGINE=ENGINES[engine],
    )
    if args.cached_bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(Path(tempfile.gettempdir()) / "django-jobs-startup-pyc")
    return env


def python(env: dict[str, str], args: argparse.Namespace, code: str) -> str:
    """Run ``code`` in a set-up Django process (the harness's settings) and return its output."""
    proc = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()\n" + code],
        env=env,
        cwd=args.anchors,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        sys.exit(f"set-up failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def prepare(env: dict[str, str], args: argparse.Namespace) -> None:
    """The bench database exists and is migrated."""
    python(
        env,
        args,
        "from benches import common, django_jobs_bench\n"
        "from django.core.management import call_command\n"
        "django_jobs_bench.ensure_pg_db(common.PG_DB_PREFIX + 'djjobs')\n"
        "call_command('migrate', verbosity=0)\n",
    )


def queue_jobs(env: dict[str, str], args: argparse.Namespace) -> None:
    """Empty the job table and Redis DB 11, then queue ``--queued`` jobs (one bulk dispatch)."""
    python(
        env,
        args,
        "from django.db import connection\n"
        "from benches import common, dj_jobs_tasks\n"
        "from django_jobs import Jobs\n"
        "from django_jobs.models import Job\n"
        "with connection.cursor() as cursor:\n"
        "    cursor.execute(f'TRUNCATE {Job._meta.db_table}')\n"
        "common.reset_redis()\n"
        f"Jobs.bulk(dj_jobs_tasks.noop.builder(i) for i in range({args.queued}))\n",
    )


def spawn(cmd: list[str], env: dict[str, str], args: argparse.Namespace) -> tuple[float, float | None]:
    """Start ``cmd`` and poll the harness's counter until the first job is done (or
    ``--timeout``); return the spawn time and the seconds to the first job."""
    import redis

    counter = redis.Redis(
        host=os.environ.get("BENCH_REDIS_HOST", "127.0.0.1"),
        port=int(os.environ.get("BENCH_REDIS_PORT", "6379")),
        db=int(os.environ.get("BENCH_REDIS_DB", "11")),
    )
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=args.anchors,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        while time.monotonic() - start < args.timeout:
            if counter.get("bench:done"):
                return start, time.monotonic() - start
            if proc.poll() is not None:
                break
            time.sleep(0.001)
        return start, None
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the worker's process group, then SIGKILL what is left after 5 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(5)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Event(NamedTuple):
    pid: int
    wall: float  # seconds since the spawn
    cpu: float  # the CPU seconds of its process so far (a forked process starts from 0)


def read_events(path: Path, spawned: float) -> dict[str, Event]:
    """The first of each event, in any process."""
    events = {"spawn": Event(0, 0.0, 0.0)}
    for line in path.read_text().splitlines():
        pid, name, wall, cpu = line.split()
        events.setdefault(name, Event(int(pid), float(wall) - spawned, float(cpu)))
    return events


def cpu_between(begin: Event, end: Event) -> float:
    """CPU seconds from ``begin`` to ``end``: of one process, or of the process ``end`` is in
    since its fork (or exec)."""
    return end.cpu - begin.cpu if begin.pid == end.pid else end.cpu


def import_times(env: dict[str, str], args: argparse.Namespace) -> tuple[Counter[str], list[str]]:
    """One start under ``-X importtime``: the self time (seconds) of each top-level package
    imported until the first job is done, and the modules the worker process holds then."""
    with tempfile.TemporaryDirectory() as tmp:
        log, events = Path(tmp) / "importtime", Path(tmp) / "events"
        with log.open("w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-X", "importtime", str(PROBE), *COMMAND, "--max-time", "1"],
                env={**env, PROBE_OUT: str(events)},
                cwd=args.anchors,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
            proc.wait(args.timeout)
        totals: Counter[str] = Counter()
        for line in log.read_text().splitlines():
            if line.startswith("import time:") and "self [us]" not in line:
                own, _cumulative, name = line.removeprefix("import time:").split("|")
                totals[name.strip().split(".")[0]] += int(own) / 1e6
        held = Path(f"{events}.modules")
        return totals, held.read_text().split() if held.exists() else []


def measure(args: argparse.Namespace, engine: str) -> None:
    env = environment(args, engine)
    prepare(env, args)
    plain: list[float] = []
    wall: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)
    if args.cached_bytecode:  # one start to compile every module into the cache
        queue_jobs(env, args)
        spawn([sys.executable, "-m", "django", *COMMAND], env, args)
    for _ in range(args.runs):
        queue_jobs(env, args)
        _, seconds = spawn([sys.executable, "-m", "django", *COMMAND], env, args)
        if seconds is not None:
            plain.append(seconds)
        queue_jobs(env, args)
        with tempfile.NamedTemporaryFile(suffix=".events") as file:
            probed = [sys.executable, str(PROBE), *COMMAND]
            spawned, seconds = spawn(probed, {**env, PROBE_OUT: file.name}, args)
            events = read_events(Path(file.name), spawned)
        if seconds is None or "job.end" not in events:
            continue
        for label, begin, end in PHASES:
            if begin in events and end in events:
                wall[label].append(events[end].wall - events[begin].wall)
                cpu[label].append(cpu_between(events[begin], events[end]))
        total = "total (probe): spawn -> job done"
        wall[total].append(events["job.end"].wall)
        cpu[total].append(events["fork"].cpu + events["job.end"].cpu)  # the supervisor's, then the worker's
    print(f"\n## {engine} (ENGINE {ENGINES[engine]!r}), {len(plain)} of {args.runs} runs\n")
    print("| phase | median s | min s | CPU median s |\n|---|---:|---:|---:|")
    for label, values in wall.items():
        print(
            f"| {label} | {statistics.median(values):.3f} | {min(values):.3f} | {statistics.median(cpu[label]):.3f} |"
        )
    if plain:
        median, least = statistics.median(plain), min(plain)
        print(f"| **spawn -> first job done** (the harness's command) | **{median:.3f}** | {least:.3f} | |")
    queue_jobs(env, args)
    totals, modules = import_times(env, args)
    print(f"\n`-X importtime`, one start: {sum(totals.values()):.3f} s; {len(modules)} modules in the worker process\n")
    print("| package | self s |\n|---|---:|")
    for package, seconds in totals.most_common(args.top):
        print(f"| {package} | {seconds:.3f} |")
    ours = sorted(m for m in modules if m.startswith("django_jobs"))
    print(f"\ndjango-jobs modules imported ({len(ours)}): {', '.join(ours)}")
    unwanted = UNWANTED[engine]
    print(f"imported although a worker does not run them: {', '.join(m for m in ours if unwanted.match(m)) or 'none'}")
    others = sorted({m.split(".")[0] for m in modules if FOREIGN.match(m)})
    print(f"other packages a worker does not run: {', '.join(others) or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="starts per engine (each measured plain and probed)")
    parser.add_argument("--engines", default="postgres,redis", help="postgres, redis or both (default)")
    parser.add_argument("--queued", type=int, default=500, help="jobs queued before each start (default 500)")
    parser.add_argument("--anchors", type=Path, default=HERE.parent.parent / "shared" / "bench-anchors")
    parser.add_argument("--cached-bytecode", action="store_true", help="measure with compiled modules")
    parser.add_argument("--top", type=int, default=8, help="packages listed by import time")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a start may take")
    args = parser.parse_args()
    args.anchors = args.anchors.resolve()
    bytecode = "cached" if args.cached_bytecode else "as the environment says"
    print(f"# Worker start-up: {sys.executable}, bytecode {bytecode}", end="")
    print(f" (PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r})")
    for engine in args.engines.split(","):
        measure(args, engine)


if __name__ == "__main__":
    main()
