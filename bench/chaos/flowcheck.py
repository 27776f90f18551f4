"""The verdicts of the ``flows`` scenario (bench/chaos/flows.py) from what was recorded: every
run's start marker, every side effect, each job's final state. No Django: the rules can be
checked on made-up records (tests/unit/test_chaos_flowcheck.py).

Times are ``time.time()`` of the workers; a run is ``(attempt, pid, started)``, a side effect
``(attempt, pid, started, done)``, both in time order.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

from .attribution import attribute_rerun

PARENT_FAILED = "ParentFailed"

Run = tuple[int, int, float]
Effect = tuple[int, int, float, float]


@dataclass
class Spec:
    """One job of the scenario: what it is and how it must end."""

    role: str  # step | member | callback | late
    flow: int  # its chain's or group's number (a late dependent: its own)
    action: str  # ok | raise
    expected: str  # completed | failed (its own design) | parent_failed (never runs)
    parents: tuple[str, ...] = ()
    dispatched: float = 0.0  # time.time() when it was sent


def check(
    specs: dict[str, Spec],
    runs: dict[str, list[Run]],
    effects: dict[str, list[Effect]],
    states: dict[str, str],
    errors: dict[str, str],
    event_log: list[dict[str, Any]],
    origin: float,
) -> dict[str, Any]:
    """The figures: jobs lost, order violations, runs beyond one per job and their causes, and
    the release latencies (``release_latency_s``: seconds per role, unsorted). ``states``: ``completed`` / ``failed`` / anything else per job id;
    ``errors``: the first line of a failed job's ``last_error``, where it is known; ``event_log``: the chaos events
    relative to ``origin`` (``Event.as_dict``)."""

    def finished(job_id: str) -> float | None:
        """When the job finished for its dependents: its last side effect (with SIGKILL and
        SIGTERM only, no run writes one after its job was settled); a job that failed, its last
        run's start (it raises at once); None if it never ran."""
        if effects.get(job_id):
            return max(e[3] for e in effects[job_id])
        if runs.get(job_id):
            return max(r[2] for r in runs[job_id])
        return None

    # Lost: not ended as designed.
    lost: list[dict[str, Any]] = []
    wrong_error = 0
    for job_id, spec in specs.items():
        state = states.get(job_id)
        if spec.expected == "completed":
            ok = state == "completed" and bool(effects.get(job_id))
        elif spec.expected == "failed":
            ok = state == "failed"
        else:
            ok = state == "failed" and not runs.get(job_id)
            wrong_error += ok and job_id in errors and not errors[job_id].startswith(PARENT_FAILED)
        if not ok:
            lost.append(
                {
                    "id": job_id,
                    "role": spec.role,
                    "expected": spec.expected,
                    "state": state,
                    "runs": len(runs.get(job_id, [])),
                    "effects": len(effects.get(job_id, [])),
                    "error": errors.get(job_id),
                    "parents": list(spec.parents),
                }
            )

    # Order: no run before every parent finished, and none at all after a parent that failed
    # (a callback runs however its members ended).
    out_of_order: list[dict[str, Any]] = []
    latency: dict[str, list[float]] = {"step": [], "callback": [], "late": []}
    for job_id, spec in specs.items():
        if not spec.parents or not runs.get(job_id):
            continue
        start = runs[job_id][0][2]
        callback = spec.role == "callback"
        if not callback and any(specs[p].expected != "completed" for p in spec.parents if p in specs):
            out_of_order.append({"id": job_id, "role": spec.role, "why": "ran although a parent failed"})
            continue
        ends = [finished(p) for p in spec.parents]
        if not callback and None in ends:
            out_of_order.append({"id": job_id, "role": spec.role, "why": "ran before its parent ever ran"})
            continue
        end = max((e for e in ends if e is not None), default=None)
        if end is None:
            continue  # a callback whose members all failed without a run (killed before it began)
        if start < end:
            out_of_order.append(
                {"id": job_id, "role": spec.role, "why": f"first run {end - start:.3f}s before its parents finished"}
            )
        else:
            # A late dependent may be sent after its parent finished: it is ready from then.
            latency[spec.role].append(start - max(end, spec.dispatched))

    # Runs beyond one per job, each attributed to a kill or to nothing.
    extra: Counter[str] = Counter()
    extra_by_role: dict[str, Counter[str]] = {}
    after_kill: list[dict[str, Any]] = []
    twice: list[dict[str, Any]] = []
    for job_id, job_runs in runs.items():
        if len(job_runs) < 2 or job_id not in specs:
            continue
        rel = [{"pid": pid, "started": round(started - origin, 3)} for _a, pid, started in job_runs]
        causes = [attribute_rerun(run, nxt["started"], event_log) for run, nxt in itertools.pairwise(rel)]
        role = specs[job_id].role
        for cause in causes:
            extra[cause] += 1
            extra_by_role.setdefault(role, Counter())[cause] += 1
        if role == "callback":
            (twice if "unattributed" in causes else after_kill).append({"id": job_id, "runs": rel, "causes": causes})

    bad_ids = {item["id"] for item in out_of_order}
    callbacks = [j for j, s in specs.items() if s.role == "callback"]
    chains: dict[int, list[str]] = {}
    for job_id, spec in specs.items():
        if spec.role == "step":
            chains.setdefault(spec.flow, []).append(job_id)
    return {
        "jobs": len(specs),
        "jobs_by_role": dict(Counter(s.role for s in specs.values())),
        "expected": dict(Counter(s.expected for s in specs.values())),
        "lost": len(lost),
        "lost_ids": lost[:20],
        "lost_by_role": dict(Counter(item["role"] for item in lost)),
        "completed": sum(
            1 for j, s in specs.items() if s.expected == "completed" and states.get(j) == "completed" and effects.get(j)
        ),
        "failed_by_design": sum(1 for s in specs.values() if s.expected == "failed"),
        "settled_by_parent": sum(
            1 for j, s in specs.items() if s.expected == "parent_failed" and states.get(j) == "failed"
        ),
        "settled_by_parent_with_another_error": wrong_error,
        "out_of_order": len(out_of_order),
        "out_of_order_detail": out_of_order[:20],
        "chains_in_order": sum(1 for steps in chains.values() if not bad_ids.intersection(steps)),
        "groups_in_order": sum(1 for j in callbacks if j not in bad_ids),
        "callbacks": len(callbacks),
        "callbacks_completed": sum(1 for j in callbacks if states.get(j) == "completed" and effects.get(j)),
        "callbacks_run_more_than_once": len(after_kill) + len(twice),
        "callbacks_rerun_after_kill": len(after_kill),
        "callbacks_released_twice": len(twice),
        "callbacks_rerun_detail": (twice + after_kill)[:10],
        "extra_runs": sum(extra.values()),
        "extra_runs_by_cause": dict(extra),
        "extra_runs_by_role": {role: dict(c) for role, c in extra_by_role.items()},
        "jobs_with_duplicate_effects": sum(1 for j in specs if len(effects.get(j, [])) > 1),
        "release_latency_s": latency,
    }
