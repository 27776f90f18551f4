"""Scenario ``stall``: workers frozen (SIGSTOP of the whole process group: a paused VM, a long
GIL-holding C call) past their lease in the middle of runs, with batches on.

Jobs: N chaos jobs (1000, 90 with ``--short``, or ``--jobs``), every other one with
``max_retries=0``, the rest with ``max_retries=2``, each sleeping a random 150-300 ms (``--job-ms``
M: M to 2M), so a freeze lands mid-run. Three workers with the default ``PREFETCH``: every job is
claimed ahead of its run (in batches, of one once the jobs are known to be long), so the loss of
its lease counts as a run only once its start is recorded, which the worker writes with its next
batched write, within ``BATCH_SECONDS`` (0.05 s) of the start.

Chaos, every 1.5 s while jobs are unsettled: one worker's process group is SIGSTOPped for
2 x ``LEASE_TIMEOUT``, then SIGCONTed; one worker is always left awake, and a thawed one is not
frozen again for 1 s (it first ends the run it held). Two freezes in three are *aimed*: the script waits (up to 1 s) for the worker to be inside a run begun at least 0.15 s
before (three ack intervals: its start is recorded); the third is *blind*, wherever the worker
is, which may be within the ack interval after a start (the documented window). The frozen
lease expires and the other workers' reapers recover it (each worker reaps every
``LEASE_TIMEOUT``).

Checked at the end (bench/chaos/stallcheck.py), from the start markers (``chaos_run``: one row
per handler call, with the attempt number it was given), the side effects and the final states:

- lost: jobs that did not end completed with a side effect, or failed with ``WorkerLost`` (its
  lost runs spent its retries);
- uncounted re-runs: handler calls of a job that repeat an attempt number (the run before was
  lost and not counted), each blamed on the freezes that could explain it: one whose worker
  held one of the calls (the run in hand at the SIGSTOP, or the first begun after the SIGCONT)
  while another began after the SIGSTOP. ``blind`` if a blind freeze could, ``aimed`` if only an
  aimed one could, ``unexplained`` if none could;
- calls over budget: jobs whose handler was called more than ``max_retries + 1`` times, and
  those of them without an uncounted re-run that a blind freeze explains (``_not_blind``);
- the runs the aimed freezes caught: lost and counted (the job failed with ``WorkerLost``, or ran
  again with the next attempt number), lost uncounted (it ran again with the same one), or kept
  (not reaped before the SIGCONT: the run went on and was acked);
- worker crashes, exit codes on SIGTERM, leases left.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from .probe import effects_by_job, runs_by_job
from .scenarios import (
    Context,
    Event,
    FrozenRun,
    build,
    enqueue,
    freeze_in_run,
    log,
    thaw,
    worker_health,
    worker_log_counts,
)
from .stallcheck import check
from .workers import Fleet, Incarnation, group_pids

RETRIES = (0, 2)  # the two groups, alternating
INTERVAL = 1.5  # seconds between freezes
MIN_RUN_AGE = 0.15  # an aimed freeze catches a run at least this old: three ack intervals
AIM_FOR = 1.0  # seconds an aimed freeze waits for such a run before it gives up
BLIND_EVERY = 3  # every third freeze is blind


def stall(ctx: Context) -> dict[str, Any]:
    n = ctx.jobs or (90 if ctx.short else 1000)
    low = ctx.job_ms if ctx.job_ms is not None else 150
    ctx.probe.reset()
    envelopes = [
        build("ok", round(ctx.rng.uniform(low, 2 * low)), max_retries=RETRIES[i % len(RETRIES)]) for i in range(n)
    ]
    budgets = {e.id: e.max_retries for e in envelopes}
    enqueue(ctx, envelopes)
    fleet = ctx.fleet("stall")
    freeze_for = 2 * ctx.lease
    # A thawed worker ends the run it held (lost during the freeze) before it is frozen again,
    # so a freeze is never blamed for the loss of a run that an earlier one caused.
    rest = max(1.0, 4 * low / 1000)
    log(f"stall: {n} jobs of {low:g}-{2 * low:g} ms, a freeze of {freeze_for:g}s every {INTERVAL:g}s")
    events: list[Event] = []
    caught: list[tuple[Event, FrozenRun]] = []
    frozen: dict[int, tuple[Incarnation, Event, float]] = {}  # slot -> (incarnation, event, thaw due)
    missed = 0
    drained = False
    deadline = time.monotonic() + ctx.timeout
    origin = time.time()
    try:
        fleet.start_all()
        origin = time.time()
        next_freeze, last_poll, backlog = origin + INTERVAL, 0.0, n
        while time.monotonic() < deadline:
            now = time.time()
            thaw(fleet, frozen, now)
            for inc in fleet.poll_exits():
                log(f"stall: worker slot {inc.slot} exited by itself ({inc.exit_code}); restarting it")
                fleet.start(inc.slot, wait=False)
            if now - last_poll >= 0.5:
                backlog, last_poll = ctx.probe.backlog(), now
            if backlog == 0 and not frozen:
                drained = True
                break
            awake = [inc for inc in fleet.live() if inc.slot not in frozen and inc.children()]
            thawed = {e.slot: e.t1 for e in events}  # the latest freeze of each slot
            rested = [inc for inc in awake if now - thawed.get(inc.slot, 0.0) >= rest]
            if now >= next_freeze and backlog > 0 and len(awake) > 1 and rested:  # one stays awake: it reaps
                next_freeze = now + INTERVAL
                target = ctx.rng.choice(rested)
                froze = _freeze(fleet, target, blind=len(events) % BLIND_EVERY == BLIND_EVERY - 1)
                if froze is None:
                    missed += 1
                    continue
                event, run = froze
                events.append(event)
                frozen[target.slot] = (target, event, event.t0 + freeze_for)
                if run is not None:
                    caught.append((event, run))
            time.sleep(0.05)
        else:
            log("stall: TIMEOUT waiting for the jobs to settle")
        thaw(fleet, frozen)
        drained_at = time.time()
        exit_codes = fleet.stop_all()
    finally:
        fleet.kill_everything()
    result = _analyse(ctx, budgets, events, caught, origin)
    result.update(
        {
            "jobs": n,
            "jobs_by_max_retries": {str(r): sum(1 for b in budgets.values() if b == r) for r in RETRIES},
            "job_ms": [low, 2 * low],
            "lease_timeout": ctx.lease,
            "freeze_s": freeze_for,
            "min_run_age_s": MIN_RUN_AGE,
            "batches": ctx.probe.backend.supports_prefetch,
            "aimed_missed": missed,
            "drained": drained,
            "wall_s": round(drained_at - origin, 2),
            "exit_codes_on_sigterm": exit_codes,
            "backlog_after": ctx.probe.backlog(),
            "leases_left": ctx.probe.leased(),
            "worker_log": worker_log_counts(fleet),
            **worker_health(fleet),
        }
    )
    return result


def _freeze(fleet: Fleet, target: Incarnation, *, blind: bool) -> tuple[Event, FrozenRun | None] | None:
    """SIGSTOP the target's process group: at once (blind), or inside a run at least
    ``MIN_RUN_AGE`` old, which is returned (aimed; ``None`` if none came within ``AIM_FOR``)."""
    if blind:
        pids, t = fleet.signal_group(target, signal.SIGSTOP)
        return Event("stop", t, t, pids, target.slot, "blind"), None
    run = freeze_in_run(fleet, target, AIM_FOR, min_age=MIN_RUN_AGE)
    if run is None:
        return None
    t = time.time()
    return Event("stop", t, t, group_pids(target.pid), target.slot, "aimed"), run


def _analyse(
    ctx: Context,
    budgets: dict[str, int],
    events: list[Event],
    caught: list[tuple[Event, FrozenRun]],
    origin: float,
) -> dict[str, Any]:
    ids = list(budgets)
    effects = effects_by_job()
    markers = {j: [(a, pid, s - origin) for a, pid, s, _x in rows] for j, rows in runs_by_job(ids).items()}
    relative = {j: [(a, pid, s - origin, d - origin) for a, pid, s, d in effects[j]] for j in ids if j in effects}
    aimed = [{"at": round(e.t0 - origin, 3), "slot": e.slot, **run._asdict()} for e, run in caught]
    stops = [e.as_dict(origin) for e in events]
    result = check(budgets, markers, relative, _ends(ctx, ids, effects), stops, aimed)
    result["origin_epoch"] = origin
    return result


def _ends(ctx: Context, ids: list[str], effects: dict[str, Any]) -> dict[str, str]:
    """Each job's end: ``completed`` (with a side effect), ``failed_worker_lost``, or ``lost``."""
    states = ctx.probe.final_states(ids)
    # On Redis the broker's failed set says failed; the Job row (its error) is written after it.
    states.update(dict.fromkeys(ctx.probe.kept_failed_ids(ids), "failed"))
    rows = ctx.probe.failed_rows(ids)
    ends = {}
    for job_id in ids:
        if states.get(job_id) == "completed" and effects.get(job_id):
            ends[job_id] = "completed"
        elif states.get(job_id) == "failed" and rows.get(job_id, (0, ""))[1].startswith("WorkerLost"):
            ends[job_id] = "failed_worker_lost"
        else:
            ends[job_id] = "lost"
    return ends
