"""The verdicts of the chaos battery's ``flows`` scenario (bench/chaos/flowcheck.py) on made-up
records: each rule the process test relies on reports a violation when there is one."""

from __future__ import annotations

from typing import Any

from bench.chaos.flowcheck import Spec, check

ORIGIN = 1000.0


def flow() -> dict[str, Spec]:
    """A chain a -> b, a group (m1, m2) with callback cb, and a chain x -> y whose x fails."""
    return {
        "a": Spec("step", 0, "ok", "completed"),
        "b": Spec("step", 0, "ok", "completed", ("a",)),
        "m1": Spec("member", 0, "ok", "completed"),
        "m2": Spec("member", 0, "raise", "failed"),
        "cb": Spec("callback", 0, "ok", "completed", ("m1", "m2")),
        "x": Spec("step", 1, "raise", "failed"),
        "y": Spec("step", 1, "ok", "parent_failed", ("x",)),
    }


def records() -> dict[str, Any]:
    """A run that went as designed: (attempt, pid, started) runs, (.., done) side effects."""
    runs = {
        "a": [(1, 11, 1001.0)],
        "b": [(1, 12, 1002.0)],
        "m1": [(1, 11, 1001.0)],
        "m2": [(1, 12, 1001.5)],
        "cb": [(1, 13, 1003.0)],
        "x": [(1, 13, 1001.0)],
    }
    effects = {
        "a": [(1, 11, 1001.0, 1001.1)],
        "b": [(1, 12, 1002.0, 1002.1)],
        "m1": [(1, 11, 1001.0, 1001.2)],
        "cb": [(1, 13, 1003.0, 1003.1)],
    }
    states = {"a": "completed", "b": "completed", "m1": "completed", "m2": "failed", "cb": "completed"}
    states.update({"x": "failed", "y": "failed"})
    errors = {"m2": "RuntimeError: poison", "x": "RuntimeError: poison", "y": "ParentFailed: parent x failed"}
    return {"runs": runs, "effects": effects, "states": states, "errors": errors, "event_log": []}


def verdict(specs: dict[str, Spec], data: dict[str, Any]) -> dict[str, Any]:
    return check(specs, data["runs"], data["effects"], data["states"], data["errors"], data["event_log"], ORIGIN)


def test_a_run_as_designed_has_no_violation():
    result = verdict(flow(), records())
    assert result["lost"] == 0 and result["out_of_order"] == 0, result
    assert result["chains_in_order"] == 2 and result["groups_in_order"] == 1
    assert result["callbacks_completed"] == 1 and result["callbacks_run_more_than_once"] == 0
    assert result["settled_by_parent"] == 1 and result["settled_by_parent_with_another_error"] == 0
    assert result["release_latency_s"]["step"] == [1002.0 - 1001.1]
    assert result["release_latency_s"]["callback"] == [1003.0 - 1001.5]  # after the failed member's run


def test_a_step_that_starts_before_its_parent_finished_is_out_of_order():
    data = records()
    data["runs"]["b"] = [(1, 12, 1001.05)]
    result = verdict(flow(), data)
    assert result["out_of_order"] == 1 and result["out_of_order_detail"][0]["id"] == "b"
    assert result["chains_in_order"] == 1


def test_a_callback_that_starts_before_a_member_finished_is_out_of_order():
    data = records()
    data["runs"]["cb"] = [(1, 13, 1001.15)]
    result = verdict(flow(), data)
    assert [d["id"] for d in result["out_of_order_detail"]] == ["cb"] and result["groups_in_order"] == 0


def test_a_job_after_a_failed_parent_that_runs_is_lost_and_out_of_order():
    data = records()
    data["runs"]["y"] = [(1, 11, 1002.0)]
    result = verdict(flow(), data)
    assert result["lost"] == 1 and result["lost_ids"][0]["id"] == "y"
    assert result["out_of_order_detail"] == [{"id": "y", "role": "step", "why": "ran although a parent failed"}]


def test_a_job_left_waiting_or_settled_with_another_error_is_reported():
    data = records()
    data["states"]["b"] = "waiting"
    data["errors"]["y"] = "WorkerLost: lease expired"
    result = verdict(flow(), data)
    assert result["lost"] == 1 and result["lost_ids"][0]["state"] == "waiting"
    assert result["settled_by_parent_with_another_error"] == 1


def test_a_callback_run_twice_is_blamed_on_a_kill_only_if_its_worker_was_killed():
    data = records()
    data["runs"]["cb"] = [(1, 13, 1003.0), (2, 14, 1006.0)]
    # No kill explains the second run: the callback was released twice.
    result = verdict(flow(), data)
    assert result["callbacks_released_twice"] == 1 and result["callbacks_rerun_after_kill"] == 0
    assert result["extra_runs_by_cause"] == {"unattributed": 1}
    # A kill of another worker explains nothing.
    data["event_log"] = [{"kind": "kill", "at": 3.5, "pids": [12]}]
    assert verdict(flow(), data)["callbacks_released_twice"] == 1
    # The worker running the first run was SIGKILLed before the second began: at-least-once.
    data["event_log"] = [{"kind": "kill", "at": 3.5, "pids": [13]}]
    result = verdict(flow(), data)
    assert result["callbacks_rerun_after_kill"] == 1 and result["callbacks_released_twice"] == 0
    assert result["callbacks_run_more_than_once"] == 1
