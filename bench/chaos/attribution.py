"""Which chaos event explains a duplicated side effect (no Django: bench/chaos/report.py uses
it on stored JSON reports too)."""

from __future__ import annotations

from typing import Any


def attribute(effects: list[dict[str, Any]], event_log: list[dict[str, Any]]) -> str:
    """Which chaos event explains a job's duplicate side effects: ``stop``, ``kill``,
    ``restart`` or ``unattributed``. ``effects``: the job's side-effect rows (pid, started, done);
    ``event_log``: the events; both in seconds relative to the run's start.

    - stop: one of its runs was by a frozen worker and overlapped the freeze (it began before
      the SIGCONT, possibly claimed before the SIGSTOP and started right after the SIGCONT, and
      wrote its effect after, or just before, the SIGSTOP), and another run began after the
      SIGSTOP;
    - kill: one of its runs was by a killed worker and wrote its effect at most 0.5 s before the
      SIGKILL (the settle never happened), and another run began after the SIGKILL;
    - restart: one of its runs overlapped the outage, give or take the ~4 s a worker retries a
      settle.
    Worker-specific causes are tried first, a restart (any worker) last.
    """
    for kind in ("stop", "kill", "restart"):
        for event in (e for e in event_log if e["kind"] == kind):
            for run in effects:
                pid, started, done = run["pid"], run["started"], run["done"]
                # A stop or a kill explains a duplicate only if another run of the job began after it.
                rerun = any(other is not run and other["started"] > event["at"] for other in effects)
                if kind == "stop":
                    hit = (
                        pid in event["pids"] and rerun and started <= event["until"] + 0.5 and done >= event["at"] - 0.5
                    )
                elif kind == "kill":
                    hit = pid in event["pids"] and rerun and event["at"] - 0.5 <= done <= event["at"] + 0.05
                else:
                    hit = started <= event["until"] + 1.0 and done >= event["at"] - 5.0
                if hit:
                    return kind
    return "unattributed"


def attribute_rerun(run: dict[str, Any], next_started: float, event_log: list[dict[str, Any]]) -> str:
    """Why a job ran again after ``run`` (its start marker: pid, started), the next run having
    begun at ``next_started``: ``kill`` when the worker running it was SIGKILLed after the run
    began and before the next one began (its settle never happened: the lease expired and the
    job was claimed again, at-least-once delivery); otherwise ``unattributed``, which for a job
    whose parents released it means it was made ready twice. Relative times, as in ``attribute``.
    """
    for event in event_log:
        if event["kind"] == "kill" and run["pid"] in event["pids"] and run["started"] <= event["at"] <= next_started:
            return "kill"
    return "unattributed"
