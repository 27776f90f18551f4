"""Scenario ``failover`` (``--backend sentinel``): the Redis primary fails over under running
workers, which must follow it to the new primary by themselves.

The group (bench/chaos/servers.py, ``PrivateSentinelGroup``): a primary and a replica (AOF on)
and three sentinels, private, on free loopback ports; the workers' backend is configured with a
``redis+sentinel://`` URL. Jobs: N chaos jobs (150, or ``--jobs``) of ``--job-ms`` (50) queued
before the workers start, then a batch of 5 more every 0.1 s while the chaos lasts, each
dispatch one ``enqueue_many``; a batch that raises is counted as refused (it was not
acknowledged: it may or may not be stored).

Chaos (in a thread, so dispatching goes on meanwhile), ``ROUNDS`` rounds (1 with ``--short``):
``SENTINEL FAILOVER`` 2 s after the start, then, once the demoted primary has rejoined as a
synced replica, a SIGKILL of the primary (the sentinels promote the replica after
``down-after-milliseconds``, 1 s; the killed server is then started again and rejoins as a
replica). ``PAUSE`` seconds separate a promotion from the next event, so that their windows
(below) do not overlap.

Checked from the side effects (``chaos_effect``): every job whose dispatch was acknowledged ran.
Replication is asynchronous: a write the old primary acknowledged but had not sent to the
replica when it stopped serving is gone. An acknowledged dispatch missing that way is *explained*
when it was acknowledged within ``WINDOW`` seconds before the event began, during it, or
within ``RECHECK + WINDOW`` seconds after the sentinels named the new primary (a client asks
them every ``RECHECK`` seconds, and writes to the old primary until then); any other missing
job is *unexplained* (a bug). A loss is blamed on the latest event whose window holds it. A job
that ran twice is blamed on the latest event begun by its first run's end, until ``2 x
LEASE_TIMEOUT`` past the promotion (a lost acknowledgement or claim: it runs again, as after a
worker crash).
Published: acknowledged, refused, lost (explained / unexplained, and when each event's were
acknowledged relative to its start), duplicates by event, the time
from each promotion to the first job finished after it (``resumed_after_s``), worker log counts.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from django_jobs.backends.redis_connection import RECHECK

from .probe import effects_by_job
from .scenarios import Context, Event, build, enqueue, log, wait_drained, worker_health, worker_log_counts

ROUNDS = 2  # failover + kill rounds of a long run
BATCH = 5  # jobs per dispatch while the chaos lasts
EVERY = 0.1  # seconds between dispatches
# Seconds before an event within which an acknowledged write may not have reached the replica
# (on loopback it reaches it within milliseconds; the margin covers a loaded machine), and after
# the sentinels named the new primary, on top of RECHECK, within which a client may still write
# to the old one (demoted while it still answers).
WINDOW = 1.0
# Seconds from a promotion to the next event: their windows do not overlap.
PAUSE = RECHECK + 2 * WINDOW


def failover(ctx: Context) -> dict[str, Any]:
    group = ctx.server
    if not hasattr(group, "kill_primary"):
        return {"skipped": "the failover scenario runs on --backend sentinel only"}
    n = ctx.jobs or 150
    ms = ctx.job_ms if ctx.job_ms is not None else 50
    rounds = 1 if ctx.short else ROUNDS
    ctx.probe.reset()
    initial = [build("ok", ms, max_retries=25) for _ in range(n)]
    enqueue(ctx, initial)
    acked = dict.fromkeys((e.id for e in initial), time.time())
    refused = 0
    events: list[Event] = []
    failures: list[BaseException] = []

    def chaos() -> None:
        try:
            time.sleep(2)
            for _ in range(rounds):
                for kind, act in (("failover", group.failover), ("kill_primary", group.kill_primary)):
                    port, acted, named = act()
                    events.append(Event(kind, acted, named, []))
                    log(f"failover: {kind} -> primary on port {port} after {named - acted:.1f}s")
                    time.sleep(PAUSE)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    fleet = ctx.fleet("failover")
    backend = ctx.probe.backend
    try:
        fleet.start_all()
        origin = time.time()
        thread = threading.Thread(target=chaos, name="failover-chaos", daemon=True)
        thread.start()
        while thread.is_alive():
            for inc in fleet.poll_exits():
                log(f"worker slot {inc.slot} exited by itself ({inc.exit_code}); restarting it")
                fleet.start(inc.slot, wait=False)
            batch = [build("ok", ms, max_retries=25) for _ in range(BATCH)]
            try:
                backend.enqueue_many(batch)
            except Exception as exc:  # noqa: BLE001 - not acknowledged: counted, not expected
                refused += len(batch)
                log(f"failover: dispatch refused: {type(exc).__name__}: {exc}")
            else:
                now = time.time()
                acked.update((e.id, now) for e in batch)
            time.sleep(EVERY)
        if failures:
            raise RuntimeError("the failover chaos failed") from failures[0]
        drained = wait_drained(ctx, fleet, None, ctx.timeout)
        exit_codes = fleet.stop_all()
    finally:
        fleet.kill_everything()
    return _analyse(ctx, fleet, acked, refused, events, origin, drained, exit_codes)


def _analyse(
    ctx: Context,
    fleet: Any,
    acked: dict[str, float],
    refused: int,
    events: list[Event],
    origin: float,
    drained: bool,
    exit_codes: dict[int, int | None],
) -> dict[str, Any]:
    effects = effects_by_job()

    def label(event: Event) -> str:
        return f"{event.kind}@{round(event.t0 - origin, 1)}"

    def latest(moment: float, after: float) -> Event | None:
        """The latest event begun by ``moment`` (give or take WINDOW) whose window, ending
        ``after`` seconds past its promotion, still holds it."""
        return next((e for e in reversed(events) if e.t0 - WINDOW <= moment <= e.t1 + after), None)

    lost = [job for job in acked if not effects.get(job)]
    blamed = {job: latest(acked[job], RECHECK + WINDOW) for job in lost}
    explained = Counter(e.kind if e else None for e in blamed.values())
    unexplained = explained.pop(None, 0)
    # When each event's lost jobs were acknowledged, relative to its start: [first, last] (s).
    lost_when: dict[str, list[float]] = {}
    for e in events:
        offsets = [acked[job] - e.t0 for job, blame in blamed.items() if blame is e]
        if offsets:
            lost_when[label(e)] = [round(min(offsets), 3), round(max(offsets), 3)]
    duplicates: Counter[str] = Counter()
    for job in acked:
        runs = effects.get(job, [])
        if len(runs) > 1:
            # A lost acknowledgement: the run ended around the event, its ack did not survive it.
            blame = latest(runs[0][3], 2 * ctx.lease)
            duplicates[blame.kind if blame else "other"] += 1
    finished = sorted(done for job_runs in effects.values() for *_x, done in job_runs)
    resumed = {label(e): next((round(done - e.t1, 3) for done in finished if done > e.t1), None) for e in events}
    return {
        "jobs_acknowledged": len(acked),
        "dispatches_refused_jobs": refused,
        "ran_though_refused": sum(1 for job in effects if job not in acked),
        "drained": drained,
        "lost": len(lost),
        "lost_explained_by_event": dict(explained),
        "lost_unexplained": unexplained,
        "lost_acknowledged_s_after_event_start": lost_when,
        "lost_ids": [{"id": job, "acked": round(acked[job] - origin, 3)} for job in lost[:20]],
        "duplicate_jobs": sum(duplicates.values()),
        "duplicates_by_event": dict(duplicates),
        "resumed_after_s": resumed,
        "events": dict(Counter(e.kind for e in events)),
        "event_log": [e.as_dict(origin) for e in events],
        "window_s": WINDOW,
        "worker_log": worker_log_counts(fleet),
        "exit_codes_on_sigterm": exit_codes,
        "backlog_after": ctx.probe.backlog(),
        "leases_left": ctx.probe.leased(),
        **worker_health(fleet),
    }
