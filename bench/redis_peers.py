#!/usr/bin/env python
"""Benchmark: django-jobs' Redis backend vs RQ, Huey and Dramatiq, plus a raw redis-py floor.

    python bench/redis_peers.py --jobs 5000 --runs 3

Same workload for every system, side by side in one run: N no-op jobs are enqueued (timed:
enqueue jobs/s), then ONE worker process with one slot drains them (drain jobs/s, from the
completion timestamps the jobs record themselves: (N - 1) / (last - first), so process start-up,
imports and connecting are excluded for every system). Each figure is the median over the runs;
the order of the systems rotates from run to run. Redis database ``--redis-db`` (12) on
127.0.0.1:6379 is flushed before and after every measurement; no other database is touched.

Systems (what each one guarantees: the "Redis" section of docs/performance.md):

* ``djjobs``   django-jobs, Redis backend: ``manage.py jobs_work --backend redis --concurrency 1
               --max N`` (settings ``peers.settings``, stdout to /dev/null); enqueue with
               ``noop.dispatch()`` and, separately, ``Jobs.bulk``;
* ``rq``       RQ, ``rq worker --burst -w rq.worker.SimpleWorker`` (no fork per job);
* ``rq-fork``  RQ's default forking ``Worker`` (one fork per job; ``--rq-fork-jobs`` jobs, default
               1000, as it is slow: its rate is per job, so comparable);
* ``huey``     Huey ``RedisHuey`` (results off), ``huey_consumer -w 1 -k thread``;
* ``huey-prio`` the same with ``PriorityRedisHuey`` (not in the default set);
* ``dramatiq`` Dramatiq ``RedisBroker``, ``dramatiq --processes 1 --threads 1``;
* ``raw``      a plain redis-py loop doing django-jobs' reliable-queue steps (bench/peers/raw.py):
               the physical floor.

The harness itself imports neither Django nor any queue library: every system runs in
subprocesses (``python -m peers.driver`` to enqueue, each system's own worker command to drain)
with ``PYTHONPATH=<repo root>:bench``. It prints one line per measurement, then the table, and
writes everything to ``bench/results/redis-peers-<UTC time>.json``. It exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

from run import BenchError, django_jobs_source

SYSTEMS = {
    "djjobs": "django-jobs (redis)",
    "rq": "RQ SimpleWorker",
    "rq-fork": "RQ Worker (fork/job)",
    "huey": "Huey RedisHuey",
    "huey-prio": "Huey PriorityRedisHuey",
    "dramatiq": "Dramatiq RedisBroker",
    "raw": "raw redis-py loop",
}
DEFAULT_SYSTEMS = "djjobs,rq,rq-fork,huey,dramatiq,raw"
PEERS = {"rq", "rq-fork", "huey", "huey-prio", "dramatiq"}  # what the 1.5x target is measured against
BULK = {"djjobs", "rq", "raw"}  # systems with a batch enqueue API
# Key prefixes the systems use: a database holding anything else is not ours to flush.
OUR_PREFIXES = ("bench_jobs:", "bench_raw:", "bench_dramatiq:", "rq:", "huey.")
TARGET_PEER_RATIO = 1.5
TARGET_RAW_RATIO = 0.5


# --- Redis (the harness talks to it only to check, flush and count keys) ---------------------------


class Redis:
    def __init__(self, host: str, port: int, db: int) -> None:
        import redis  # redis-py: a django-jobs [redis] dependency, installed in the venv

        self.db = db
        self.client = redis.Redis(host=host, port=port, db=db)
        self.client.ping()

    def foreign_keys(self) -> list[str]:
        found = []
        for key in self.client.scan_iter(count=1000):
            name = key.decode(errors="replace")
            if not name.startswith(OUR_PREFIXES):
                found.append(name)
                if len(found) >= 5:
                    break
        return found

    def flush(self) -> None:
        self.client.flushdb()  # this database only (FLUSHDB, never FLUSHALL)

    def version(self) -> str:
        return self.client.info("server")["redis_version"]

    def dbsize(self) -> int:
        return int(self.client.dbsize())


# --- subprocesses ------------------------------------------------------------------------------------


def subprocess_env(args: argparse.Namespace, first_on_path: list[str], sqlite_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        first_on_path + [str(REPO), str(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env["DJANGO_SETTINGS_MODULE"] = "peers.settings"
    env["BENCH_SQLITE_PATH"] = str(sqlite_path)
    env["BENCH_REDIS_HOST"] = args.redis_host
    env["BENCH_REDIS_PORT"] = str(args.redis_port)
    env["BENCH_REDIS_DB"] = str(args.redis_db)
    env.pop("BENCH_TS_FILE", None)
    env.pop("BENCH_HUEY_PRIORITY", None)
    env.pop("DJANGO_COLORS", None)
    return env


def run_json(cmd: list[str], env: dict[str, str], what: str, timeout: float = 600) -> dict:
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise BenchError(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError) as exc:
        raise BenchError(f"{what}: no JSON result:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}") from exc


def enqueue(env: dict[str, str], system: str, n: int, mode: str) -> dict:
    out = run_json(
        [sys.executable, "-m", "peers.driver", "enqueue", "--system", system, "--mode", mode, "--n", str(n)],
        env,
        f"enqueue {system} {mode}",
    )
    if out.get("queued") != n:
        raise BenchError(f"enqueue {system} {mode}: the broker reports {out.get('queued')} queued, expected {n}")
    out["jobs_per_s"] = n / out["seconds"]
    return out


def worker_command(system: str, n: int, args: argparse.Namespace) -> tuple[list[str], bool, int | None]:
    """(argv, exits by itself after N jobs, signal for a graceful stop otherwise)."""
    py = sys.executable
    url = f"redis://{args.redis_host}:{args.redis_port}/{args.redis_db}"
    if system == "djjobs":
        return (
            [py, str(HERE / "manage.py"), "jobs_work", "--backend", "redis", "--concurrency", "1", "--max", str(n)],
            True,
            None,
        )
    if system == "rq":
        return (
            [py, "-m", "rq.cli", "worker", "--burst", "-w", "rq.worker.SimpleWorker", "--url", url, "default"],
            True,
            None,
        )
    if system == "rq-fork":
        return [py, "-m", "rq.cli", "worker", "--burst", "--url", url, "default"], True, None
    if system in ("huey", "huey-prio"):
        # SIGINT: graceful (finish the running task); SIGTERM would be immediate.
        return (
            [py, "-m", "huey.bin.huey_consumer", "peers.huey_app.huey", "-w", "1", "-k", "thread"],
            False,
            signal.SIGINT,
        )
    if system == "dramatiq":
        return [py, "-m", "dramatiq", "peers.dramatiq_app", "--processes", "1", "--threads", "1"], False, signal.SIGTERM
    if system == "raw":
        return [py, "-m", "peers.raw", "work", "--n", str(n)], True, None
    raise ValueError(system)


def count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as fh:
            return fh.read().count(b"\n")
    except FileNotFoundError:
        return 0


def drain(
    env: dict[str, str],
    system: str,
    n: int,
    args: argparse.Namespace,
    tmpdir: Path,
    label: str,
    count_roundtrips: bool = False,
) -> dict:
    """Start one worker process on N queued jobs; the jobs' own timestamps give the rate."""
    ts_file = tmpdir / f"{label}.ts"
    log_file = tmpdir / f"{label}.log"
    ts_file.unlink(missing_ok=True)
    wenv = dict(env, BENCH_TS_FILE=str(ts_file))
    if system == "huey-prio":
        wenv["BENCH_HUEY_PRIORITY"] = "1"
    if count_roundtrips:
        wenv["BENCH_COUNT_ROUNDTRIPS"] = "1"
    argv, exits, stop_signal = worker_command(system, n, args)
    with open(log_file, "wb") as log:
        started = time.time()
        # Own session: a stop signal or a kill reaches the worker's own children too (dramatiq forks).
        proc = subprocess.Popen(argv, env=wenv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        deadline = time.monotonic() + args.timeout
        stopped_by = "exit"
        try:
            while True:
                done = count_lines(ts_file)
                if done >= n:
                    break
                if proc.poll() is not None:
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            if proc.poll() is None:
                if done >= n and exits:
                    try:  # it stops by itself after N jobs: give it the time to
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        stopped_by = "kill (did not exit after N jobs)"
                elif done >= n:
                    stopped_by = f"signal {signal.Signals(stop_signal).name}"
                    os.killpg(proc.pid, stop_signal)
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        stopped_by += " + kill"
                else:
                    stopped_by = "kill (timeout)"
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    ended = time.time()
    rows = [line.split() for line in ts_file.read_text().splitlines() if line.strip()] if ts_file.exists() else []
    stamps = sorted(float(row[0]) for row in rows)
    out: dict = {
        "argv": argv,
        "stopped_by": stopped_by,
        "exit_code": proc.returncode,
        "completed": len(stamps),
        "worker_started": started,
        "worker_ended": ended,
    }
    if count_roundtrips and len(rows) > 1 and all(len(row) == 4 for row in rows):
        # Running totals of the worker process, written by the jobs: between the first and the
        # last job, (N - 1) jobs' worth of fetch -> run -> settle cycles.
        first, last = min(rows, key=lambda row: float(row[0])), max(rows, key=lambda row: float(row[0]))
        out["roundtrips_per_job"] = (int(last[1]) - int(first[1])) / (len(rows) - 1)
        out["commands_per_job"] = (int(last[2]) - int(first[2])) / (len(rows) - 1)
        out["cpu_us_per_job"] = (float(last[3]) - float(first[3])) / (len(rows) - 1) * 1e6
    if stamps:
        out["first_done"], out["last_done"] = stamps[0], stamps[-1]
    problems = []
    if len(stamps) != n:
        problems.append(f"{len(stamps)} job completions recorded, expected exactly {n}")
    if stopped_by.startswith("kill"):
        problems.append(f"worker stopped by {stopped_by}")
    if exits and proc.returncode not in (0, None) and not stopped_by.startswith("kill"):
        problems.append(f"worker exited {proc.returncode}")
    if problems:
        tail = log_file.read_text(errors="replace")[-3000:] if log_file.exists() else ""
        out["error"] = "; ".join(problems) + ("\n" + tail if tail else "")
        return out
    span = stamps[-1] - stamps[0]
    out["span_seconds"] = span
    out["jobs_per_s"] = (n - 1) / span if span > 0 else None
    out["wall_jobs_per_s"] = n / (stamps[-1] - started)  # start-up included, shutdown excluded
    return out


def one_measurement(
    args: argparse.Namespace, env: dict[str, str], system: str, run_idx: int, tmpdir: Path, rds: Redis
) -> dict:
    n = args.rq_fork_jobs if system == "rq-fork" else args.jobs
    r: dict = {"system": system, "run": run_idx, "n": n, "loadavg_before": list(os.getloadavg())}
    rds.flush()
    try:
        r["enqueue"] = enqueue(env, system, n, "single")
        r["drain"] = drain(env, system, n, args, tmpdir, f"{system}-{run_idx}")
        r["keys_left"] = rds.dbsize()
        if system in BULK and system != "rq-fork":
            rds.flush()
            r["enqueue_bulk"] = enqueue(env, system, n, "bulk")
        if run_idx == 0 and args.probe_jobs > 1 and system != "rq-fork":
            # Untimed: redis-py instrumented in the worker (see peers/common.py).
            rds.flush()
            enqueue(env, system, args.probe_jobs, "single")
            r["probe"] = drain(env, system, args.probe_jobs, args, tmpdir, f"{system}-probe", count_roundtrips=True)
    except (BenchError, subprocess.TimeoutExpired) as exc:
        r["error"] = str(exc)
    finally:
        rds.flush()
    r["loadavg_after"] = list(os.getloadavg())
    return r


# --- summary -----------------------------------------------------------------------------------------


def value(r: dict, key: str, field: str = "jobs_per_s") -> float | None:
    part = r.get(key)
    if "error" in r or not isinstance(part, dict) or "error" in part:
        return None
    return part.get(field)


def summarise(all_runs: list[dict], systems: list[str]) -> dict:
    summary = {}
    for system in systems:
        runs = [r for r in all_runs if r["system"] == system]
        s: dict = {"runs": len(runs), "n": runs[0]["n"] if runs else None}
        for name, key, field in (
            ("enqueue", "enqueue", "jobs_per_s"),
            ("bulk", "enqueue_bulk", "jobs_per_s"),
            ("drain", "drain", "jobs_per_s"),
            ("drain_wall", "drain", "wall_jobs_per_s"),
            ("roundtrips_per_job", "probe", "roundtrips_per_job"),
            ("commands_per_job", "probe", "commands_per_job"),
            ("cpu_us_per_job", "probe", "cpu_us_per_job"),
        ):
            vals = [v for v in (value(r, key, field) for r in runs) if v is not None]
            s[name] = statistics.median(vals) if vals else None
            s[f"{name}_ok"] = len(vals)
            s[f"{name}_all"] = vals
        summary[system] = s
    return summary


def fmt(v: float | None, digits: int = 0) -> str:
    return "n/a" if v is None else f"{v:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def targets(summary: dict) -> dict:
    jobs = summary.get("djjobs", {}).get("drain")
    peers = {s: v["drain"] for s, v in summary.items() if s in PEERS and v.get("drain")}
    out: dict = {"djjobs_drain": jobs}
    if peers:
        best = max(peers, key=peers.get)
        out["fastest_peer"] = best
        out["fastest_peer_drain"] = peers[best]
        if jobs:
            out["ratio_vs_fastest_peer"] = jobs / peers[best]
            out["peer_target_met"] = jobs / peers[best] >= TARGET_PEER_RATIO
    raw = summary.get("raw", {}).get("drain")
    if raw and jobs:
        out["ratio_vs_raw"] = jobs / raw
        out["raw_target_met"] = jobs / raw >= TARGET_RAW_RATIO
    return out


def render(summary: dict, systems: list[str], args: argparse.Namespace) -> str:
    base = summary.get("djjobs", {})
    head = [
        "system",
        "enqueue/s",
        "bulk/s",
        "drain/s",
        "drain wall/s",
        "round trips/job",
        "cmds/job",
        "worker CPU us/job",
        "django-jobs/system enqueue",
        "django-jobs/system drain",
    ]
    rows = []
    for system in systems:
        s = summary[system]

        def cell(key: str, digits: int = 0, s: dict = s) -> str:
            flag = "" if s[f"{key}_ok"] == s["runs"] else f" ({s[f'{key}_ok']}/{s['runs']})"
            return fmt(s[key], digits) + flag

        name = SYSTEMS[system] + (f" [N={s['n']}]" if s["n"] != args.jobs else "")
        bulk = cell("bulk") if system in BULK and system != "rq-fork" else "none"
        rows.append(
            [
                name,
                cell("enqueue"),
                bulk,
                cell("drain"),
                cell("drain_wall"),
                fmt(s["roundtrips_per_job"], 2),
                fmt(s["commands_per_job"], 2),
                fmt(s["cpu_us_per_job"]),
                "" if system == "djjobs" else ratio(base.get("enqueue"), s["enqueue"]),
                "" if system == "djjobs" else ratio(base.get("drain"), s["drain"]),
            ]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = [
        (
            f"{args.jobs} no-op jobs, one worker process with one slot, median of {args.runs} run(s); "
            "jobs/s, higher is better"
        )
    ]
    lines.append(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    lines.append("-+-".join("-" * w for w in widths))
    for row in rows:
        lines.append(" | ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    t = targets(summary)
    if "ratio_vs_fastest_peer" in t:
        lines.append(
            f"target drain >= {TARGET_PEER_RATIO}x the fastest peer ({SYSTEMS[t['fastest_peer']]}): "
            f"{t['ratio_vs_fastest_peer']:.2f}x -> {'met' if t['peer_target_met'] else 'MISSED'}"
        )
    if "ratio_vs_raw" in t:
        lines.append(
            f"target drain >= {TARGET_RAW_RATIO}x the raw redis-py loop: "
            f"{t['ratio_vs_raw']:.2f}x -> {'met' if t['raw_target_met'] else 'MISSED'}"
        )
    lines.append(
        "drain/s: (N-1) / (last - first job completion), timestamps written by the jobs; "
        "drain wall/s: N / (worker start -> last completion)."
    )
    lines.append(
        "round trips/job, cmds/job, worker CPU us/job: requests sent (a pipeline is one), replies read "
        "and CPU time (user + sys, all threads) of the worker process per job, between its first and "
        "last job (untimed probe, redis-py instrumented)."
    )
    lines.append("(k/R): median of the k runs out of R that succeeded.")
    return "\n".join(lines)


def versions(env: dict[str, str]) -> dict:
    code = (
        "import json, sys, importlib.metadata as m\n"
        "out={'python': sys.version.split()[0]}\n"
        "for d in ('django','django-jobs','redis','hiredis','rq','huey','dramatiq'):\n"
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
    parser.add_argument("--runs", type=int, default=3, help="runs per system; medians reported (default 3)")
    parser.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma-separated, from {','.join(SYSTEMS)}")
    parser.add_argument(
        "--rq-fork-jobs",
        type=int,
        default=1000,
        help="jobs for RQ's forking worker, which forks once per job (default 1000)",
    )
    parser.add_argument("--redis-host", default=os.environ.get("BENCH_REDIS_HOST", "127.0.0.1"))
    parser.add_argument("--redis-port", type=int, default=int(os.environ.get("BENCH_REDIS_PORT", "6379")))
    parser.add_argument(
        "--redis-db",
        type=int,
        default=int(os.environ.get("BENCH_REDIS_DB", "12")),
        help="dedicated database number, flushed between runs (default 12)",
    )
    parser.add_argument(
        "--force-flush", action="store_true", help="flush --redis-db even if it holds keys that are not the benchmark's"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds a worker may take to drain")
    parser.add_argument(
        "--probe-jobs",
        type=int,
        default=500,
        help="jobs for the untimed round-trips-per-job probe, first run only (0: off)",
    )
    parser.add_argument("--ref", help="benchmark django_jobs as committed at this git ref (e.g. HEAD)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, timestamps)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON results")
    args = parser.parse_args()

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if bad := [s for s in systems if s not in SYSTEMS]:
        parser.error(f"unknown --systems {bad}; choose from {list(SYSTEMS)}")
    rds = Redis(args.redis_host, args.redis_port, args.redis_db)
    if (foreign := rds.foreign_keys()) and not args.force_flush:
        print(
            f"Redis db {args.redis_db} holds keys that are not the benchmark's ({', '.join(foreign)}, ...): "
            "pick another --redis-db or pass --force-flush",
            file=sys.stderr,
        )
        return 2

    tmpdir = Path(tempfile.mkdtemp(prefix="django-jobs-redis-bench-"))
    first_on_path, source = django_jobs_source(args, tmpdir)
    env = subprocess_env(args, first_on_path, tmpdir / "audit.sqlite3")
    started = dt.datetime.now(dt.UTC)
    meta = {
        "started": started.isoformat(),
        "argv": sys.argv,
        "jobs": args.jobs,
        "runs": args.runs,
        "rq_fork_jobs": args.rq_fork_jobs,
        "systems": systems,
        "python_executable": sys.executable,
        "versions": versions(env),
        "redis_server": rds.version(),
        "redis_db": args.redis_db,
        "django_jobs": source,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "tmpdir": str(tmpdir),
    }
    print(
        f"django-jobs redis bench: {args.jobs} jobs x {args.runs} runs, Redis {meta['redis_server']} "
        f"db {args.redis_db} ({sys.executable}; django_jobs from "
        f"{meta['versions'].get('django_jobs_imported_from')} [{source['source']} "
        f"{source.get('commit') or source.get('head') or ''}]; tmp {tmpdir})",
        flush=True,
    )
    if source.get("uncommitted_changes_in_django_jobs"):
        print("  note: django_jobs/ has uncommitted changes; --ref HEAD benchmarks the committed code", flush=True)

    all_runs: list[dict] = []
    try:
        subprocess.run(
            [sys.executable, str(HERE / "manage.py"), "migrate", "-v0"],
            env=env,
            cwd=REPO,
            check=True,
            capture_output=True,
        )  # the audit table (written only on failures)
        for run_idx in range(args.runs):
            shift = run_idx % len(systems)
            order = systems[shift:] + systems[:shift]  # rotate who goes first
            for system in order:
                t = time.perf_counter()
                r = one_measurement(args, env, system, run_idx, tmpdir, rds)
                all_runs.append(r)
                bits = []
                for key, field, label in (
                    ("enqueue", "jobs_per_s", "enqueue"),
                    ("enqueue_bulk", "jobs_per_s", "bulk"),
                    ("drain", "jobs_per_s", "drain"),
                    ("probe", "roundtrips_per_job", "rt/job"),
                    ("probe", "commands_per_job", "cmds/job"),
                    ("probe", "cpu_us_per_job", "cpu_us/job"),
                ):
                    part = r.get(key)
                    if isinstance(part, dict):
                        if "error" in part:
                            bits.append(f"{label}=ERROR")
                        elif part.get(field) is not None:
                            per_job = label.endswith("/job")
                            digits = 2 if per_job and "cpu" not in label else 0
                            bits.append(f"{label}={part[field]:,.{digits}f}" + ("" if per_job else "/s"))
                print(
                    f"  [run {run_idx + 1}/{args.runs}] {SYSTEMS[system]:<24} {' '.join(bits)}"
                    f"  ({time.perf_counter() - t:.1f}s, load {r['loadavg_before'][0]:.2f})",
                    flush=True,
                )
                for key in ("error",):
                    if key in r:
                        print("    " + r[key].replace("\n", "\n    ")[:3000], flush=True)
                for key in ("enqueue", "enqueue_bulk", "drain", "probe"):
                    part = r.get(key)
                    if isinstance(part, dict) and "error" in part:
                        print(f"    {key}: " + str(part["error"]).replace("\n", "\n    ")[:3000], flush=True)
    finally:
        rds.flush()
        if not args.keep:
            shutil.rmtree(tmpdir, ignore_errors=True)

    summary = summarise(all_runs, systems)
    table = render(summary, systems, args)
    print()
    print(table)
    meta["finished"] = dt.datetime.now(dt.UTC).isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"redis-peers-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(
        json.dumps(
            {"meta": meta, "summary": summary, "targets": targets(summary), "table": table, "runs": all_runs},
            indent=2,
            default=str,
        )
    )
    print(f"\nresults: {out}")
    failed = [
        r
        for r in all_runs
        if "error" in r
        or any(isinstance(r.get(k), dict) and "error" in r[k] for k in ("enqueue", "enqueue_bulk", "drain"))
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
