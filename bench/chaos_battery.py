#!/usr/bin/env python
"""The chaos battery (issue 5): crash recovery, poison jobs, a tamper flood, graceful shutdown,
a soak, database restarts, chains and groups under worker kills (``flows``; skipped on a
backend without dependencies), and workers frozen past their lease mid-run with batches on
(``stall``), and the Redis primary failed over under running workers (``failover``, on
``--backend sentinel``), against real ``jobs_work`` processes on one backend. Prints JSON on stdout.

    python bench/chaos_battery.py --backend postgres|redis|redis-cluster|sentinel|beanstalk \\
        --scenario crash|poison|tamper|shutdown|soak|dbrestart|flows|stall|failover|all[,...] [--jobs N] [--seconds S] [--short]

What it sets up (and tears down):
- a PRIVATE PostgreSQL server (initdb into a temp dir, ``postgres`` on a free loopback port, as
  the ``postgres`` OS user when run as root) with a database ``--db-name`` (default
  ``chaos_jobs``); it holds the jobs of the postgres backend, the failed-job rows of the other
  backends, and the side-effect tables every run writes to (bench/chaos/jobs.py). ``--pg-external``
  uses the server of ``--pg-host/--pg-port/--pg-user`` instead (a fresh database, dropped at the
  end) and never restarts it;
- redis: a PRIVATE ``redis-server --appendonly yes --appendfsync everysec`` on a free loopback
  port, in a temp dir; redis-cluster: a PRIVATE Redis Cluster of three primaries with a replica
  each (bench/chaos/servers.py ``PrivateRedisCluster``; a crash restart kills the primary of the
  ``default`` queue and its replica takes over); sentinel: a PRIVATE Sentinel group (a primary,
  a replica, three sentinels: bench/chaos/servers.py ``PrivateSentinelGroup``) that the
  ``failover`` scenario fails over;
  beanstalk: a PRIVATE ``beanstalkd -b <tmpdir>`` on a free port;
- worker processes: ``python -m django jobs_work default other --backend chaos`` with
  DJANGO_SETTINGS_MODULE=bench.chaos.settings, each in its own process group.

Server restarts (crash: the backend's server twice; dbrestart: the database, and on redis the
redis-server) only ever touch these private servers: a crash restart is SIGKILL of the server's
processes, a 1 s outage and a start that replays the WAL / AOF / binlog. ``--no-db-restart``
skips the crash scenario's PostgreSQL restarts. ``--pgbouncer`` puts a PRIVATE PgBouncer in
transaction pooling mode (free loopback port) between PostgreSQL and the workers and driver (a
restart is still the server's). Progress goes to stderr. Exit status: 0 when every scenario ran
(whatever its figures), 1 on an error.
Figures and their meaning: docs/reliability.md, "Chaos battery".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# Run as a script: import bench.chaos.* and django_jobs from the repository root.
sys.path.insert(0, str(REPO))

ORDER = ("crash", "poison", "tamper", "shutdown", "soak", "dbrestart", "flows", "stall", "failover")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backend", required=True, choices=("postgres", "redis", "redis-cluster", "sentinel", "beanstalk")
    )
    parser.add_argument(
        "--scenario",
        default="all",
        help="crash, poison, tamper, shutdown, soak, dbrestart, flows, stall, failover, all, or a comma-separated list",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        help="jobs per scenario (crash 5000, poison 1000, tamper 10000 good + as many bad; --short: 300); "
        "flows: the number of chains (default 200, --short 60; groups: a quarter as many); stall 1000, --short 90",
    )
    parser.add_argument("--seconds", type=float, help="soak duration (default 600; --short: 30)")
    parser.add_argument("--short", action="store_true", help="small sizes (crash 300 jobs, soak 30 s, ...)")
    parser.add_argument(
        "--job-ms",
        type=float,
        help="sleep of a healthy job in ms (default 5; crash --short: 50; flows 20, --short 50; "
        "stall: from it to twice it, default 150)",
    )
    parser.add_argument("--lease", type=float, default=2.0, help="LEASE_TIMEOUT in seconds (default 2)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (targets of kills and stops)")
    parser.add_argument(
        "--no-db-restart", action="store_true", help="crash on postgres: do not restart the (private) server"
    )
    parser.add_argument(
        "--pg-external",
        action="store_true",
        help="use the PostgreSQL server of --pg-host/--pg-port/--pg-user, never restarted, instead of a private one",
    )
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=0,
        help="sentinel: the servers' min-replicas-to-write (default 0: a primary never refuses a write)",
    )
    parser.add_argument(
        "--pgbouncer",
        action="store_true",
        help="the workers reach PostgreSQL through a PRIVATE PgBouncer in transaction pooling mode, in front of it",
    )
    parser.add_argument("--outage", type=float, default=1.0, help="seconds a restarted server stays down (default 1)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=900,
        help="seconds a drain may take before it is reported as not drained (default 900)",
    )
    parser.add_argument("--db-name", default=os.environ.get("CHAOS_PG_NAME", "chaos_jobs"))
    parser.add_argument("--pg-host", default=os.environ.get("CHAOS_PG_HOST", "127.0.0.1"))
    parser.add_argument("--pg-port", default=os.environ.get("CHAOS_PG_PORT", "5432"))
    parser.add_argument("--pg-user", default=os.environ.get("CHAOS_PG_USER", "postgres"))
    parser.add_argument(
        "--code",
        metavar="REV",
        help="run django_jobs as committed at REV (git archive into a temp dir, with this bench/), "
        "or 'worktree': a frozen copy of the working tree's django_jobs/ (edits during the run take no part)",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (worker logs) and the database")
    args = parser.parse_args(argv)
    names = ORDER if args.scenario == "all" else tuple(s.strip() for s in args.scenario.split(",") if s.strip())
    unknown = [s for s in names if s not in ORDER]
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(unknown)}")
    args.scenarios = names
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.code:
        return _run_from_snapshot(args.code, list(sys.argv[1:] if argv is None else argv))
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    workdir = Path(tempfile.mkdtemp(prefix=f"chaos-{args.backend}-"))
    from bench.chaos.servers import (
        Postgres,
        PrivateBeanstalkd,
        PrivatePgBouncer,
        PrivatePostgres,
        PrivateRedis,
        PrivateRedisCluster,
        PrivateSentinelGroup,
    )

    # redis-cluster and sentinel: the redis engine on a private cluster (its crash restarts are
    # failovers) or behind a private Sentinel group.
    kind = "redis" if args.backend in ("redis-cluster", "sentinel") else args.backend

    database: PrivatePostgres | None = None
    if args.pg_external:
        pg = Postgres(args.db_name, args.pg_host, args.pg_port, args.pg_user, os.environ.get("CHAOS_PG_PASSWORD", ""))
    else:
        database = PrivatePostgres()
        pg = Postgres(args.db_name, database.host, str(database.port), database.user)
    env = {
        "CHAOS_BACKEND": kind,
        "CHAOS_PG_NAME": args.db_name,
        "CHAOS_PG_HOST": pg.host,
        "CHAOS_PG_PORT": str(pg.port),
        "CHAOS_PG_USER": pg.user,
        "CHAOS_LEASE_TIMEOUT": str(args.lease),
        "CHAOS_PREFIX": f"chaos{os.getpid()}",
        "DJANGO_SETTINGS_MODULE": "bench.chaos.settings",
        "PYTHONUNBUFFERED": "1",
    }
    server = None
    pooler: PrivatePgBouncer | None = None
    report: dict = {
        "backend": args.backend,
        "short": args.short,
        "seed": seed,
        "command": " ".join(["python", "bench/chaos_battery.py", *(argv or sys.argv[1:])]),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "loadavg_before": os.getloadavg()},
        "workdir": str(workdir),
        "scenarios": {},
        "scenario_seconds": {},
        "errors": {},
    }
    code = 0
    try:
        if database is not None:
            database.start()
            report["postgres_server"] = f"private (initdb in {database.directory}, port {database.port})"
        else:
            report["postgres_server"] = f"external {pg.host}:{pg.port} (never restarted)"
        if args.pgbouncer:  # every connection of the workers and of this driver goes through it
            pooler = PrivatePgBouncer(pg.port)
            pooler.start()
            env["CHAOS_PG_HOST"], env["CHAOS_PG_PORT"] = pooler.host, str(pooler.port)
            report["pooler"] = f"private PgBouncer (transaction pooling, port {pooler.port})"
        if args.backend in ("redis", "sentinel"):
            server = (
                PrivateRedis(workdir) if args.backend == "redis" else PrivateSentinelGroup(workdir, args.min_replicas)
            )
            server.start()
            env["CHAOS_REDIS_URL"] = server.url
            report["redis_version"] = _version(["redis-server", "--version"])
            if args.backend == "sentinel":
                report["min_replicas_to_write"] = args.min_replicas
        elif args.backend == "redis-cluster":
            server = PrivateRedisCluster(workdir / "cluster")
            server.start()
            env["CHAOS_REDIS_CLUSTER_NODES"] = ",".join(f"{host}:{port}" for host, port in server.startup_nodes)
            report["redis_version"] = _version(["redis-server", "--version"])
        elif args.backend == "beanstalk":
            server = PrivateBeanstalkd(workdir)
            server.start()
            env["CHAOS_BEANSTALK"] = f"127.0.0.1:{server.port}"
            report["beanstalkd_version"] = _version(["beanstalkd", "-v"])
        pg.create()
        os.environ.update(env)
        worker_env = dict(os.environ)
        worker_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)
        from django.db import connection

        from bench.chaos.jobs import TABLES
        from bench.chaos.probe import Probe
        from bench.chaos.scenarios import SCENARIOS, Context, log

        with connection.cursor() as cursor:
            cursor.execute(TABLES)
            report["postgres_version"] = connection.pg_version
        import random

        report["django"] = django.get_version()
        report["django_jobs_commit"] = _code_version()
        ctx = Context(
            kind=kind,
            short=args.short,
            workdir=workdir,
            env=worker_env,
            probe=Probe(kind, server),
            server=server if server is not None else database,
            database=database,
            outage=args.outage,
            lease=args.lease,
            seed=seed,
            jobs=args.jobs,
            seconds=args.seconds,
            job_ms=args.job_ms,
            restart_database=database is not None and not args.no_db_restart,
            timeout=args.timeout,
            rng=random.Random(seed),
        )
        for name in args.scenarios:
            log(f"{args.backend}: scenario {name} (seed {seed})")
            started = time.monotonic()
            try:
                report["scenarios"][name] = SCENARIOS[name](ctx)
            except Exception:  # noqa: BLE001 - reported, the other scenarios still run
                report["errors"][name] = traceback.format_exc()
                log(f"{name} FAILED:\n{report['errors'][name]}")
                code = 1
            report["scenario_seconds"][name] = round(time.monotonic() - started, 1)
            log(f"{args.backend}: scenario {name} done in {report['scenario_seconds'][name]}s")
    except Exception:  # noqa: BLE001
        report["errors"]["setup"] = traceback.format_exc()
        print(report["errors"]["setup"], file=sys.stderr)
        code = 1
    finally:
        report["machine"]["loadavg_after"] = os.getloadavg()
        try:
            from django.db import connections

            connections.close_all()
        except Exception:  # noqa: BLE001,S110 - closing on the way out; nothing to do about it
            pass
        if server is not None:
            server.kill()
        if pooler is not None:
            pooler.cleanup()
        if database is not None:
            # Only the private server this run started; --keep leaves its data dir behind.
            database.kill()
            if not args.keep:
                database.cleanup()
        elif not args.keep:
            try:
                pg.drop()
            except Exception as exc:  # noqa: BLE001
                report["errors"]["drop_database"] = repr(exc)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.out:
        args.out.write_text(text)
    return code


def _run_from_snapshot(rev: str, argv: list[str]) -> int:
    """Run this script again from a temp dir holding ``git archive REV django_jobs`` and a copy of
    the working tree's bench/: the driver and its workers import that django_jobs (their cwd
    comes first on sys.path), so uncommitted edits in the working tree take no part."""
    worktree = rev == "worktree"
    commit = _version(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD" if worktree else rev])
    if not commit:
        print(f"--code: unknown revision {rev!r}", file=sys.stderr)
        return 2
    dest = Path(tempfile.mkdtemp(prefix=f"chaos-code-{commit}-"))
    try:
        if worktree:
            # A frozen copy of the working tree's django_jobs/: edits made during the run take no part.
            shutil.copytree(REPO / "django_jobs", dest / "django_jobs", ignore=shutil.ignore_patterns("__pycache__"))
            diff = subprocess.run(
                ["git", "-C", str(REPO), "diff", "HEAD", "--", "django_jobs"], check=True, capture_output=True
            ).stdout
            digest = hashlib.sha1(diff).hexdigest()[:10]  # a label, not security
            label = f"{commit}+worktree (uncommitted django_jobs diff sha1 {digest}, {len(diff)} bytes)"
        else:
            archive = subprocess.run(
                ["git", "-C", str(REPO), "archive", "--format=tar", commit, "django_jobs"],
                check=True,
                capture_output=True,
            )
            subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
            label = f"{commit} (git archive)"
        shutil.copytree(HERE, dest / "bench", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "peers"))
        (dest / ".chaos-commit").write_text(f"{label}; bench/ from the working tree\n")
        rest, skip = [], False
        for arg in argv:
            if skip:
                skip = False
                continue
            if arg == "--code":
                skip = True
                continue
            if arg.startswith("--code="):
                continue
            rest.append(arg)
        return subprocess.run([sys.executable, str(dest / "bench" / "chaos_battery.py"), *rest], check=False).returncode
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def _code_version() -> str | None:
    """The commit of the code that ran: ``git rev-parse`` (plus ``+dirty`` when django_jobs/ has
    uncommitted changes), or the ``.chaos-commit`` file of a snapshot made with ``git archive``."""
    commit = _version(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    if commit:
        dirty = _version(["git", "-C", str(REPO), "status", "--porcelain", "--", "django_jobs"])
        return commit + ("+dirty" if dirty else "")
    marker = REPO / ".chaos-commit"
    return marker.read_text().strip() if marker.exists() else None


def _version(argv: list[str]) -> str | None:
    try:
        return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
