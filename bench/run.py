#!/usr/bin/env python
"""Benchmark harness: django-jobs vs django-tasks-db, side by side, in one run.

    python bench/run.py --jobs 5000 --runs 3 --db postgres,sqlite

For each database engine, each run and each system it creates a fresh
database, runs ``migrate``, then measures (see bench/README.md):

* dispatch jobs/s: N no-op jobs dispatched one by one in autocommit mode;
* dispatch (1 txn) jobs/s: the same inside one ``transaction.atomic()``;
* bulk jobs/s: ``Jobs.bulk(...)`` (django-jobs only: django-tasks-db has none);
* drain jobs/s: N pre-dispatched jobs run by ONE worker process
  (``jobs_work --concurrency 1 --max N`` / ``db_worker --batch --max-tasks N``),
  computed from the rows: (N - 1) / (last finished_at - first finished_at),
  so interpreter start, Django set-up and connecting are excluded for both;
* drain wall jobs/s: N / (worker process start -> exit), start-up included.

Each figure is the median over the runs. The runs alternate which system
goes first. A table is printed and the raw data written to bench/results/.
The harness itself never imports Django: everything Django runs in
subprocesses (bench/driver.py, bench/manage.py) with bench/settings.py.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
SYSTEMS = {"jobs": "django-jobs", "tasksdb": "django-tasks-db"}
ENGINES = ("postgres", "sqlite")


class BenchError(RuntimeError):
    pass


# --- subprocess helpers ------------------------------------------------------


def git(*argv: str) -> str:
    proc = subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BenchError(f"git {' '.join(argv)}: {proc.stderr.strip()}")
    return proc.stdout


def django_jobs_source(args: argparse.Namespace, tmpdir: Path) -> tuple[list[str], dict]:
    """Where the subprocesses import django_jobs from: the working tree, or ``--ref`` exported."""
    if not args.ref:
        try:
            dirty = bool(git("status", "--porcelain", "--", "django_jobs").strip())
            head = git("rev-parse", "HEAD").strip()
        except BenchError:
            dirty, head = None, None
        return [], {"source": "working tree", "head": head, "uncommitted_changes_in_django_jobs": dirty}
    commit = git("rev-parse", "--verify", f"{args.ref}^{{commit}}").strip()
    dest = tmpdir / "src"
    dest.mkdir()
    archive = subprocess.run(["git", "archive", commit, "django_jobs"], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return [str(dest)], {"source": f"git {args.ref}", "commit": commit}


def base_env(args: argparse.Namespace, first_on_path: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        first_on_path + [str(REPO), str(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env["DJANGO_SETTINGS_MODULE"] = "bench.settings"
    env["BENCH_PG_HOST"] = args.pg_host
    env["BENCH_PG_PORT"] = str(args.pg_port)
    env["BENCH_PG_USER"] = args.pg_user
    env.pop("DJANGO_COLORS", None)
    return env


def run_json(cmd: list[str], env: dict[str, str], what: str, timeout: float = 900) -> dict:
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise BenchError(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError) as exc:
        raise BenchError(f"{what}: no JSON result:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}") from exc


def driver(env: dict[str, str], *argv: str) -> dict:
    return run_json([sys.executable, str(HERE / "driver.py"), *argv], env, "driver " + " ".join(argv))


def manage(env: dict[str, str], *argv: str, timeout: float = 900) -> None:
    proc = subprocess.run(
        [sys.executable, str(HERE / "manage.py"), *argv],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise BenchError(f"manage.py {' '.join(argv)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


# --- databases -----------------------------------------------------------------


class Postgres:
    """The harness's own connection to the maintenance database (CREATE/DROP DATABASE, statistics).

    It reconnects once when the server has gone away meanwhile (a restart by
    something else on the machine), rather than losing the whole benchmark.
    """

    def __init__(self, args: argparse.Namespace):
        import psycopg  # the harness needs it only to create/drop databases

        self.psycopg = psycopg
        self.params = {
            "host": args.pg_host,
            "port": args.pg_port,
            "user": args.pg_user,
            "dbname": args.pg_maintenance_db,
            "autocommit": True,
        }
        self.conn = psycopg.connect(**self.params)
        self.prefix = args.pg_prefix
        self.created: set[str] = set()

    def execute(self, sql: str, params: tuple = ()):
        try:
            return self.conn.execute(sql, params)
        except self.psycopg.OperationalError:
            with contextlib.suppress(self.psycopg.Error):  # the old connection is broken anyway
                self.conn.close()
            time.sleep(2)
            self.conn = self.psycopg.connect(**self.params)
            return self.conn.execute(sql, params)

    def version(self) -> str:
        return self.execute("SHOW server_version").fetchone()[0]

    def name(self, system: str) -> str:
        return f"{self.prefix}_{system}"

    def fresh(self, system: str) -> str:
        name = self.name(system)
        self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.execute(f'CREATE DATABASE "{name}"')
        self.created.add(name)
        return name

    def xact_stats(self, name: str) -> dict[str, int]:
        self.execute("SELECT pg_stat_clear_snapshot()")
        row = self.execute(
            "SELECT xact_commit + xact_rollback, tup_inserted, tup_updated, tup_deleted, tup_fetched"
            " FROM pg_stat_database WHERE datname = %s",
            (name,),
        ).fetchone()
        keys = ("transactions", "tup_inserted", "tup_updated", "tup_deleted", "tup_fetched")
        return dict(zip(keys, (int(v) for v in row))) if row else {}

    def drop_all(self) -> None:
        for name in sorted(self.created):
            self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.created.clear()

    def close(self) -> None:
        self.conn.close()


# --- one measurement -------------------------------------------------------------


def drain(
    env: dict[str, str], system: str, n: int, timeout: float, log_path: Path, pg: Postgres | None, dbname: str | None
) -> dict:
    if system == "jobs":
        cmd = [sys.executable, str(HERE / "manage.py"), "jobs_work", "--concurrency", "1", "--max", str(n)]
    else:
        cmd = [
            sys.executable,
            str(HERE / "manage.py"),
            "db_worker",
            "--batch",
            "--no-startup-delay",
            "--no-reload",
            "--max-tasks",
            str(n),
        ]
    before = pg.xact_stats(dbname) if pg and dbname else None
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                rc = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            timed_out = True
        wall = time.perf_counter() - t0
    # let PostgreSQL's cumulative statistics settle (the worker flushed them on exit)
    after = pg.xact_stats(dbname) if pg and dbname else None
    st = driver(env, "stats")
    out = {"cmd": cmd[2:], "returncode": rc, "timed_out": timed_out, "wall_seconds": wall, "rows": st}
    if before and after:
        out["pg_delta"] = {k: after[k] - before[k] for k in before}
    problems = []
    if timed_out:
        problems.append(f"worker did not exit within {timeout:.0f}s")
    if rc not in (0, None) and not timed_out:
        problems.append(f"worker exited with {rc}")
    if st["completed"] != n:
        problems.append(f"{st['completed']} of {n} jobs completed (by status: {st['by_status']})")
    if problems:
        tail = log_path.read_text(errors="replace")[-3000:]
        out["error"] = "; ".join(problems) + "\n--- worker output (tail) ---\n" + tail
    span = st.get("finished_span_seconds")
    if st["completed"] > 1 and span:
        out["jobs_per_s"] = (st["completed"] - 1) / span
    if st["completed"] and wall:
        out["wall_jobs_per_s"] = st["completed"] / wall
    s2 = st.get("started_to_last_finished_seconds")
    if st["completed"] and s2:
        out["started_to_finished_jobs_per_s"] = st["completed"] / s2
    return out


def one_run(
    args, env0, engine: str, cma: str, system: str, run_idx: int, tmpdir: Path, pg: Postgres | None, probe: bool
) -> dict:
    n = args.jobs
    env = dict(env0, BENCH_SYSTEM=system, BENCH_DB=engine, BENCH_CONN_MAX_AGE=cma)
    dbname = None
    if engine == "postgres":
        dbname = pg.fresh(system)
        env["BENCH_PG_NAME"] = dbname
    else:
        path = tmpdir / f"bench_{system}_{cma}_{run_idx}.sqlite3"
        for suffix in ("", "-journal", "-wal", "-shm"):
            Path(str(path) + suffix).unlink(missing_ok=True)
        env["BENCH_SQLITE_PATH"] = str(path)

    result: dict = {
        "engine": engine,
        "conn_max_age": cma,
        "system": system,
        "run": run_idx,
        "loadavg_before": os.getloadavg(),
    }
    t = time.perf_counter()
    manage(env, "migrate", "--noinput", "-v", "0")
    result["migrate_seconds"] = time.perf_counter() - t

    def step(name, fn):
        try:
            result[name] = fn()
        except (BenchError, subprocess.TimeoutExpired) as exc:
            result[name] = {"error": str(exc)}
        return result[name]

    # 1. per-job dispatch (autocommit), then drain those very rows with one worker
    d = step("dispatch", lambda: driver(env, "dispatch", "--mode", "single", "--n", str(n)))
    if "seconds" in d:
        d["jobs_per_s"] = n / d["seconds"]
        if d.get("rows") != n:
            d["error"] = f"expected {n} rows after dispatch, found {d.get('rows')}"
        driver(env, "analyze")
        log = tmpdir / f"worker_{engine}_{cma}_{system}_{run_idx}.log"
        step("drain", lambda: drain(env, system, n, args.timeout, log, pg, dbname))
    driver(env, "clear")

    # 2. per-job dispatch inside one transaction
    d = step("dispatch_atomic", lambda: driver(env, "dispatch", "--mode", "atomic", "--n", str(n)))
    if "seconds" in d:
        d["jobs_per_s"] = n / d["seconds"]
    driver(env, "clear")

    # 3. bulk dispatch (django-jobs: Jobs.bulk, one INSERT)
    if system == "jobs":
        d = step("dispatch_bulk", lambda: driver(env, "dispatch", "--mode", "bulk", "--n", str(n)))
        if "seconds" in d:
            d["jobs_per_s"] = n / d["seconds"]
            if d.get("rows") != n or d.get("returned_ids") != n:
                d["error"] = f"expected {n} rows/ids after Jobs.bulk, found {d.get('rows')}/{d.get('returned_ids')}"
        driver(env, "clear")

    if probe:
        step("probe", lambda: driver(env, "probe", "--n", str(args.probe_jobs)))
    result["loadavg_after"] = os.getloadavg()
    return result


# --- reporting ---------------------------------------------------------------------


METRICS = [
    # key in summary, where in a run, header
    ("dispatch", ("dispatch", "jobs_per_s"), "dispatch/s"),
    ("dispatch_atomic", ("dispatch_atomic", "jobs_per_s"), "dispatch 1-txn/s"),
    ("dispatch_bulk", ("dispatch_bulk", "jobs_per_s"), "bulk/s"),
    ("drain", ("drain", "jobs_per_s"), "drain/s"),
    ("drain_wall", ("drain", "wall_jobs_per_s"), "drain wall/s"),
]


def count_of(runs: list[dict], path: tuple[str, str]) -> int:
    """How many runs produced this figure without error."""
    return sum(
        1
        for r in runs
        if isinstance(r.get(path[0]), dict)
        and "error" not in r[path[0]]
        and isinstance(r[path[0]].get(path[1]), (int, float))
    )


def median_of(runs: list[dict], path: tuple[str, str]) -> float | None:
    values = []
    for r in runs:
        part = r.get(path[0]) or {}
        if "error" in part:
            continue
        v = part.get(path[1])
        if isinstance(v, (int, float)):
            values.append(v)
    return statistics.median(values) if values else None


def variant_label(engine: str, cma: str, many: bool) -> str:
    return f"{engine} CMA={cma}" if many else engine


def summarise(all_runs: list[dict], variants: list[tuple[str, str]], systems: list[str]) -> dict:
    summary: dict = {}
    for engine, cma in variants:
        for system in systems:
            runs = [
                r for r in all_runs if r["engine"] == engine and r.get("conn_max_age") == cma and r["system"] == system
            ]
            s = {key: median_of(runs, path) for key, path, _ in METRICS}
            s["counts"] = {key: count_of(runs, path) for key, path, _ in METRICS}
            s["runs"] = len(runs)
            s["runs_drained_ok"] = sum(
                1 for r in runs if isinstance(r.get("drain"), dict) and "error" not in r["drain"]
            )
            probes = [r["probe"] for r in runs if isinstance(r.get("probe"), dict) and "error" not in r["probe"]]
            if probes:
                s["dispatch_queries_per_job"] = probes[0]["dispatch_queries_per_job"]
                s["drain_queries_per_job"] = probes[0]["drain_queries_per_job"]
            deltas = [
                r["drain"]["pg_delta"] for r in runs if isinstance(r.get("drain"), dict) and r["drain"].get("pg_delta")
            ]
            n = runs[0].get("n") if runs else None
            if deltas and n:
                s["drain_pg_transactions_per_job"] = statistics.median(d["transactions"] for d in deltas) / n
            summary[f"{engine}/{cma}/{system}"] = s
    return summary


def fmt(v: float | None, digits: int = 0) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "n/a"
    return f"{a / b:.2f}x"


def render(summary: dict, variants: list[tuple[str, str]], systems: list[str], n: int, runs: int) -> str:
    many = len({cma for _, cma in variants}) > 1
    head = ["backend", "system"] + [h for _, _, h in METRICS] + ["SQL/job disp/drain", "pg txn/job drain"]
    rows = []

    def cell(s: dict, key: str) -> str:
        # a median over fewer runs than asked for is flagged "(ok/runs)"
        ok = s["counts"][key]
        return fmt(s[key]) + ("" if ok == s["runs"] else f" ({ok}/{s['runs']})")

    for engine, cma in variants:
        label = variant_label(engine, cma, many)
        for system in systems:
            s = summary[f"{engine}/{cma}/{system}"]
            q = "n/a"
            if s.get("dispatch_queries_per_job") is not None:
                q = f"{s['dispatch_queries_per_job']:.1f} / " + (
                    f"{s['drain_queries_per_job']:.1f}" if s.get("drain_queries_per_job") else "n/a"
                )
            bulk = cell(s, "dispatch_bulk") if system == "jobs" else "none"
            txn = fmt(s.get("drain_pg_transactions_per_job"), 1) if engine == "postgres" else ""
            rows.append(
                [
                    label,
                    SYSTEMS[system],
                    cell(s, "dispatch"),
                    cell(s, "dispatch_atomic"),
                    bulk,
                    cell(s, "drain"),
                    cell(s, "drain_wall"),
                    q,
                    txn,
                ]
            )
        if "jobs" in systems and "tasksdb" in systems:
            a, b = summary[f"{engine}/{cma}/jobs"], summary[f"{engine}/{cma}/tasksdb"]
            rows.append(
                [
                    label,
                    "ratio jobs / tasks-db",
                    ratio(a["dispatch"], b["dispatch"]),
                    ratio(a["dispatch_atomic"], b["dispatch_atomic"]),
                    ratio(a["dispatch_bulk"], b["dispatch"]),
                    ratio(a["drain"], b["drain"]),
                    ratio(a["drain_wall"], b["drain_wall"]),
                    "",
                    "",
                ]
            )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = [
        f"{n} no-op jobs, median of {runs} run(s); jobs/s, higher is better"
        + ("" if many else f"; CONN_MAX_AGE={variants[0][1]}")
    ]
    lines.append(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    lines.append("-+-".join("-" * w for w in widths))
    for row in rows:
        lines.append(
            " | ".join(str(c).rjust(w) if i >= 2 else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        )
    lines.append("(k/R): median of the k runs out of R that succeeded; the others failed (see above and the JSON).")
    lines.append("bulk ratio: django-jobs Jobs.bulk vs django-tasks-db per-job enqueue (it has no bulk API).")
    lines.append(
        "drain/s: (N-1) / (last finished_at - first finished_at) from the rows; "
        "drain wall/s: N / worker process lifetime (start-up included)."
    )
    return "\n".join(lines)


def versions(env: dict[str, str]) -> dict:
    code = (
        "import json, django, importlib.metadata as m\n"
        "out={'python': __import__('sys').version.split()[0], 'django': django.get_version()}\n"
        "for d in ('django-tasks-db','psycopg','django-jobs'):\n"
        "    try: out[d]=m.version(d)\n"
        "    except Exception: out[d]=None\n"
        "import django_jobs; out['django_jobs_imported_from']=list(django_jobs.__path__)[0]\n"
        "print(json.dumps(out))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tempfile.gettempdir(), check=False
    )
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"error": proc.stderr[-500:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=5000, help="jobs per measurement (default 5000)")
    parser.add_argument("--runs", type=int, default=3, help="runs per system and database; median reported")
    parser.add_argument("--db", default="postgres,sqlite", help="comma-separated: postgres,sqlite")
    parser.add_argument("--systems", default="jobs,tasksdb", help="comma-separated: jobs,tasksdb")
    parser.add_argument(
        "--conn-max-age",
        default="0",
        help="Django CONN_MAX_AGE for both systems, comma-separated to run several: "
        "0 (Django's default) and/or none (persistent); default 0",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds a worker may take to drain")
    parser.add_argument("--probe-jobs", type=int, default=50, help="jobs for the queries-per-job probe (0: off)")
    parser.add_argument("--pg-host", default=os.environ.get("BENCH_PG_HOST", "127.0.0.1"))
    parser.add_argument("--pg-port", type=int, default=int(os.environ.get("BENCH_PG_PORT", "5432")))
    parser.add_argument("--pg-user", default=os.environ.get("BENCH_PG_USER", "postgres"))
    parser.add_argument(
        "--pg-maintenance-db",
        default="postgres",
        help="database to connect to for CREATE/DROP DATABASE (default postgres)",
    )
    parser.add_argument("--pg-prefix", default="bench", help="prefix of the databases created (bench_jobs, ...)")
    parser.add_argument(
        "--ref",
        help="benchmark django_jobs as committed at this git ref (e.g. HEAD), exported "
        "to the temp dir, instead of the working tree (which may be mid-edit)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the databases and temp dir afterwards")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON results")
    args = parser.parse_args()

    engines = [e.strip() for e in args.db.split(",") if e.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if bad := [e for e in engines if e not in ENGINES]:
        parser.error(f"unknown --db {bad}; choose from {ENGINES}")
    if bad := [s for s in systems if s not in SYSTEMS]:
        parser.error(f"unknown --systems {bad}; choose from {list(SYSTEMS)}")
    cmas = [c.strip().lower() for c in args.conn_max_age.split(",") if c.strip()]
    for c in cmas:
        if c != "none" and not c.isdigit():
            parser.error(f"--conn-max-age: {c!r} is neither a number of seconds nor 'none'")
    variants = [(engine, cma) for cma in cmas for engine in engines]

    tmpdir = Path(tempfile.mkdtemp(prefix="django-jobs-bench-"))
    first_on_path, source = django_jobs_source(args, tmpdir)
    env0 = base_env(args, first_on_path)
    pg = Postgres(args) if "postgres" in engines else None
    started = dt.datetime.now(dt.UTC)
    meta = {
        "started": started.isoformat(),
        "argv": sys.argv,
        "jobs": args.jobs,
        "runs": args.runs,
        "engines": engines,
        "systems": systems,
        "conn_max_age": cmas,
        "python_executable": sys.executable,
        "versions": versions(env0),
        "django_jobs": source,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "sqlite": sqlite3.sqlite_version,
        "postgres": pg.version() if pg else None,
        "tmpdir": str(tmpdir),
    }
    print(
        f"django-jobs bench: {args.jobs} jobs x {args.runs} runs on {', '.join(engines)} "
        f"({sys.executable}; django_jobs from {meta['versions'].get('django_jobs_imported_from')} "
        f"[{source['source']} {source.get('commit') or source.get('head') or ''}]; tmp {tmpdir})",
        flush=True,
    )
    if source.get("uncommitted_changes_in_django_jobs"):
        print("  note: django_jobs/ has uncommitted changes; --ref HEAD benchmarks the committed code", flush=True)

    all_runs: list[dict] = []
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"bench-{started.strftime('%Y%m%dT%H%M%SZ')}.json"

    def save(complete: bool) -> str:
        """Write the JSON; called after every run so an interrupted benchmark keeps what it measured."""
        summary = summarise(all_runs, variants, systems)
        table = render(summary, variants, systems, args.jobs, args.runs)
        meta["complete"] = complete
        meta["finished"] = dt.datetime.now(dt.UTC).isoformat()
        out.write_text(
            json.dumps({"meta": meta, "summary": summary, "table": table, "runs": all_runs}, indent=2, default=str)
        )
        return table

    complete = False
    try:
        for engine, cma in variants:
            label = variant_label(engine, cma, len(cmas) > 1)
            for run_idx in range(args.runs):
                order = systems if run_idx % 2 == 0 else list(reversed(systems))
                for system in order:
                    t = time.perf_counter()
                    try:
                        r = one_run(
                            args,
                            env0,
                            engine,
                            cma,
                            system,
                            run_idx,
                            tmpdir,
                            pg,
                            probe=run_idx == 0 and args.probe_jobs > 0,
                        )
                    except Exception as exc:  # noqa: BLE001 - recorded in the results; the next run goes on
                        r = {
                            "engine": engine,
                            "conn_max_age": cma,
                            "system": system,
                            "run": run_idx,
                            "error": f"{type(exc).__name__}: {exc}",
                        }
                    r["n"] = args.jobs
                    all_runs.append(r)
                    bits = []
                    for key in ("dispatch", "dispatch_atomic", "dispatch_bulk", "drain"):
                        part = r.get(key)
                        if isinstance(part, dict):
                            if "error" in part:
                                bits.append(f"{key}=ERROR")
                            elif "jobs_per_s" in part:
                                bits.append(f"{key}={part['jobs_per_s']:,.0f}/s")
                    if "error" in r:
                        bits.append("ERROR")
                    load = r.get("loadavg_before", (float("nan"),))[0]
                    print(
                        f"  [{label} run {run_idx + 1}/{args.runs}] {SYSTEMS[system]:<15} "
                        f"{' '.join(bits)}  ({time.perf_counter() - t:.1f}s, load {load:.1f})",
                        flush=True,
                    )
                    for key in ("error",):
                        if key in r:
                            print("    " + r[key].replace("\n", "\n    "), flush=True)
                    for key in ("dispatch", "dispatch_atomic", "dispatch_bulk", "drain", "probe"):
                        part = r.get(key)
                        if isinstance(part, dict) and "error" in part:
                            print(f"    {key}: " + str(part["error"]).replace("\n", "\n    ")[:3000], flush=True)
                    save(complete=False)
        complete = True
    finally:
        try:
            if pg:
                if not args.keep:
                    pg.drop_all()
                pg.close()
        except Exception as exc:  # noqa: BLE001 - a failed clean-up must not lose the results
            print(f"warning: could not drop the benchmark databases: {exc}", file=sys.stderr)
        if not args.keep:
            shutil.rmtree(tmpdir, ignore_errors=True)
        table = save(complete)
        print()
        if not complete:
            print("INTERRUPTED: figures below cover the runs that finished")
        print(table)
        print(f"\nresults: {out}")
    failed = [
        r
        for r in all_runs
        if "error" in r
        or any(isinstance(r.get(k), dict) and "error" in r[k] for k in ("dispatch", "dispatch_bulk", "drain"))
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
