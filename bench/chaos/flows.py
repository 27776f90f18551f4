"""Scenario ``flows``: chains and groups (jobs that wait for other jobs) while workers are
SIGKILLed and gracefully stopped.

Jobs (all the chaos handler, each on a queue picked at random, ``default`` or ``other``, so a
child often waits for a parent on the other queue):

- C chains of 5 steps (``chain(...)``): 200, 60 with ``--short``, or ``--jobs``. In every tenth
  chain one step (never the last) is designed to fail: it raises, with ``max_retries=0``. The
  steps after it must then end failed with ``ParentFailed`` without ever running.
- G groups of M members with a callback (``group(...).then(cb)``): 50 x 20, 15 x 10 with
  ``--short`` (``--jobs`` N: N // 4 groups). In every fifth group one member raises; the callback
  runs anyway (``then`` runs it however the members ended), exactly once.
- L late dependents (100, 40 with ``--short``): single jobs dispatched with
  ``using(depends_on=[p])`` while the workers run, ``p`` a step or member dispatched before, in
  whatever state it is then (waiting, queued, running, finished and, on Redis, forgotten).

Healthy jobs have ``max_retries=25``, so the runs lost to the kills never exhaust them. Half the
chains and groups are dispatched before the workers start, the rest (and the late dependents)
in batches during the first seconds of the run.

Chaos, every 2.5 s (1.5 s with ``--short``) while anything is queued: SIGKILL of one worker's
process group, restarted at once (every other kill waits, up to 1 s, for the worker to be inside
a run, as in ``crash``); every second tick also a SIGTERM to another worker's supervisor, which
must finish its job, exit 0, and is then restarted.

Checked at the end (bench/chaos/flowcheck.py), from the start markers and side effects
(bench/chaos/jobs.py) and the final states:

- lost: jobs that did not end as designed (completed with a side effect; failed, for a job
  designed to fail; failed with ``ParentFailed`` and no run, for a job after a failed one). On
  Redis a job is failed when a queue's failed set holds it; its failed ``Job`` row is written
  after the failed set, so a kill in between leaves it to the reaper's sweep, which the check
  runs first (``failed_rows_written_late``); a row still missing is ``failed_rows_missing``;
- order: a chain step or late dependent whose first run began before its parent's completing
  run had finished (its last side effect: with SIGKILL and SIGTERM only, a run that writes its
  side effect after the job was settled cannot exist), or that ran although its parent failed;
  a callback whose first run began before every member finished (a failed member: its last run);
- runs beyond one per job, each attributed (bench/chaos/attribution.py ``attribute_rerun``):
  ``kill`` (the worker running the previous run was SIGKILLed before the next run began: at-least-
  once delivery) or ``unattributed``. For callbacks: *callbacks re-run after a kill* vs
  *callbacks released twice* (an extra run no kill explains: the dependency was resolved twice);
- release latency: from the parent's last side effect (a callback: the last member's; a late
  dependent sent after its parent finished: its dispatch) to the child's first run;
- the SIGTERMed workers: exit codes, time to exit, runs they started after the signal.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from django_jobs import Jobs, chain, group
from django_jobs.api import JobBuilder

from .flowcheck import Spec, check
from .probe import QUEUES, effects_by_job, retrying, runs_by_job, sql
from .scenarios import Context, Event, kill_one, log, spread, worker_health, worker_log_counts
from .workers import Fleet, Incarnation, group_pids

STEPS = 5
HEALTHY_RETRIES = 25


class Plan:
    """Dispatches chains, groups and late dependents, and keeps what each job is (``specs``)."""

    def __init__(self, ctx: Context, ms: float) -> None:
        self.ctx = ctx
        self.ms = ms
        self.specs: dict[str, Spec] = {}

    def call(self, action: str) -> JobBuilder:
        retries = 0 if action == "raise" else HEALTHY_RETRIES
        queue = self.ctx.rng.choice(QUEUES)
        return Jobs.define("chaos", {"action": action, "ms": self.ms}).max_retries(retries).queue(queue)

    def chain(self, number: int) -> None:
        fail_at = self.ctx.rng.randrange(STEPS - 1) if number % 10 == 3 else None
        actions = ["raise" if i == fail_at else "ok" for i in range(STEPS)]
        ids = retrying(lambda: chain(*(self.call(a) for a in actions)).dispatch())
        expected = "completed"
        for i, (job_id, action) in enumerate(zip(ids, actions, strict=True)):
            if action == "raise":
                expected = "failed"
            elif expected != "completed":
                expected = "parent_failed"
            self.specs[job_id] = Spec("step", number, action, expected, (ids[i - 1],) if i else ())

    def group(self, number: int, members: int) -> None:
        failing = self.ctx.rng.randrange(members) if number % 5 == 2 else None
        actions = ["raise" if i == failing else "ok" for i in range(members)]
        ids = retrying(lambda: group(*(self.call(a) for a in actions)).then(self.call("ok")).dispatch())
        *member_ids, callback = ids
        for job_id, action in zip(member_ids, actions, strict=True):
            self.specs[job_id] = Spec("member", number, action, "failed" if action == "raise" else "completed")
        self.specs[callback] = Spec("callback", number, "ok", "completed", tuple(member_ids))

    def late(self, number: int) -> None:
        parents = [j for j, s in self.specs.items() if s.role in ("step", "member")]
        parent = self.ctx.rng.choice(parents)
        expected = "completed" if self.specs[parent].expected == "completed" else "parent_failed"
        job_id = retrying(lambda: self.call("ok").depends_on(parent).dispatch())
        self.specs[job_id] = Spec("late", number, "ok", expected, (parent,), time.time())


def flows(ctx: Context) -> dict[str, Any]:
    backend = ctx.probe.backend
    if not backend.supports_dependencies:
        return {"skipped": f"the {ctx.kind} backend ({type(backend).__name__}) does not support dependencies"}
    n_chains = ctx.jobs or (60 if ctx.short else 200)
    n_groups = max(1, n_chains // 4) if ctx.jobs else (15 if ctx.short else 50)
    members = 10 if ctx.short else 20
    n_late = 40 if ctx.short else 100
    ms = ctx.job_ms if ctx.job_ms is not None else (50 if ctx.short else 20)
    ctx.probe.reset()
    plan = Plan(ctx, ms)
    dispatches: list[Callable[[], None]] = []
    for i in range(max(n_chains, n_groups)):
        if i < n_chains:
            dispatches.append(lambda i=i: plan.chain(i))
        if i < n_groups:
            dispatches.append(lambda i=i: plan.group(i, members))
    before = len(dispatches) // 2
    log(f"flows: {n_chains} chains x {STEPS}, {n_groups} groups x {members} + callback, {n_late} late dependents")
    for dispatch in dispatches[:before]:
        dispatch()
    # The rest while the workers run, each batch followed by a few late dependents.
    rest = dispatches[before:]
    batches = 10
    during: list[list[Callable[[], None]]] = []
    for b in range(batches):
        batch = rest[b * len(rest) // batches : (b + 1) * len(rest) // batches]
        late = range(b * n_late // batches, (b + 1) * n_late // batches)
        during.append(batch + [lambda k=k: plan.late(k) for k in late])
    fleet = ctx.fleet("flows")
    events: list[Event] = []
    terms: list[tuple[Incarnation, Event]] = []
    interval = 1.5 if ctx.short else 2.5
    deadline = time.monotonic() + ctx.timeout
    stall_after = max(20.0, 10 * ctx.lease)  # the reaper's sweep runs every lease: a stuck job never moves
    drained = False
    origin = time.time()
    try:
        fleet.start_all()
        origin = time.time()
        next_event, next_batch, last_poll = origin + interval, origin, 0.0
        backlog, runs_seen, progress_at, ticks = -1, -1, time.monotonic(), 0
        while time.monotonic() < deadline:
            now = time.time()
            if during and now >= next_batch:
                for dispatch in during.pop(0):
                    dispatch()
                next_batch = now + 0.3
            for inc in fleet.poll_exits():
                if not inc.terminated_by_driver:
                    log(f"flows: worker slot {inc.slot} exited by itself ({inc.exit_code}); restarting it")
                fleet.start(inc.slot, wait=False)
            if now - last_poll >= 0.5:
                last_poll = now
                state = (ctx.probe.backlog(), sql("SELECT count(*) FROM chaos_run")[0][0])
                if state != (backlog, runs_seen):
                    progress_at = time.monotonic()
                backlog, runs_seen = state
            # A SIGTERMed worker finishes its job and exits; one that takes over 30 s is reported
            # by its exit code (killed by stop_all), not waited for.
            stopping = [inc for inc, e in terms if inc.exit_code is None and now - e.t0 < 30]
            if backlog == 0 and not during and not stopping:
                drained = True
                break
            if time.monotonic() - progress_at >= stall_after:
                log(f"flows: no progress for {stall_after:g}s with {backlog} job(s) unsettled")
                break
            if now >= next_event and (backlog > 0 or during):
                ticks += 1
                candidates = [inc for inc in fleet.live() if not inc.terminated_by_driver and inc.children()]
                if candidates:
                    kill_one(ctx, fleet, candidates, events)
                if candidates and ticks % 2 == 0 and not stopping:
                    target = ctx.rng.choice(candidates)
                    target.terminated_by_driver = True
                    pids, t = group_pids(target.pid), time.time()
                    target.popen.send_signal(signal.SIGTERM)  # the supervisor: it stops its child
                    event = Event("term", t, t, pids, target.slot)
                    events.append(event)
                    terms.append((target, event))
                next_event = now + interval
            time.sleep(0.05)
        else:
            log("flows: TIMEOUT waiting for the jobs to settle")
        drained_at = time.time()
        exit_codes = fleet.stop_all()
    finally:
        fleet.kill_everything()
    result = _analyse(ctx, plan, events, terms, origin, drained_at)
    result.update(
        {
            "chains": n_chains,
            "steps": STEPS,
            "groups": n_groups,
            "members": members,
            "late_dependents": n_late,
            "job_ms": ms,
            "lease_timeout": ctx.lease,
            "drained": drained,
            "exit_codes_on_sigterm": exit_codes,
            "backlog_after": ctx.probe.backlog(),
            "leases_left": ctx.probe.leased(),
            "worker_log": worker_log_counts(fleet),
            "dependency_log": _dependency_log(fleet),
            **worker_health(fleet),
        }
    )
    return result


def _analyse(
    ctx: Context,
    plan: Plan,
    events: list[Event],
    terms: list[tuple[Incarnation, Event]],
    origin: float,
    drained_at: float,
) -> dict[str, Any]:
    ids = list(plan.specs)
    runs = {j: [(a, pid, started) for a, pid, started, _x in r] for j, r in runs_by_job(ids).items()}
    effects = effects_by_job()
    event_log = [e.as_dict(origin) for e in events]
    states = ctx.probe.final_states(ids)
    # On Redis a failure is the broker's failed set; its Job row is written after it, so a kill
    # in between leaves a failed job without its row until the reaper's sweep writes it: done
    # now, counted apart. A row still missing after it is a failed job of no record.
    written_late = ctx.probe.write_missing_rows()
    rows = ctx.probe.failed_rows(ids)
    kept = ctx.probe.kept_failed_ids(ids)
    states.update(dict.fromkeys(kept, "failed"))
    missing = sorted(kept - set(rows))
    result = check(plan.specs, runs, effects, states, {j: e for j, (_n, e) in rows.items()}, event_log, origin)
    result["failed_rows_written_late"] = written_late
    result["failed_rows_missing"] = len(missing)
    result["failed_rows_missing_detail"] = [
        {"id": j, "role": plan.specs[j].role, "expected": plan.specs[j].expected, "runs": runs.get(j, [])}
        for j in missing[:10]
    ]
    result["release_latency_s"] = {role: spread(v) for role, v in result["release_latency_s"].items()}
    # The SIGTERMed workers: each must finish its job, start no other, and exit 0.
    term_log = []
    for inc, event in terms:
        late_runs = [
            round(started - event.t0, 3)
            for job_runs in runs.values()
            for _a, pid, started in job_runs
            if pid in event.pids and started > event.t0
        ]
        exit_s = round(inc.ended - event.t0, 3) if inc.ended else None
        term_log.append(
            {"slot": inc.slot, "exit_code": inc.exit_code, "exit_s": exit_s, "runs_started_after": late_runs}
        )
    firsts = [e[0][3] for j, e in effects.items() if j in plan.specs and e]
    result.update(
        {
            "throughput_jobs_per_s": round(len(firsts) / (max(firsts) - origin), 1) if firsts else None,
            "wall_s": round(drained_at - origin, 2),
            "origin_epoch": origin,
            "events": dict(Counter(e.kind for e in events)),
            "event_log": event_log,
            "terms": term_log,
            "term_exit_codes": sorted({t["exit_code"] for t in term_log}, key=str),
            "runs_started_after_sigterm": sum(len(t["runs_started_after"]) for t in term_log),
        }
    )
    return result


def _dependency_log(fleet: Fleet) -> dict[str, int]:
    """The workers' log lines about work left to the reaper's sweep or not recorded."""
    err = fleet.lines("err")
    return {
        "failure_records_failed": sum(1 for line in err if "could not record the" in line),
        "resolutions_left_to_the_sweep": sum(1 for line in err if "could not resolve the dependents" in line),
        "attaches_left_to_the_sweep": sum(1 for line in err if "could not attach job(s)" in line),
    }
