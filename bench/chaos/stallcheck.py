"""The verdicts of the ``stall`` scenario (bench/chaos/stalls.py) from what was recorded: every
handler call's start marker, every side effect, each job's end, the freezes. No Django: the
rules can be checked on made-up records (tests/unit/test_chaos_stallcheck.py).

Times are seconds from the scenario's start. A start marker is ``(attempt, pid, started)``, a
side effect ``(attempt, pid, started, done)`` (``started``: its start marker's); a freeze is an
``Event.as_dict`` (``at``, ``until``, ``pids``, ``mode``: aimed or blind); an aimed freeze's
catch is ``{"at", "job_id", "attempt", ...}``. A job ends ``completed``, ``failed_worker_lost``
or ``lost``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

SETTLED = 0.1  # seconds after its side effect a run may still wait for its ack (two ack intervals)
OUTCOMES = ("lost_counted", "lost_uncounted", "kept")


class Run(NamedTuple):
    """One handler call: its start and its side effect's time (``None``: none written)."""

    attempt: int
    pid: int
    started: float
    done: float | None


def check(
    budgets: dict[str, int],
    markers: dict[str, list[tuple[int, int, float]]],
    effects: dict[str, list[tuple[int, int, float, float]]],
    ends: dict[str, str],
    stops: list[dict[str, Any]],
    caught: list[dict[str, Any]],
) -> dict[str, Any]:
    """The figures of the scenario; ``budgets``: each job's ``max_retries``."""
    done = {(j, a, pid, s): d for j, rows in effects.items() for a, pid, s, d in rows}
    runs = {j: [Run(a, pid, s, done.get((j, a, pid, s))) for a, pid, s in rows] for j, rows in markers.items()}
    by_pid: dict[int, list[float]] = {}
    for job_runs in runs.values():
        for run in job_runs:
            by_pid.setdefault(run.pid, []).append(run.started)

    # Uncounted re-runs: calls of one job with the same attempt number.
    causes: Counter[str] = Counter()
    blind_jobs: set[str] = set()
    uncounted = []
    for job_id, job_runs in runs.items():
        for attempt in sorted({r.attempt for r in job_runs}):
            same = [r for r in job_runs if r.attempt == attempt]
            if len(same) < 2:
                continue
            cause = explain(same, stops, by_pid)
            causes[cause] += len(same) - 1
            if cause == "blind":
                blind_jobs.add(job_id)
            uncounted.append({"job_id": job_id, "attempt": attempt, "cause": cause, "runs": _rounded(same)})

    over = [j for j in budgets if len(runs.get(j, [])) > budgets[j] + 1]
    outcomes: Counter[str] = Counter()
    aimed_log = []
    for catch in caught:
        run = outcome(catch["attempt"], catch["at"], runs.get(catch["job_id"], []), ends[catch["job_id"]])
        outcomes[run] += 1
        aimed_log.append({**catch, "run": run})
    lost = [j for j in budgets if ends[j] == "lost"]
    return {
        "freezes": dict(Counter(stop["mode"] for stop in stops)),
        "aimed_runs": {k: outcomes[k] for k in OUTCOMES},
        "completed": sum(1 for j in budgets if ends[j] == "completed"),
        "failed_worker_lost": sum(1 for j in budgets if ends[j] == "failed_worker_lost"),
        "lost": len(lost),
        "lost_ids": [
            {"id": j, "runs": _rounded(runs.get(j, [])), "effects": len(effects.get(j, []))} for j in lost[:20]
        ],
        "handler_calls": sum(len(r) for r in runs.values()),
        "calls_over_budget": len(over),
        "calls_over_budget_not_blind": sum(1 for j in over if j not in blind_jobs),
        "calls_over_budget_detail": [
            {"id": j, "max_retries": budgets[j], "runs": _rounded(runs[j]), "end": ends[j]} for j in over[:20]
        ],
        "uncounted_reruns": sum(causes.values()),
        "uncounted_reruns_by_cause": dict(causes),
        "uncounted_reruns_not_blind": sum(v for k, v in causes.items() if k != "blind"),
        "uncounted_detail": uncounted[:30],
        "event_log": stops,
        "aimed_log": aimed_log,
    }


def explain(same: list[Run], stops: list[dict[str, Any]], by_pid: dict[int, list[float]]) -> str:
    """Which freezes could explain calls of one job with one attempt number: ``blind`` if a
    blind one could, else ``aimed`` if an aimed one could, else ``unexplained``. A freeze could
    when its worker held one of the calls while another call began after the SIGSTOP. It held
    the call in hand at the SIGSTOP (its latest start, its side effect not written, or written
    within ``SETTLED`` before: its ack may wait that long), or the first one it began after the
    SIGCONT (frozen after its lease check, before its start marker)."""
    modes = set()
    for stop in stops:
        for run in same:
            starts = by_pid.get(run.pid, [])
            if run.started <= stop["at"]:
                in_hand = not any(run.started < s <= stop["at"] for s in starts)
                held = in_hand and (run.done is None or run.done >= stop["at"] - SETTLED)
            else:
                first = not any(stop["at"] < s < run.started for s in starts)
                held = first and run.started <= stop["until"] + 0.5
            if run.pid in stop["pids"] and held and any(o.started > stop["at"] for o in same if o is not run):
                modes.add(stop["mode"])
    return "blind" if "blind" in modes else "aimed" if "aimed" in modes else "unexplained"


def outcome(attempt: int, at: float, job_runs: list[Run], end: str) -> str:
    """What became of the run (``attempt``) an aimed freeze caught at ``at``: ``lost_uncounted``
    (called again under the same attempt number), ``lost_counted`` (called again under a later
    one, or failed as a lost worker) or ``kept``."""
    after = [r for r in job_runs if r.started > at]
    if any(r.attempt == attempt for r in after):
        return "lost_uncounted"
    if after or end == "failed_worker_lost":
        return "lost_counted"
    return "kept"


def _rounded(runs: list[Run]) -> list[dict[str, Any]]:
    return [{"attempt": r.attempt, "pid": r.pid, "started": round(r.started, 3)} for r in runs]
