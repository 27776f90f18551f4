"""The nine scenarios of the chaos battery. Each returns a JSON-able dict of figures.

Times are ``time.time()`` (the workers stamp their runs with the same clock); figures given
relative to a run's start are in seconds.
"""

from __future__ import annotations

import math
import os
import random
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from django.conf import settings
from django.test import override_settings
from django.utils import timezone

from django_jobs import Jobs
from django_jobs.envelope import Envelope, new_id
from django_jobs.models import Job

from .attribution import attribute
from .probe import QUEUES, Probe, done_count, effects_by_job, pg_connections, retrying, runs_by_job, sql
from .workers import Fleet, Incarnation, group_pids, rss_kb


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Context:
    kind: str  # postgres | redis | beanstalk
    short: bool
    workdir: Path
    env: dict[str, str]
    probe: Probe
    server: Any  # the backend's server: PrivatePostgres | PrivateRedis | PrivateBeanstalkd (restartable)
    lease: float
    seed: int
    jobs: int | None = None
    seconds: float | None = None
    job_ms: float | None = None
    restart_database: bool = True
    timeout: float = 900
    rng: random.Random = field(default_factory=random.Random)
    database: Any = None  # the PrivatePostgres holding the chaos database (None with --pg-external)
    outage: float = 1.0  # seconds a restarted server stays down

    def fleet(self, name: str, size: int = 3, prefetch: int | None = None) -> Fleet:
        return Fleet(self.workdir / name, self.env, size=size, prefetch=prefetch)


# -- helpers ------------------------------------------------------------------------------------


def build(
    action: str = "ok",
    ms: float = 5,
    *,
    max_retries: int = 0,
    timeout: float | None = None,
    queue: str = "default",
    **extra: Any,
) -> Envelope:
    builder = Jobs.define("chaos", {"action": action, "ms": ms, **extra}).max_retries(max_retries).queue(queue)
    if timeout is not None:
        builder = builder.timeout(timeout)
    return builder.build()


def enqueue(ctx: Context, envelopes: list[Envelope]) -> None:
    backend = ctx.probe.backend
    for start in range(0, len(envelopes), 1000):
        chunk = envelopes[start : start + 1000]
        retrying(lambda chunk=chunk: backend.enqueue_many(chunk))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return round(ordered[index], 3)


def spread(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": round(max(values), 3) if values else None,
    }


def drain_rate(
    ids: list[str],
    effects: dict[str, list[tuple[int, int, float, float]]],
    runs: dict[str, list[tuple[int, int, float, str]]],
) -> float | None:
    """Jobs per second from the rows: N / (last job's first side effect - first run's start)."""
    firsts = [effects[j][0][3] for j in ids if effects.get(j)]
    starts = [runs[j][0][2] for j in ids if runs.get(j)]
    if len(firsts) < 2 or not starts:
        return None
    return round(len(firsts) / (max(firsts) - min(starts)), 1)


def worker_health(fleet: Fleet) -> dict[str, Any]:
    restarts = fleet.supervisor_restarts()
    unexpected = fleet.unexpected_exits()
    return {
        "worker_crashes": len(restarts) + len(unexpected),
        "supervisor_restart_lines": restarts[:10],
        "unexpected_exits": unexpected,
    }


def worker_log_counts(fleet: Fleet) -> dict[str, int]:
    err = fleet.lines("err")
    reaped = 0
    for line in err:
        if " reaped " in line and "expired lease" in line:
            try:
                reaped += int(line.split(" reaped ", 1)[1].split()[0])
            except (IndexError, ValueError):
                pass
    return {
        "lease_lost_settles": fleet.count_status("lost"),  # the word jobs_work prints for ``lease-lost``
        "lease_lost_heartbeats": sum(1 for line in err if "lease lost while running" in line),
        "leases_reaped": reaped,
        "backend_error_lines": sum(1 for line in err if "backend error" in line),
        "settle_retry_lines": sum(1 for line in err if "settle failed; retrying" in line),
    }


def wait_drained(ctx: Context, fleet: Fleet, total: int | None, timeout: float, grace: float = 5.0) -> bool:
    """Until the backlog is 0 (and every job has its side effect, when ``total`` is given).

    Returns ``False`` on timeout, or when the backlog stayed 0 for ``grace`` seconds while some
    job still has no side effect (it was lost or failed: waiting longer changes nothing).
    """
    deadline = time.monotonic() + timeout
    empty_since = None
    while time.monotonic() < deadline:
        for inc in fleet.poll_exits():
            log(f"worker slot {inc.slot} exited unexpectedly ({inc.exit_code}); restarting it")
            fleet.start(inc.slot, wait=False)
        if ctx.probe.backlog() == 0:
            if total is None or done_count() >= total:
                return True
            empty_since = empty_since or time.monotonic()
            if time.monotonic() - empty_since >= grace:
                log(f"backlog empty for {grace:g}s but only {done_count()}/{total} jobs have a side effect")
                return False
        else:
            empty_since = None
        time.sleep(0.2)
    log("TIMEOUT waiting for the backlog to drain")
    return False


# -- 1. crash recovery --------------------------------------------------------------------------


@dataclass
class Event:
    kind: str  # kill | stop | restart
    t0: float
    t1: float
    pids: list[int]
    slot: int | None = None
    mode: str = ""

    def as_dict(self, origin: float) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "at": round(self.t0 - origin, 3),
            "until": round(self.t1 - origin, 3),
            "slot": self.slot,
            "pids": self.pids,
            **({"mode": self.mode} if self.mode else {}),
        }


class FrozenRun(NamedTuple):
    """The run a frozen worker is inside: its job, its attempt, and its age at the freeze (s)."""

    job_id: str
    attempt: int
    age: float


def freeze_in_run(fleet: Fleet, inc: Incarnation, timeout: float, min_age: float = 0.0) -> FrozenRun | None:
    """Leave the worker frozen (SIGSTOP) at a moment it is inside a run (a start marker and no
    side effect yet) that began at least ``min_age`` seconds before, and return that run; or
    thaw it and return ``None`` if no such moment came within ``timeout``. Jobs of a few ms end
    faster than the driver can look, hence freeze first, look, and thaw if it is not."""
    children = inc.children()
    if not children:
        return None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        os.killpg(inc.pid, signal.SIGSTOP)
        now = time.time()
        rows = sql(
            "SELECT r.job_id, r.attempt, r.started_at FROM chaos_run r WHERE r.pid = ANY(%s) "
            "AND r.started_at > %s AND r.started_at <= %s AND NOT EXISTS ("
            "SELECT 1 FROM chaos_effect e WHERE e.job_id = r.job_id AND e.attempt = r.attempt AND e.pid = r.pid) "
            "ORDER BY r.started_at DESC LIMIT 1",
            [children, now - 1.0, now - min_age],
        )
        if rows:
            job_id, attempt, started = rows[0]
            return FrozenRun(job_id, attempt, round(now - started, 3))
        os.killpg(inc.pid, signal.SIGCONT)
        time.sleep(0.003)
    return None


def thaw(fleet: Fleet, frozen: dict[int, tuple[Incarnation, Event, float]], now: float = math.inf) -> None:
    """SIGCONT the workers of ``frozen`` (slot -> incarnation, its stop event, when it is due to
    thaw) that are due by ``now`` (all of them by default), and end their events."""
    for slot, (inc, event, due) in list(frozen.items()):
        if now >= due:
            _pids, event.t1 = fleet.signal_group(inc, signal.SIGCONT)
            del frozen[slot]


def kill_one(ctx: Context, fleet: Fleet, candidates: list[Incarnation], events: list[Event]) -> None:
    """SIGKILL one of ``candidates`` (taken out of the list) and restart it at once, as a
    supervisor would. Every other kill waits (up to 1 s) for the target to be inside a run, so a
    job in hand is lost for sure; the others land wherever the worker is (often claiming or
    settling, with jobs of a few ms)."""
    target = ctx.rng.choice(candidates)
    mid_run = sum(1 for e in events if e.kind == "kill") % 2 == 0
    if mid_run:
        freeze_in_run(fleet, target, 1.0)
    pids, t = fleet.kill(target)
    events.append(Event("kill", t, t, pids, target.slot, "mid-run" if mid_run else "blind"))
    fleet.start(target.slot, wait=False)
    candidates.remove(target)


def crash(ctx: Context) -> dict[str, Any]:
    n = ctx.jobs or (300 if ctx.short else 5000)
    ms = ctx.job_ms if ctx.job_ms is not None else (50 if ctx.short else 5)
    restart = ctx.kind != "postgres" or ctx.restart_database
    log(f"crash: clean run of {n} jobs ({ms} ms each), 3 workers")
    clean = _drain(ctx, n, ms, chaos=False)
    log(f"crash: clean run {clean['throughput_jobs_per_s']} jobs/s; chaos run of {n} jobs")
    chaotic = _drain(ctx, n, ms, chaos=True, restart=restart)
    result = {
        "jobs": n,
        "job_ms": ms,
        "lease_timeout": ctx.lease,
        "broker_restarts_enabled": restart,
        "clean": clean,
        "chaos": chaotic,
    }
    if clean["throughput_jobs_per_s"] and chaotic["throughput_jobs_per_s"]:
        result["throughput_ratio_chaos_vs_clean"] = round(
            chaotic["throughput_jobs_per_s"] / clean["throughput_jobs_per_s"], 3
        )
    return result


def _drain(ctx: Context, n: int, ms: float, *, chaos: bool, restart: bool = False) -> dict[str, Any]:
    ctx.probe.reset()
    # Enough retries that kills, stalls and restarts never exhaust a healthy job's budget: a lost
    # run counts as a run. A job failing permanently here would show as lost.
    envelopes = [build("ok", ms, max_retries=25) for _ in range(n)]
    ids = [e.id for e in envelopes]
    enqueue(ctx, envelopes)
    fleet = ctx.fleet("crash-chaos" if chaos else "crash-clean")
    events: list[Event] = []
    stopped: dict[int, tuple[Incarnation, Event, float]] = {}  # slot -> (incarnation, event, cont due)
    interval = 2.0 if ctx.short else 2.5
    stop_for = 2 * ctx.lease  # past the lease: it expires and is reaped while the worker is frozen
    milestones = [0.3, 0.65] if chaos and restart else []
    deadline = time.monotonic() + ctx.timeout
    try:
        fleet.start_all()
        origin = time.time()
        next_event = origin + interval
        done = 0
        settled_since: float | None = None
        last_poll = 0.0
        backlog = n
        while time.monotonic() < deadline:
            now = time.time()
            thaw(fleet, stopped, now)
            for inc in fleet.poll_exits():
                if not inc.killed_by_driver:
                    log(f"worker slot {inc.slot} exited by itself ({inc.exit_code}); restarting it")
                    fleet.start(inc.slot, wait=False)
            if now - last_poll >= 0.5:
                done = retrying(done_count)
                backlog = ctx.probe.backlog()
                last_poll = now
            if chaos and milestones and done >= milestones[0] * n:
                milestones.pop(0)
                log(f"crash: restarting the {ctx.kind} server at {done}/{n} done")
                pids = [p for inc in fleet.live() for p in group_pids(inc.pid)]
                down, up = ctx.server.restart(ctx.outage)
                events.append(Event("restart", down, up, pids))
                log(f"crash: {ctx.kind} back after {up - down:.1f}s")
                ctx.probe.backend.close()
                continue
            if chaos and now >= next_event and backlog > 0:
                # Every tick: SIGKILL one worker (restarted at once, as a supervisor would), and
                # SIGSTOP another one past its lease unless one is still frozen.
                candidates = [inc for inc in fleet.live() if inc.slot not in stopped and inc.children()]
                if candidates:
                    kill_one(ctx, fleet, candidates, events)
                if candidates and not stopped:
                    target = ctx.rng.choice(candidates)
                    pids, t = fleet.signal_group(target, signal.SIGSTOP)
                    event = Event("stop", t, t, pids, target.slot)
                    events.append(event)
                    stopped[target.slot] = (target, event, t + stop_for)
                next_event = now + interval
            if backlog == 0 and not stopped:
                if done >= n:
                    break
                # Everything settled but some job has no side effect: lost (or failed). Waiting
                # longer changes nothing once the backlog has stayed empty for a while.
                settled_since = settled_since or time.monotonic()
                if time.monotonic() - settled_since >= 5:
                    log(f"crash: backlog empty but only {done}/{n} jobs have a side effect")
                    break
            else:
                settled_since = None
            time.sleep(0.05)
        else:
            log("crash: TIMEOUT waiting for the backlog to drain")
        thaw(fleet, stopped)
        drained_at = time.time()
        exit_codes = fleet.stop_all()
    finally:
        fleet.kill_everything()
    return _analyse_crash(ctx, fleet, ids, events, origin, drained_at, exit_codes)


def _analyse_crash(
    ctx: Context,
    fleet: Fleet,
    ids: list[str],
    events: list[Event],
    origin: float,
    drained_at: float,
    exit_codes: dict[int, int | None],
) -> dict[str, Any]:
    effects = effects_by_job()
    runs = runs_by_job()
    states = ctx.probe.final_states(ids)
    missing = [j for j in ids if not effects.get(j)]
    not_completed = [j for j in ids if states.get(j) != "completed"]
    lost = sorted(set(missing) | set(not_completed))
    failed_rows = ctx.probe.failed_rows(lost) if lost else {}

    # Recovery latency: for each kill / stop / restart, the run each affected worker had in
    # hand (its latest run started before the event) and, if that job ran again afterwards,
    # how long until its next run started.
    latency: dict[str, list[float]] = {"kill": [], "stop": [], "restart": []}
    runs_by_pid: dict[int, list[tuple[float, str]]] = {}
    for job_id, job_runs in runs.items():
        for _attempt, pid, started, _action in job_runs:
            runs_by_pid.setdefault(pid, []).append((started, job_id))
    for starts in runs_by_pid.values():
        starts.sort()
    for event in events:
        for pid in event.pids:
            before = [(s, j) for s, j in runs_by_pid.get(pid, []) if s <= event.t0]
            if not before:
                continue
            started, job_id = before[-1]
            later = [s for _a, _p, s, _x in runs.get(job_id, []) if s > event.t0]
            if later:
                latency[event.kind].append(min(later) - event.t0)

    # Duplicates: jobs with more than one side effect, each matched to the event that explains
    # it (see attribute()). Relative times, as stored in the JSON.
    event_log = [e.as_dict(origin) for e in events]
    duplicates = []
    by_cause: Counter[str] = Counter()
    for job_id in ids:
        job_effects = effects.get(job_id, [])
        if len(job_effects) < 2:
            continue
        runs_rel = [
            {"attempt": a, "pid": p, "started": round(s - origin, 3), "done": round(d - origin, 3)}
            for a, p, s, d in job_effects
        ]
        cause = attribute(runs_rel, event_log)
        by_cause[cause] += 1
        duplicates.append({"job_id": job_id, "cause": cause, "effects": runs_rel})
    extra_effects = sum(len(effects.get(j, [])) - 1 for j in ids if len(effects.get(j, [])) > 1)
    counts = worker_log_counts(fleet)
    result = {
        "lost": len(lost),
        "lost_ids": [
            {
                "id": j,
                "state": states.get(j),
                "effects": len(effects.get(j, [])),
                "runs": len(runs.get(j, [])),
                "failed_row": failed_rows.get(j),
            }
            for j in lost[:20]
        ],
        "completed": sum(1 for j in ids if states.get(j) == "completed" and effects.get(j)),
        "duplicate_jobs": len(duplicates),
        "duplicate_effects": extra_effects,
        "duplicates_by_cause": dict(by_cause),
        "duplicates": duplicates[:30],
        "stale_acks_rejected": counts["lease_lost_settles"],
        "worker_log": counts,
        "recovery_latency_s": {kind: spread(values) for kind, values in latency.items()},
        "throughput_jobs_per_s": drain_rate(ids, effects, runs),
        "wall_s": round(drained_at - origin, 2),
        "origin_epoch": origin,
        "events": Counter(e.kind for e in events),
        "event_log": event_log,
        "exit_codes_on_sigterm": exit_codes,
        "backlog_after": ctx.probe.backlog(),
        "leases_left": ctx.probe.leased(),
        **worker_health(fleet),
    }
    result["events"] = dict(result["events"])
    return result


# -- 2. poison ----------------------------------------------------------------------------------


POISON = ("raise", "exit", "hang", "hang_masked")


def poison(ctx: Context) -> dict[str, Any]:
    n = ctx.jobs or (300 if ctx.short else 1000)
    ms = ctx.job_ms if ctx.job_ms is not None else 5
    max_retries = 2
    ctx.probe.reset()
    envelopes: list[Envelope] = []
    kinds: dict[str, str] = {}
    for i in range(n):
        if i % 10 == 5:  # 10 %, spread through the queue
            action = POISON[(i // 10) % len(POISON)]
            env = build(action, ms, max_retries=max_retries, timeout=1)
        else:
            action = "ok"
            env = build("ok", ms, max_retries=max_retries, timeout=30)
        kinds[env.id] = action
        envelopes.append(env)
    enqueue(ctx, envelopes)
    ids = [e.id for e in envelopes]
    fleet = ctx.fleet("poison")
    started = time.time()
    try:
        fleet.start_all()
        drained = wait_drained(ctx, fleet, None, ctx.timeout)
        wall = time.time() - started
        exit_codes = fleet.stop_all()
    finally:
        fleet.kill_everything()
    runs = runs_by_job()
    effects = effects_by_job()
    states = ctx.probe.final_states(ids)
    failed = ctx.probe.failed_rows(ids)
    per_kind: dict[str, dict[str, Any]] = {}
    violations = []
    for action in POISON:
        jobs = [j for j in ids if kinds[j] == action]
        run_counts = Counter(len(runs.get(j, [])) for j in jobs)
        attempts = Counter(failed[j][0] if j in failed else None for j in jobs)
        ok = [
            j
            for j in jobs
            if len(runs.get(j, [])) == max_retries + 1
            and states.get(j) == "failed"
            and j in failed
            and failed[j][0] == max_retries + 1
        ]
        for j in jobs:
            if j not in ok:
                violations.append(
                    {
                        "id": j,
                        "action": action,
                        "runs": len(runs.get(j, [])),
                        "state": states.get(j),
                        "failed_row": failed.get(j),
                    }
                )
        per_kind[action] = {
            "jobs": len(jobs),
            "ended_failed_after_exactly_max_retries_plus_1_runs": len(ok),
            "runs_per_job": dict(run_counts),
            "recorded_attempts": {str(k): v for k, v in attempts.items()},
            "last_errors": dict(Counter(failed[j][1].split(":")[0] for j in jobs if j in failed)),
        }
    healthy = [j for j in ids if kinds[j] == "ok"]
    healthy_failed = [j for j in healthy if states.get(j) != "completed" or not effects.get(j)]
    expected_restarts = sum(max_retries + 1 for j in ids if kinds[j] in ("exit", "hang_masked"))
    return {
        "jobs": n,
        "poison_jobs": n - len(healthy),
        "max_retries": max_retries,
        "poison_timeout_s": 1,
        "drained": drained,
        "wall_s": round(wall, 2),
        "poison": per_kind,
        "poison_ok": sum(v["ended_failed_after_exactly_max_retries_plus_1_runs"] for v in per_kind.values()),
        "poison_violations": violations[:20],
        "healthy_jobs": len(healthy),
        "healthy_failed": len(healthy_failed),
        "healthy_failed_ids": [
            {"id": j, "state": states.get(j), "failed_row": failed.get(j)} for j in healthy_failed[:10]
        ],
        "healthy_duplicates": sum(1 for j in healthy if len(effects.get(j, [])) > 1),
        "supervisor_restarts": len(fleet.supervisor_restarts()),
        "supervisor_restarts_expected": expected_restarts,
        "unexpected_exits": fleet.unexpected_exits(),
        "exit_codes_on_sigterm": exit_codes,
        "backlog_after": ctx.probe.backlog(),
        "leases_left": ctx.probe.leased(),
        "worker_log": worker_log_counts(fleet),
    }


# -- 3. tamper flood ----------------------------------------------------------------------------


BAD_KINDS = ("garbage", "wrong_key", "replay", "oversize")


def tamper(ctx: Context) -> dict[str, Any]:
    n_good = ctx.jobs or (300 if ctx.short else 10000)
    n_bad = n_good
    ms = ctx.job_ms if ctx.job_ms is not None else 1
    ctx.probe.reset()
    good = [build("ok", ms) for _ in range(n_good)]
    bad: list[tuple[str, str, Any]] = []  # (kind, queue, envelope or raw bytes)
    attacker = {**settings.JOBS, "SIGNING_KEY": "an attacker's key, not the workers'"}
    big = {**settings.JOBS, "MAX_MESSAGE_BYTES": 1024 * 1024}
    pad = "x" * (settings.JOBS["MAX_MESSAGE_BYTES"] + 4096)
    for i in range(n_bad):
        kind = BAD_KINDS[i % len(BAD_KINDS)]
        if kind == "garbage":
            bad.append((kind, "default", _garbage(ctx.rng)))
        elif kind == "wrong_key":
            with override_settings(JOBS=attacker):
                bad.append((kind, "default", build("ok", ms, bad=True)))
        elif kind == "replay":
            # Validly signed for "default", written onto "other".
            bad.append((kind, "other", build("ok", ms, bad=True)))
        else:
            with override_settings(JOBS=big):
                bad.append((kind, "default", build("ok", ms, bad=True, pad=pad)))
    t0 = time.time()
    writer = {"postgres": _write_rows, "redis": _write_redis, "beanstalk": _write_beanstalk}[ctx.kind]
    writer(ctx, good, bad)
    write_s = time.time() - t0
    log(f"tamper: wrote {n_good} good + {n_bad} bad messages in {write_s:.1f}s")
    fleet = ctx.fleet("tamper")
    ids = [e.id for e in good]
    started = time.time()
    try:
        fleet.start_all()
        drained = wait_drained(ctx, fleet, n_good, ctx.timeout)
        wall = time.time() - started
        exit_codes = fleet.stop_all()
    finally:
        fleet.kill_everything()
    effects = effects_by_job()
    runs = runs_by_job()
    states = ctx.probe.final_states(ids)
    bad_runs = sql("SELECT count(*) FROM chaos_run WHERE bad")[0][0]
    bad_effects = sql("SELECT count(*) FROM chaos_effect WHERE bad")[0][0]
    rejected = Counter()
    for line in fleet.lines("out"):
        if line.startswith("rejected"):
            reason = line.split("rejected: ", 1)[1].split(":")[0] if "rejected: " in line else "?"
            rejected[reason] += 1
    good_completed = sum(1 for j in ids if effects.get(j) and states.get(j) == "completed")
    return {
        "good": n_good,
        "bad": n_bad,
        "bad_kinds": dict(Counter(k for k, _q, _b in bad)),
        "write_s": round(write_s, 2),
        "drained": drained,
        "wall_s": round(wall, 2),
        "throughput_messages_per_s": round((n_good + n_bad) / wall, 1) if wall else None,
        "good_completed": good_completed,
        "good_lost": n_good - good_completed,
        "good_duplicates": sum(1 for j in ids if len(effects.get(j, [])) > 1),
        "bad_executed": bad_runs,
        "bad_side_effects": bad_effects,
        "rejected_by_reason": dict(rejected),
        "rejected_total": sum(rejected.values()),
        "bad_kept_for_audit": ctx.probe.kept_failed(),
        "good_throughput_jobs_per_s": drain_rate(ids, effects, runs),
        "exit_codes_on_sigterm": exit_codes,
        "backlog_after": ctx.probe.backlog(),
        "leases_left": ctx.probe.leased(),
        "worker_log": worker_log_counts(fleet),
        **worker_health(fleet),
    }


def _garbage(rng: random.Random) -> bytes:
    choice = rng.randrange(4)
    if choice == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    if choice == 1:
        return b'{"v": 1, "id": "' + str(rng.random()).encode() + b'", "handler": '  # truncated JSON
    if choice == 2:
        return b'{"v": 1, "id": "x", "handler": "chaos", "payload": {"bad": true}, "queue": "default", "attempts": -1}'
    return b"[1, 2, 3]"


def _write_rows(ctx: Context, good: list[Envelope], bad: list[tuple[str, str, Any]]) -> None:
    """Database: rows INSERTed straight into django_jobs_job, good and bad alternating in claim order."""
    now = timezone.now()
    rows = []
    for i, (env, (kind, queue, body)) in enumerate(zip(good, bad, strict=True)):
        rows.append(_row(env, env.queue, now, 2 * i))
        if kind == "garbage":
            rng = ctx.rng
            rows.append(
                Job(
                    id=new_id(),
                    queue=queue,
                    handler=rng.choice(["chaos", "os.system", "", "x" * 200]),
                    payload=rng.choice([{"action": "ok", "bad": True}, [1, 2], "junk", 42]),
                    options=rng.choice([{}, [], "x", {"backoff": "nope"}]),
                    signature=rng.choice(["", "00" * 32, body.hex()[:128]]),
                    name="",
                    max_retries=rng.randrange(3),
                    priority=0,
                    available_at=now + _us(2 * i + 1),
                    created_at=now,
                    updated_at=now,
                    backend="chaos",
                )
            )
        else:
            rows.append(_row(body, queue, now, 2 * i + 1))
    retrying(lambda: Job.objects.bulk_create(rows, batch_size=1000))


def _us(n: int) -> Any:
    from datetime import timedelta

    return timedelta(microseconds=n)


def _row(env: Envelope, queue: str, now: Any, order: int) -> Job:
    return Job(
        id=env.id,
        queue=queue,
        handler=env.handler,
        payload=env.payload,
        options=env.options,
        signature=env.signature,
        name=env.name,
        attempts=env.attempts,
        max_retries=env.max_retries,
        priority=env.priority,
        available_at=now + _us(order),
        timeout=env.timeout,
        idempotency_key=env.idempotency_key,
        created_at=now,
        updated_at=now,
        backend="chaos",
    )


# One raw message pushed the way the backend's own scripts lay it out: a body, then a waiting
# member scored by the queue's FIFO sequence (priority 0), then a wake-up on the notify list.
RAW_PUSH = """
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[3]), ARGV[1])
redis.call('LPUSH', KEYS[4], 1)
redis.call('LTRIM', KEYS[4], 0, 99)
return 1
"""


def _write_redis(ctx: Context, good: list[Envelope], bad: list[tuple[str, str, Any]]) -> None:
    backend = ctx.probe.backend
    client = ctx.probe.redis()
    push = client.script_load(RAW_PUSH)  # on every primary of a cluster
    keys = {q: backend.keys(q) for q in QUEUES}
    for start in range(0, len(good), 50):
        backend.enqueue_many(good[start : start + 50])
        pipe = client.pipeline(transaction=False)
        for kind, queue, body in bad[start : start + 50]:
            k = keys[queue]
            raw = body if isinstance(body, bytes) else body.to_bytes()
            job_id = new_id() if kind == "garbage" else body.id
            # By its SHA: a cluster's pipeline takes no script object (nor evalsha by name).
            pipe.execute_command("EVALSHA", push, 4, k[0], k[4], k[6], k[7], job_id, raw)
        pipe.execute()
    client.close()


def _write_beanstalk(ctx: Context, good: list[Envelope], bad: list[tuple[str, str, Any]]) -> None:
    import greenstalk

    from django_jobs.backends.beanstalk import PRIORITY_ZERO

    backend = ctx.probe.backend
    clients = {q: greenstalk.Client(ctx.server.address, encoding=None, use=backend.tube_name(q)) for q in QUEUES}
    ttr = max(1, int(ctx.lease + 0.999))
    try:
        for env, (_kind, queue, body) in zip(good, bad, strict=True):
            backend.enqueue(env)
            raw = body if isinstance(body, bytes) else body.to_bytes()
            clients[queue].put(raw, priority=PRIORITY_ZERO, ttr=ttr)
    finally:
        for client in clients.values():
            client.close()


# -- 4. graceful shutdown -----------------------------------------------------------------------


def shutdown(ctx: Context) -> dict[str, Any]:
    rounds = 2 if ctx.short else 6
    job_ms = 1500
    results = []
    for r in range(rounds):
        variant = ("supervisor", "group")[r % 2]
        results.append(_shutdown_round(ctx, r, variant, job_ms))
    return {
        "rounds": rounds,
        "job_ms": job_ms,
        "exit_codes": [c for res in results for c in res["exit_codes"]],
        "all_exit_0": all(c == 0 for res in results for c in res["exit_codes"]),
        "leases_left_after_exit": sum(res["leases_left"] for res in results),
        "in_flight_at_sigterm": sum(res["in_flight"] for res in results),
        "in_flight_finished": sum(res["finished"] for res in results),
        "in_flight_released": sum(res["released"] for res in results),
        "in_flight_left_leased": sum(res["left_leased"] for res in results),
        "runs_started_after_sigterm": sum(res["runs_started_after_sigterm"] for res in results),
        "exit_latency_s": spread([t for res in results for t in res["exit_latency_s"]]),
        "worker_crashes": sum(res["worker_crashes"] for res in results),
        "per_round": results,
    }


def _shutdown_round(ctx: Context, number: int, variant: str, job_ms: int) -> dict[str, Any]:
    ctx.probe.reset()
    envelopes = [build("ok", job_ms) for _ in range(30)]
    enqueue(ctx, envelopes)
    fleet = ctx.fleet(f"shutdown-{number}")
    try:
        fleet.start_all()
        children = {pid for inc in fleet.live() for pid in inc.children()}

        def in_flight() -> list[tuple[str, int, float]]:
            return [
                tuple(row)
                for row in sql(
                    "SELECT r.job_id, r.pid, r.started_at FROM chaos_run r WHERE NOT EXISTS ("
                    "SELECT 1 FROM chaos_effect e WHERE e.job_id = r.job_id AND e.attempt = r.attempt AND e.pid = r.pid)"
                )
            ]

        deadline = time.monotonic() + 60
        while {pid for _j, pid, _s in in_flight()} < children and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(ctx.rng.uniform(0.1, 0.8))  # somewhere inside the runs, not at their start
        flying = in_flight()
        t_term = time.time()
        for inc in fleet.live():
            inc.terminated_by_driver = True
            if variant == "group":  # as systemd's KillMode=control-group or a terminal's ^C
                os.killpg(inc.pid, signal.SIGTERM)
            else:
                inc.popen.send_signal(signal.SIGTERM)
        latencies, codes = [], []
        for inc in fleet.slots:
            if inc is None:
                continue
            try:
                code = inc.popen.wait(30)
            except Exception:  # noqa: BLE001 - did not exit: recorded, then killed
                code = None
            codes.append(code)
            latencies.append(round(time.time() - t_term, 3))
        leases_left = ctx.probe.leased()  # read right after the exits: nothing may be waiting to expire
    finally:
        fleet.kill_everything()
    effects = effects_by_job()
    runs = runs_by_job()
    states = ctx.probe.final_states([j for j, _p, _s in flying]) if ctx.kind == "postgres" else {}
    finished = released = left = 0
    for job_id, pid, _started in flying:
        if any(p == pid for _a, p, _s, _d in effects.get(job_id, [])):
            finished += 1
        elif ctx.kind == "postgres":
            if states.get(job_id) == "pending":
                released += 1
            else:
                left += 1
        else:
            released += 1  # no side effect and (leases_left == 0) nothing held: back in the queue
    late_runs = [s - t_term for job_runs in runs.values() for _a, _p, s, _x in job_runs if s > t_term]
    return {
        "variant": variant,
        "in_flight": len(flying),
        "finished": finished,
        "released": released,
        "left_leased": left + leases_left,
        "leases_left": leases_left,
        "exit_codes": codes,
        "exit_latency_s": latencies,
        "runs_started_after_sigterm": len(late_runs),
        "worker_crashes": len(fleet.supervisor_restarts()),
    }


# -- 5. soak ------------------------------------------------------------------------------------


def soak(ctx: Context) -> dict[str, Any]:
    seconds = ctx.seconds or (30 if ctx.short else 600)
    ms = ctx.job_ms if ctx.job_ms is not None else 5
    probe_jobs = 300 if ctx.short else 2000
    ctx.probe.reset()
    fleet = ctx.fleet("soak")
    window = 10.0
    samples: list[dict[str, Any]] = []
    try:
        fleet.start_all()
        # 1. The maximum rate: a backlog of probe_jobs drained by the same three workers.
        envelopes = [build("ok", ms, max_retries=3) for _ in range(probe_jobs)]
        enqueue(ctx, envelopes)
        wait_drained(ctx, fleet, probe_jobs, ctx.timeout)
        max_rate = drain_rate([e.id for e in envelopes], effects_by_job(), runs_by_job()) or 1.0
        target = 0.7 * max_rate
        log(f"soak: max rate {max_rate} jobs/s; producing {target:.1f} jobs/s for {seconds:g}s")
        sql("TRUNCATE chaos_run, chaos_effect")
        # 2. Produce at 70 % of it for `seconds`, sampling every window.
        produced = 0
        ids: list[str] = []
        origin = time.time()
        next_sample = origin
        while (now := time.time()) < origin + seconds:
            due = int(target * (now - origin)) - produced
            if due > 0:
                batch = [build("ok", ms, max_retries=3) for _ in range(due)]
                enqueue(ctx, batch)
                ids.extend(e.id for e in batch)
                produced += due
            if now >= next_sample:
                samples.append(_soak_sample(ctx, fleet, now - origin))
                next_sample += window
            for inc in fleet.poll_exits():
                log(f"soak: worker slot {inc.slot} exited ({inc.exit_code}); restarting it")
                fleet.start(inc.slot, wait=False)
            time.sleep(0.1)
        end = time.time()
        samples.append(_soak_sample(ctx, fleet, end - origin))
        backlog_at_end = ctx.probe.backlog()
        drained = wait_drained(ctx, fleet, None, 120)
        final_backlog = ctx.probe.backlog()
        exit_codes = fleet.stop_all()
    finally:
        fleet.kill_everything()
    effects = effects_by_job()
    windows = []
    t = origin
    done_times = sorted(e[0][3] for e in effects.values())
    while t + window <= end + 1e-6:
        windows.append(sum(1 for d in done_times if t <= d < t + window) / window)
        t += window
    mean = statistics.mean(windows) if windows else 0.0
    cv = statistics.pstdev(windows) / mean if len(windows) > 1 and mean else None
    rss: dict[str, Any] = {}
    for pid in sorted({p for s in samples for p in s["rss_kb"]}):
        series = [s["rss_kb"][pid] for s in samples if pid in s["rss_kb"] and s["t"] >= window - 0.5]
        if series:
            rss[str(pid)] = {
                "first_kb": series[0],
                "last_kb": series[-1],
                "max_kb": max(series),
                "growth_kb": series[-1] - series[0],
                "samples": len(series),
                "series_kb": series,
            }
    conns = [s["pg_connections"] for s in samples]
    lost = [j for j in ids if not effects.get(j)]
    return {
        "seconds": seconds,
        "job_ms": ms,
        "max_rate_jobs_per_s": max_rate,
        "target_jobs_per_s": round(target, 1),
        "produced": produced,
        "completed": len(ids) - len(lost),
        "lost": len(lost),
        "duplicates": sum(1 for j in ids if len(effects.get(j, [])) > 1),
        "window_s": window,
        "throughput_per_window": [round(w, 1) for w in windows],
        "throughput_mean": round(mean, 1),
        "throughput_cv": round(cv, 4) if cv is not None else None,
        "worker_rss": rss,
        "pg_connections": {"min": min(conns), "max": max(conns), "samples": conns} if conns else None,
        "backlog_samples": [s["backlog"] for s in samples],
        "loadavg_samples": [s["loadavg_1m"] for s in samples],
        "backlog_at_end_of_production": backlog_at_end,
        "drained": drained,
        "final_backlog": final_backlog,
        "exit_codes_on_sigterm": exit_codes,
        "worker_log": worker_log_counts(fleet),
        **worker_health(fleet),
    }


def _soak_sample(ctx: Context, fleet: Fleet, t: float) -> dict[str, Any]:
    rss = {}
    for inc in fleet.live():
        for pid in inc.children():
            value = rss_kb(pid)
            if value is not None:
                rss[pid] = value
    return {
        "t": round(t, 1),
        "rss_kb": rss,
        "pg_connections": pg_connections(),
        "backlog": ctx.probe.backlog(),
        "loadavg_1m": round(os.getloadavg()[0], 2),  # the machine's load: other work shows here
    }


from .dbrestart import dbrestart  # they use the helpers above: imported last
from .failover import failover
from .flows import flows
from .stalls import stall

SCENARIOS = {
    "crash": crash,
    "poison": poison,
    "tamper": tamper,
    "shutdown": shutdown,
    "soak": soak,
    "dbrestart": dbrestart,
    "flows": flows,
    "stall": stall,
    "failover": failover,
}
