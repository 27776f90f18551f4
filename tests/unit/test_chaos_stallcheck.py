"""The verdicts of the chaos battery's ``stall`` scenario (bench/chaos/stallcheck.py) on made-up
records: an uncounted re-run is found and blamed on the freeze that explains it, and the runs
the aimed freezes caught are classified."""

from __future__ import annotations

from typing import Any

from bench.chaos.stallcheck import check

W1, W2 = 11, 12  # the forked worker processes of two workers (pids)


def stop(at: float, pid: int, mode: str) -> dict[str, Any]:
    return {"kind": "stop", "at": at, "until": at + 4.0, "slot": 0, "pids": [pid - 10, pid], "mode": mode}


def verdict(
    markers: dict[str, list[tuple[int, int, float]]],
    stops: list[dict[str, Any]],
    *,
    budgets: dict[str, int] | None = None,
    ends: dict[str, str] | None = None,
    caught: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Every run wrote its side effect 0.2 s after its start."""
    budgets = budgets or dict.fromkeys(markers, 0)
    effects = {j: [(a, pid, s, s + 0.2) for a, pid, s in rows] for j, rows in markers.items()}
    ends = {j: "completed" for j in budgets} | (ends or {})
    return check(budgets, markers, effects, ends, stops, caught or [])


def test_a_lost_run_that_counted_is_no_uncounted_rerun():
    result = verdict({"a": [(1, W1, 1.0), (2, W2, 6.0)]}, [stop(1.16, W1, "aimed")], budgets={"a": 2})
    assert (result["uncounted_reruns"], result["calls_over_budget"]) == (0, 0), result


def test_a_repeated_attempt_after_an_aimed_freeze_is_an_uncounted_rerun_over_budget():
    result = verdict({"a": [(1, W1, 1.0), (1, W2, 6.0)]}, [stop(1.16, W1, "aimed")])
    assert result["uncounted_reruns_by_cause"] == {"aimed": 1}
    assert (result["uncounted_reruns_not_blind"], result["calls_over_budget_not_blind"]) == (1, 1), result


def test_one_a_blind_freeze_explains_is_counted_apart():
    result = verdict({"a": [(1, W1, 1.0), (1, W2, 6.0)]}, [stop(1.02, W1, "blind")])
    assert result["uncounted_reruns_by_cause"] == {"blind": 1}
    assert (result["uncounted_reruns_not_blind"], result["calls_over_budget"]) == (0, 1)
    assert result["calls_over_budget_not_blind"] == 0


def test_a_blind_freeze_explains_the_run_begun_just_after_its_sigcont():
    """Frozen after its lease check, before its start marker: the marker comes after the SIGCONT."""
    result = verdict({"a": [(1, W2, 3.0), (1, W1, 5.1)]}, [stop(1.0, W1, "blind")])
    assert result["uncounted_reruns_by_cause"] == {"blind": 1}


def test_a_freeze_of_another_worker_or_after_the_run_ended_explains_nothing():
    markers = {"a": [(1, W1, 1.0), (1, W2, 6.0)]}
    assert verdict(markers, [stop(1.1, W2, "blind")])["uncounted_reruns_by_cause"] == {"unexplained": 1}
    # W1's run wrote its side effect at 1.2 and was acked: a freeze at 2.0 held nothing.
    assert verdict(markers, [stop(2.0, W1, "blind")])["uncounted_reruns_by_cause"] == {"unexplained": 1}
    # W1 had begun another run since: the freeze held that one.
    markers["b"] = [(1, W1, 1.5)]
    assert verdict(markers, [stop(1.6, W1, "blind")])["uncounted_reruns_by_cause"] == {"unexplained": 1}


def test_the_runs_the_aimed_freezes_caught():
    markers = {
        "counted": [(1, W1, 1.0), (2, W2, 6.0)],
        "failed": [(1, W1, 10.0)],
        "uncounted": [(1, W2, 1.0), (1, W1, 7.0)],
        "kept": [(1, W1, 20.0)],
    }
    stops = [stop(1.2, W1, "aimed"), stop(10.2, W1, "aimed"), stop(1.2, W2, "aimed"), stop(20.2, W1, "aimed")]
    caught = [{"at": s["at"], "job_id": j, "attempt": 1} for s, j in zip(stops, markers, strict=True)]
    result = verdict(
        markers,
        stops,
        budgets={"counted": 2, "failed": 0, "uncounted": 2, "kept": 0},
        ends={"failed": "failed_worker_lost"},
        caught=caught,
    )
    assert result["aimed_runs"] == {"lost_counted": 2, "lost_uncounted": 1, "kept": 1}, result["aimed_log"]
    assert [c["run"] for c in result["aimed_log"]] == ["lost_counted", "lost_counted", "lost_uncounted", "kept"]
    assert (result["completed"], result["failed_worker_lost"], result["lost"]) == (3, 1, 0)
