"""Scenario ``dbrestart``: the database (and on Redis the redis-server) crash-restarts while jobs
several times longer than ``LEASE_TIMEOUT`` run, and while the workers are idle.

Phases (each with a fresh fleet of three workers; first a warm-up of three 1 s jobs that fail,
one per worker, so each worker has recorded a failure and holds a database connection before the
restart; then six long jobs, two per worker (three, one per worker, with ``--short``)):

- ``db-running``: the private PostgreSQL server is crash-restarted (SIGKILL of every server
  process, ``--outage`` seconds down, WAL replay) while each worker is a few lease periods into a
  long job. The next three jobs start after it, on the workers' reconnected connections.
- ``db-idle``: the server is crash-restarted while the workers wait for work; once it answers
  again, the six long jobs are dispatched.
- ``redis-running`` (redis backend only): the private redis-server is crash-restarted (AOF
  replay) while the long jobs run.

On every backend the database matters: it holds the jobs of the database backend, and on Redis
and beanstalkd the failed-job rows (the audit record of a permanent failure) and the side-effect
tables. The jobs write their start marker and side effect through a connection of their own,
retried through the outage (``durable`` in bench/chaos/jobs.py), so only the worker's own
handling of the restart shows in the figures.

The six jobs of a phase, in dispatch order (the first three start together, one per worker):
``ok`` with ``max_retries=0``, ``ok`` with ``max_retries=3``, ``fail_late`` (sleeps as long,
then raises) with ``max_retries=0``, then the same three again. What each must do:

- ``ok``: run exactly once and end completed. With ``max_retries=0`` a lease reaped while the
  body still runs ends the job failed although its body completes (``completed_work_recorded_
  failed``); with ``max_retries=3`` it makes the job run again (a duplicate).
- ``fail_late``: run exactly once and end failed, with its failed row (written to the database
  after the restart; on Redis and beanstalkd the row is the admin's record of the failure, beside
  the broker's failed set or buried job).

Figures per phase: jobs lost (no final record: an ``ok`` job neither completed with its side
effect nor failed with its row, a ``fail_late`` job without its failed row that the broker does
not keep either), ``failed_rows_missing`` (failures with no failed row), duplicates (runs
beyond one per job) with their cause, ``completed_work_recorded_failed`` (a side effect written,
yet the job ended failed), ``ok_jobs_failed``, ``fail_late_recorded_with_another_error`` (its
failed row blames a lost worker, not its own exception), ``ran_exactly_once``, the time from the
server's return to the next run's start, and the workers' log lines about the outage.
"""

from __future__ import annotations

import itertools
import re
import time
from collections import Counter
from typing import Any

from .attribution import attribute
from .probe import runs_by_job, sql
from .scenarios import Context, Event, build, enqueue, log, worker_health, worker_log_counts
from .workers import Fleet, group_pids

LOG_LINE = re.compile(r"^(\d+\.\d+) (\d+) (WARNING|ERROR|CRITICAL) (\S+) (.*)$")
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Lost|Shutdown|Timeout)\b")


def dbrestart(ctx: Context) -> dict[str, Any]:
    if ctx.database is None:
        raise RuntimeError("dbrestart restarts the database: it needs the private PostgreSQL (not --pg-external)")
    job_s = 6.0 if ctx.short else 7.0
    phases: list[tuple[str, str, str]] = [("db-running", "database", "running"), ("db-idle", "database", "idle")]
    if ctx.kind == "redis":
        phases.append(("redis-running", "redis", "running"))
    result: dict[str, Any] = {
        "lease_timeout": ctx.lease,
        "job_s": job_s,
        "outage_s": ctx.outage,
        "jobs_per_phase": len(_jobs(ctx.short)) + 3,
        "warmup_jobs_per_phase": 3,
        "phases": {},
    }
    for name, target, when in phases:
        log(f"dbrestart: phase {name} ({target} restarted while the workers are {when})")
        result["phases"][name] = _phase(ctx, name, target, when, job_s)
    totals: Counter[str] = Counter()
    for figures in result["phases"].values():
        for key in (
            "jobs",
            "lost",
            "duplicate_runs",
            "completed_work_recorded_failed",
            "failed_rows_missing",
            "ok_jobs_failed",
            "fail_late_recorded_with_another_error",
            "ran_exactly_once",
        ):
            totals[key] += figures[key]
    result["totals"] = dict(totals)
    return result


def _server(ctx: Context, target: str) -> Any:
    return ctx.database if target == "database" else ctx.server


def _jobs(short: bool) -> list[tuple[str, int]]:
    return [("ok", 0), ("ok", 3), ("fail_late", 0)] * (1 if short else 2)


def _phase(ctx: Context, name: str, target: str, when: str, job_s: float) -> dict[str, Any]:
    ctx.probe.reset()
    spec = _jobs(ctx.short)
    envelopes = [build(action, job_s * 1000, max_retries=retries, durable=True) for action, retries in spec]
    # Warm-up: one 1 s job per worker that fails, so every worker has written a failed row (and
    # holds a database connection in its main thread) before the restart: the failures after it
    # are then recorded through a connection the restart broke, on every backend.
    warmup = [build("fail_late", 1000, max_retries=0, durable=True) for _ in range(3)]
    kinds = {e.id: (action, retries) for e, (action, retries) in zip(envelopes, spec, strict=True)}
    kinds.update({e.id: ("fail_late", 0) for e in warmup})
    ids = [e.id for e in warmup] + [e.id for e in envelopes]
    # Long jobs, one per worker in hand at the restart: run as long jobs should be, one claimed
    # at a time (with batches, one worker would claim them all ahead).
    fleet: Fleet = ctx.fleet(f"dbrestart-{name}", prefetch=1)
    server = _server(ctx, target)
    events: list[Event] = []
    origin = time.time()
    try:
        fleet.start_all()
        origin = time.time()
        enqueue(ctx, warmup)
        _wait_recorded(ctx, [e.id for e in warmup], timeout=60)
        if when == "running":
            enqueue(ctx, envelopes)
            children = {pid for inc in fleet.live() for pid in inc.children()}
            _wait_in_flight(children, timeout=60)
            # A few lease periods into the runs: the heartbeat has extended each lease already.
            time.sleep(min(1.25 * ctx.lease, job_s / 2))
            pids = [p for inc in fleet.live() for p in group_pids(inc.pid)]
            log(f"dbrestart: crash-restarting the {target} server under {len(children)} running long jobs")
            down, up = server.restart(ctx.outage)
        else:
            time.sleep(max(2.0, ctx.lease))  # idle: polling, reaping, waiting for work
            pids = [p for inc in fleet.live() for p in group_pids(inc.pid)]
            log(f"dbrestart: crash-restarting the {target} server while the workers are idle")
            down, up = server.restart(ctx.outage)
            time.sleep(0.5)
            enqueue(ctx, envelopes)
        events.append(Event("restart", down, up, pids, mode=f"{target} {when}"))
        log(f"dbrestart: {target} back after {up - down:.1f}s; waiting for the jobs to settle")
        ctx.probe.backend.close()
        settled = _wait_settled(ctx, fleet, job_s, timeout=min(ctx.timeout, 240))
        exit_codes = fleet.stop_all()
    finally:
        fleet.kill_everything()
    return _analyse(ctx, fleet, ids, kinds, events, origin, settled, exit_codes, job_s)


def _wait_recorded(ctx: Context, ids: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(ctx.probe.failed_rows(ids)) == len(ids):
            return
        time.sleep(0.1)
    raise RuntimeError(f"the warm-up jobs were not all recorded failed within {timeout:g}s")


def _open_runs() -> list[tuple[str, int, float]]:
    return [
        tuple(row)
        for row in sql(
            "SELECT r.job_id, r.pid, r.started_at FROM chaos_run r WHERE NOT EXISTS ("
            "SELECT 1 FROM chaos_effect e WHERE e.token = r.token)"
        )
    ]


def _wait_in_flight(children: set[int], timeout: float) -> None:
    """Until every worker process has a run in hand (a start marker without a side effect)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if children <= {pid for _j, pid, _s in _open_runs()}:
            return
        time.sleep(0.05)
    raise RuntimeError(f"the workers did not all start a long job within {timeout:g}s")


def _wait_settled(ctx: Context, fleet: Fleet, job_s: float, timeout: float) -> bool:
    """Until nothing is queued or leased and no run can still be going (a run whose lease was
    reaped while it ran included): every ``ok`` run has written its side effect (or started
    more than a job's length plus 5 s ago), and every ``fail_late`` run is its job's last run
    with the failed row written (or started more than a job's length plus 1 s ago)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for inc in fleet.poll_exits():
            log(f"dbrestart: worker slot {inc.slot} exited unexpectedly ({inc.exit_code}); restarting it")
            fleet.start(inc.slot, wait=False)
        if ctx.probe.backlog() == 0 and not _runs_going(ctx, job_s):
            return True
        time.sleep(0.25)
    log("dbrestart: TIMEOUT waiting for the jobs to settle")
    return False


def _runs_going(ctx: Context, job_s: float) -> bool:
    rows = sql(
        "SELECT r.job_id, r.action, r.started_at, EXISTS (SELECT 1 FROM chaos_effect e WHERE e.token = r.token) "
        "FROM chaos_run r"
    )
    latest: dict[str, float] = {}
    for job_id, _action, started, _done in rows:
        latest[job_id] = max(latest.get(job_id, 0.0), started)
    failed = ctx.probe.failed_rows(list(latest))
    now = time.time()
    for job_id, action, started, done in rows:
        if action == "ok" and not done and started > now - job_s - 5:
            return True
        recorded = job_id in failed and started == latest[job_id]
        if action == "fail_late" and started > now - job_s - 1 and not recorded:
            return True
    return False


def _results_by_job(fleet: Fleet) -> dict[str, list[str]]:
    """The workers' per-job result lines: job id -> [status, ...] in print order."""
    out: dict[str, list[str]] = {}
    for line in fleet.lines("out"):
        parts = line.split()
        if len(parts) >= 2 and not line.startswith(("django-jobs worker started", "django-jobs worker stopped")):
            out.setdefault(parts[1], []).append(parts[0])
    return out


def _log_lines(fleet: Fleet, origin: float, limit: int = 40) -> list[str]:
    """WARNING+ lines of the workers (time relative to the phase start), each with the last line
    of its traceback when it has one."""
    lines: list[str] = []
    for inc in fleet.history:
        if not inc.err.exists():
            continue
        text = inc.err.read_text(errors="replace").splitlines()
        for i, line in enumerate(text):
            match = LOG_LINE.match(line)
            if not match:
                continue
            t, pid, level, _logger, message = match.groups()
            tail = ""
            j = i + 1
            while j < len(text) and not LOG_LINE.match(text[j]):
                j += 1
            if j > i + 1 and text[i + 1].startswith("Traceback"):
                # The exception line (its message may go on over more lines).
                raised = [k for k in range(i + 2, j) if EXCEPTION_LINE.match(text[k])]
                tail = " | " + (text[raised[-1]].strip() if raised else text[j - 1].strip())
            lines.append(f"{float(t) - origin:+.2f}s pid {pid} {level} {message}{tail}")
    lines.sort(key=lambda s: float(s.split("s", 1)[0]))
    if len(lines) > limit:
        return [*lines[: limit // 2], f"... {len(lines) - limit} more ...", *lines[-limit // 2 :]]
    return lines


def _analyse(
    ctx: Context,
    fleet: Fleet,
    ids: list[str],
    kinds: dict[str, tuple[str, int]],
    events: list[Event],
    origin: float,
    settled: bool,
    exit_codes: dict[int, int | None],
    job_s: float,
) -> dict[str, Any]:
    runs = runs_by_job(ids)
    effect_rows = sql("SELECT job_id, token, attempt, pid, started_at, done_at FROM chaos_effect")
    done_by_token = {token: done for _j, token, _a, _p, _s, done in effect_rows}
    tokens = {
        (job_id, pid, started): token
        for job_id, pid, started, token in sql("SELECT job_id, pid, started_at, token FROM chaos_run")
    }
    states = ctx.probe.final_states(ids)
    failed = ctx.probe.failed_rows(ids)
    results = _results_by_job(fleet)
    event_log = [e.as_dict(origin) for e in events]
    restart = events[0] if events else None

    jobs: list[dict[str, Any]] = []
    lost = duplicate_runs = recorded_failed = exactly_once = ok_failed = other_error = rows_missing = 0
    by_cause: Counter[str] = Counter()
    for job_id in ids:
        action, retries = kinds[job_id]
        job_runs = []
        for attempt, pid, started, _action in runs.get(job_id, []):
            done = done_by_token.get(tokens.get((job_id, pid, started)))
            job_runs.append(
                {
                    "attempt": attempt,
                    "pid": pid,
                    "started": round(started - origin, 3),
                    "done": round(done - origin, 3) if done is not None else None,
                }
            )
        completed_runs = [r for r in job_runs if r["done"] is not None]
        state = states.get(job_id)
        if action == "ok":
            # No final record: neither completed with its side effect nor failed with its row.
            is_lost = not ((state == "completed" and completed_runs) or (state == "failed" and job_id in failed))
            if state == "failed":
                ok_failed += 1
            lost += is_lost
        else:
            # Counted below: on Redis and beanstalkd the broker keeps the failure too.
            is_lost = job_id not in failed
            rows_missing += is_lost
            if not is_lost and not failed[job_id][1].startswith("RuntimeError: fail_late"):
                other_error += 1
        if completed_runs and state == "failed":
            recorded_failed += 1
        if len(job_runs) == 1:
            exactly_once += 1
        extra = max(len(job_runs) - 1, 0)
        duplicate_runs += extra
        cause = None
        if extra:
            cause = _cause(job_runs, job_s, event_log)
            by_cause[cause] += 1
        jobs.append(
            {
                "id": job_id,
                "action": action,
                "max_retries": retries,
                "runs": job_runs,
                "state": state,
                "failed_row": failed.get(job_id),
                "results": results.get(job_id, []),
                "lost": bool(is_lost),
                "duplicate_cause": cause,
            }
        )
    # A failure with no failed row is lost unless the broker keeps it (the Redis failed set, a
    # buried beanstalkd job); on the database backend the row is the failure.
    n_failures = sum(1 for j in ids if kinds[j][0] == "fail_late")
    kept = ctx.probe.kept_failed() if ctx.kind != "postgres" else n_failures - rows_missing
    lost += max(0, n_failures - kept) if ctx.kind != "postgres" else rows_missing
    resume = None
    if restart is not None:
        later = [s for job_runs in runs.values() for _a, _p, s, _x in job_runs if s > restart.t1]
        resume = round(min(later) - restart.t1, 3) if later else None
    counts = worker_log_counts(fleet)
    err = fleet.lines("err")
    counts["heartbeat_failed_lines"] = sum(1 for line in err if "heartbeat failed" in line)
    counts["waiting_for_work_failed_lines"] = sum(1 for line in err if "waiting for work failed" in line)
    return {
        "jobs": len(ids),
        "settled": settled,
        "lost": lost,
        "duplicate_runs": duplicate_runs,
        "duplicates_by_cause": dict(by_cause),
        "completed_work_recorded_failed": recorded_failed,
        "failed_rows_missing": rows_missing,
        "failures_kept_by_the_broker": kept if ctx.kind != "postgres" else None,
        "ok_jobs_failed": ok_failed,
        "fail_late_recorded_with_another_error": other_error,
        "ran_exactly_once": exactly_once,
        "restart": event_log[0] if event_log else None,
        "first_run_after_restart_s": resume,
        "worker_log": counts,
        "log_lines": _log_lines(fleet, origin),
        "job_detail": jobs,
        "exit_codes_on_sigterm": exit_codes,
        "backlog_after": ctx.probe.backlog(),
        "leases_left": ctx.probe.leased(),
        **worker_health(fleet),
    }


def _cause(job_runs: list[dict[str, Any]], length: float, event_log: list[dict[str, Any]]) -> str:
    """Why a job ran more than once:

    - ``reaped while running``: a later run started while an earlier one was still going (its
      lease expired under it: the heartbeat did not keep it), then ``+ restart`` if the earlier
      run overlapped the server's outage (bench/chaos/attribution.py's rule);
    - ``re-run after completing``: a later run started after an earlier one had written its side
      effect (its settle was lost), ``+ restart`` likewise;
    - otherwise ``unattributed``.
    """
    ordered = sorted(job_runs, key=lambda r: r["started"])
    how = "unattributed"
    for first, later in itertools.pairwise(ordered):
        end = first["done"] if first["done"] is not None else first["started"] + length
        if later["started"] < end:
            how = "reaped while running"
            break
        if first["done"] is not None:
            how = "re-run after completing"
    effects = [{"pid": r["pid"], "started": r["started"], "done": r["done"] or r["started"]} for r in ordered]
    event = attribute(effects, event_log)
    return f"{how} + {event}" if event != "unattributed" else how
