"""The chaos battery's short version (``bench/chaos_battery.py --short``) against PostgreSQL (direct,
and through a PgBouncer of its own in transaction mode: ``--pgbouncer``), Redis and a Redis
Cluster, and a failover under Redis Sentinel.

``bench/chaos_battery.py`` runs real ``jobs_work`` processes against a PRIVATE PostgreSQL server it
initdb's and starts on a free loopback port (its own temp dir, never the shared server) and, for
Redis, a PRIVATE ``redis-server`` on a free port. Scenarios, ~300 jobs each:

- crash: three workers drain 300 jobs while the script SIGKILLs one every few seconds (and
  restarts it), SIGSTOPs another past its 2 s lease (then SIGCONTs it), and crash-restarts the
  backend's server twice (the private PostgreSQL, or the private redis-server; on a private
  Redis Cluster of three primaries with a replica each, the primary of the ``default`` queue is
  SIGKILLed and its replica promoted, twice). The shared
  servers the other test files use are never touched.
- tamper: 300 bad messages (garbage, wrong signing key, replayed onto another queue, oversize)
  interleaved with 300 good ones, written straight into the table / the Redis keys.
- dbrestart (PostgreSQL): the private server is crash-restarted while three 6 s jobs (three
  times the 2 s lease) run, and again while the workers are idle: every job must run exactly
  once and end with its record (completed, or failed with its own error), none reaped while it
  ran.
- flows: 60 chains of 5 steps, 15 groups of 10 with a callback and 40 late dependents, some
  designed to fail, while one worker is SIGKILLed every 1.5 s and another SIGTERMed every 3 s:
  every job ends as designed, no step or callback starts before its parents finished, and no
  callback runs twice unless the worker running it was killed.
- stall: 90 jobs of 150-300 ms (half with ``max_retries=0``, half with 2), batches on, while a
  worker is SIGSTOPped for twice its lease every 1.5 s, mostly inside a run begun 0.15 s before
  (its start is recorded by then), then SIGCONTed: every job ends completed or failed with
  ``WorkerLost``, no handler is called more than ``max_retries + 1`` times, and no run is called
  again under the same attempt number (an uncounted re-run) unless a blind freeze, which may
  land within the ack interval after a start, explains it.

- failover (a private Sentinel group: primary, replica, three sentinels): three workers drain
  150 jobs while 5 more are dispatched every 0.1 s; ``SENTINEL FAILOVER``, then a SIGKILL of the
  primary: the workers follow each new primary by themselves, and an acknowledged job is missing
  only if the old primary acknowledged it around a failover (asynchronous replication).

Only outcomes are asserted (nothing lost, nothing bad executed, nothing out of order, no worker
crash, chaos did happen); the figures (duplicates, latencies, throughput) vary with the machine and are printed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import require_service
from tests.procs import REPO_ROOT
from tests.servers import postgres_bindir

SCRIPT = REPO_ROOT / "bench" / "chaos_battery.py"


def run_chaos(backend: str, tmp_path: Any, scenarios: str, *options: str) -> tuple[dict[str, Any], str]:
    out = tmp_path / f"chaos-{backend}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JOBS_TEST_", "CHAOS_"))}
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--backend",
            backend,
            "--scenario",
            scenarios,
            "--short",
            "--out",
            str(out),
            *options,
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    log = f"exit {proc.returncode}\n--- stderr (tail)\n{proc.stderr[-6000:]}"
    assert out.exists(), f"bench/chaos_battery.py wrote no report\n{log}"
    report = json.loads(out.read_text())
    assert proc.returncode == 0 and not report["errors"], f"{report['errors']}\n{log}"
    assert report["postgres_server"].startswith("private"), report["postgres_server"]
    return report, log


def check(report: dict[str, Any], log: str, *, broker_restarts: int) -> str:
    crash = report["scenarios"]["crash"]
    for run in ("clean", "chaos"):
        figures = crash[run]
        details = json.dumps(
            {k: figures[k] for k in ("lost_ids", "supervisor_restart_lines", "unexpected_exits", "event_log")}, indent=1
        )
        # Every job has a side effect and ended completed, whatever was killed or stopped.
        assert figures["lost"] == 0, f"{run}: {figures['lost']} job(s) lost\n{details}\n{log}"
        assert figures["completed"] == crash["jobs"], f"{run}: {figures['completed']}/{crash['jobs']} completed"
        # Our own SIGKILLs are not crashes: these are jobs_work restarts and exits nobody asked for.
        assert figures["worker_crashes"] == 0, f"{run}: worker crashes\n{details}\n{log}"
        # After the final SIGTERM: every worker exited 0 and no lease was left behind.
        assert set(figures["exit_codes_on_sigterm"].values()) == {0}, figures["exit_codes_on_sigterm"]
        assert figures["leases_left"] == 0 and figures["backlog_after"] == 0, figures
    chaos = crash["chaos"]
    # Not vacuous: the chaos happened while jobs were still queued (the first kill is due after
    # 1.5 s, the first stop after 3 s; 300 jobs of 50 ms on 3 workers take at least 5 s).
    assert chaos["events"].get("kill", 0) >= 1 and chaos["events"].get("stop", 0) >= 1, chaos["event_log"]
    assert chaos["events"].get("restart", 0) == broker_restarts, chaos["event_log"]

    tamper = report["scenarios"]["tamper"]
    assert tamper["bad_executed"] == 0 and tamper["bad_side_effects"] == 0, tamper
    assert tamper["worker_crashes"] == 0, (tamper["supervisor_restart_lines"], tamper["unexpected_exits"], log)
    assert tamper["good_completed"] == tamper["good"], tamper
    assert tamper["rejected_total"] == tamper["bad"], tamper["rejected_by_reason"]

    return (
        f"[chaos --short {report['backend']}] lost 0/{crash['jobs']}; events {chaos['events']}; "
        f"duplicate jobs {chaos['duplicate_jobs']} {chaos['duplicates_by_cause']}; stale acks rejected "
        f"{chaos['stale_acks_rejected']}; throughput {chaos['throughput_jobs_per_s']} vs clean "
        f"{crash['clean']['throughput_jobs_per_s']} jobs/s | tamper: {tamper['good_completed']}/{tamper['good']} "
        f"good completed, {tamper['bad_executed']} of {tamper['bad']} bad executed {tamper['rejected_by_reason']}"
    )


def check_dbrestart(report: dict[str, Any], log: str) -> str:
    result = report["scenarios"]["dbrestart"]
    lines = []
    for name, phase in result["phases"].items():
        details = json.dumps(
            {k: phase[k] for k in ("restart", "worker_log", "log_lines", "job_detail", "unexpected_exits")}, indent=1
        )
        # Every job has its final record: completed with its side effect, or failed with its row.
        assert phase["lost"] == 0, f"{name}: {phase['lost']} job(s) lost\n{details}\n{log}"
        assert phase["failed_rows_missing"] == 0, f"{name}: failures without their row\n{details}"
        # The heartbeat kept every lease through the outage: no long job was reaped while it ran.
        assert phase["duplicate_runs"] == 0, f"{name}: {phase['duplicates_by_cause']}\n{details}"
        assert phase["completed_work_recorded_failed"] == 0, f"{name}: completed work recorded failed\n{details}"
        assert phase["fail_late_recorded_with_another_error"] == 0, f"{name}: failures blamed on a lost worker"
        assert phase["ran_exactly_once"] == phase["jobs"], f"{name}: not every job ran exactly once\n{details}"
        assert phase["worker_crashes"] == 0, f"{name}: worker crashes\n{details}"
        assert set(phase["exit_codes_on_sigterm"].values()) == {0} and phase["leases_left"] == 0, phase
        lines.append(f"{name}: {phase['ran_exactly_once']}/{phase['jobs']} ran once")
    return f"[chaos --short {report['backend']} dbrestart] " + "; ".join(lines)


def check_flows(report: dict[str, Any], log: str) -> str:
    flows = report["scenarios"]["flows"]
    details = json.dumps(
        {
            k: flows[k]
            for k in ("lost_ids", "out_of_order_detail", "callbacks_rerun_detail", "unexpected_exits", "event_log")
        },
        indent=1,
    )
    # Every step, member, callback and late dependent ended as designed: completed, failed by
    # its own design, or failed with ParentFailed without a run after a parent that failed.
    assert flows["drained"], f"flows did not drain\n{details}\n{log}"
    assert flows["lost"] == 0, f"{flows['lost']} job(s) lost {flows['lost_by_role']}\n{details}\n{log}"
    assert flows["settled_by_parent"] == flows["expected"]["parent_failed"] > 0, flows["expected"]
    assert flows["settled_by_parent_with_another_error"] == 0, details
    # No job started before its parents finished: chains in order, callbacks after their group.
    assert flows["out_of_order"] == 0, f"out of order\n{details}"
    assert flows["chains_in_order"] == flows["chains"] and flows["groups_in_order"] == flows["groups"], details
    # Each callback ran; a second run only ever after a SIGKILL of the worker running it.
    assert flows["callbacks_completed"] == flows["callbacks"] == flows["groups"], details
    assert flows["callbacks_released_twice"] == 0, f"callbacks released twice\n{details}"
    assert flows["failed_rows_missing"] == 0, f"failed jobs without their row after the sweep\n{details}"
    assert flows["worker_crashes"] == 0, f"worker crashes\n{details}\n{log}"
    assert set(flows["exit_codes_on_sigterm"].values()) == {0} and flows["term_exit_codes"] == [0], flows["terms"]
    assert flows["leases_left"] == 0 and flows["backlog_after"] == 0, flows
    # Not vacuous: workers were killed and stopped while jobs were queued.
    assert flows["events"].get("kill", 0) >= 1 and flows["events"].get("term", 0) >= 1, flows["event_log"]
    return (
        f"[chaos --short {report['backend']} flows] lost 0/{flows['jobs']} {flows['jobs_by_role']}; "
        f"{flows['chains_in_order']} chains and {flows['groups_in_order']} groups in order; events {flows['events']}; "
        f"callbacks re-run after a kill {flows['callbacks_rerun_after_kill']}, released twice 0; "
        f"extra runs {flows['extra_runs_by_cause']}; failed rows written late by the sweep "
        f"{flows['failed_rows_written_late']}, missing 0; "
        f"release latency p50 {flows['release_latency_s']['step']['p50']} s"
    )


def check_stall(report: dict[str, Any], log: str) -> str:
    stall = report["scenarios"]["stall"]
    details = json.dumps(
        {
            k: stall[k]
            for k in (
                "lost_ids",
                "uncounted_detail",
                "calls_over_budget_detail",
                "aimed_log",
                "event_log",
                "unexpected_exits",
            )
        },
        indent=1,
    )
    assert stall["drained"], f"stall did not drain\n{details}\n{log}"
    # Every job ended completed, or failed with WorkerLost once its lost runs spent its retries.
    assert stall["lost"] == 0, f"{stall['lost']} job(s) lost\n{details}\n{log}"
    assert stall["completed"] + stall["failed_worker_lost"] == stall["jobs"], details
    # A run whose start was recorded before its worker froze counts when its lease is lost: it is
    # never run again under the same attempt number, nor past the job's budget of runs.
    assert stall["uncounted_reruns_not_blind"] == 0, (
        f"uncounted re-runs {stall['uncounted_reruns_by_cause']}\n{details}"
    )
    assert stall["calls_over_budget_not_blind"] == 0, f"handler calls over max_retries + 1\n{details}"
    assert stall["worker_crashes"] == 0, f"worker crashes\n{details}\n{log}"
    assert set(stall["exit_codes_on_sigterm"].values()) == {0}, stall["exit_codes_on_sigterm"]
    assert stall["leases_left"] == 0 and stall["backlog_after"] == 0, stall
    # Not vacuous: workers were frozen inside runs, and runs were lost to the reaper meanwhile.
    assert stall["batches"] and stall["freezes"].get("aimed", 0) >= 3, stall["event_log"]
    lost_runs = stall["aimed_runs"]["lost_counted"] + stall["aimed_runs"]["lost_uncounted"]
    assert lost_runs >= 1, f"no aimed freeze lost its run\n{details}"
    return (
        f"[chaos --short {report['backend']} stall] lost 0/{stall['jobs']}; freezes {stall['freezes']} "
        f"(aimed missed {stall['aimed_missed']}); aimed runs {stall['aimed_runs']}; failed WorkerLost "
        f"{stall['failed_worker_lost']}; uncounted re-runs {stall['uncounted_reruns_by_cause']}; calls over "
        f"budget {stall['calls_over_budget']}"
    )


def require_private_servers(*binaries: str) -> None:
    require_service("PostgreSQL binaries (initdb)", postgres_bindir() is not None, "set PG_BINDIR")
    for binary in binaries:
        require_service(binary, shutil.which(binary) is not None, f"{binary} is not on PATH")


@pytest.mark.slow
def test_chaos_short_on_postgres(tmp_path, capsys):
    require_private_servers()
    report, log = run_chaos("postgres", tmp_path, "crash,tamper,dbrestart,flows,stall")
    # The private PostgreSQL server is crash-restarted twice (SIGKILL, 1 s down, WAL replay).
    assert report["scenarios"]["crash"]["broker_restarts_enabled"] is True
    summary = check(report, log, broker_restarts=2)
    summary += "\n" + check_dbrestart(report, log)
    summary += "\n" + check_flows(report, log)
    summary += "\n" + check_stall(report, log)
    with capsys.disabled():
        print("\n" + summary)


@pytest.mark.slow
def test_chaos_short_on_postgres_through_pgbouncer(tmp_path, capsys):
    require_private_servers("pgbouncer")
    report, log = run_chaos("postgres", tmp_path, "crash,tamper,dbrestart", "--pgbouncer")
    assert report["pooler"].startswith("private PgBouncer (transaction pooling"), report["pooler"]
    # The private PostgreSQL behind the pooler is crash-restarted twice; the workers stay
    # connected to the pooler, which fails the transactions in flight and logs in again.
    summary = check(report, log, broker_restarts=2)
    summary += "\n" + check_dbrestart(report, log)
    with capsys.disabled():
        print("\n" + summary.replace("[chaos --short postgres", "[chaos --short postgres through PgBouncer"))


@pytest.mark.slow
def test_chaos_short_on_redis(tmp_path, capsys):
    require_private_servers("redis-server")
    report, log = run_chaos("redis", tmp_path, "crash,tamper,flows,stall")
    # The private redis-server is killed and restarted from its AOF twice.
    summary = check(report, log, broker_restarts=2)
    summary += "\n" + check_flows(report, log)
    summary += "\n" + check_stall(report, log)
    with capsys.disabled():
        print("\n" + summary)


@pytest.mark.slow
def test_chaos_short_on_a_redis_cluster(tmp_path, capsys):
    require_private_servers("redis-server", "redis-cli")
    report, log = run_chaos("redis-cluster", tmp_path, "crash,tamper,flows")
    # A private cluster of three primaries with a replica each: the primary of the `default`
    # queue is SIGKILLed twice and its replica promoted (the killed node rejoins as a replica).
    summary = check(report, log, broker_restarts=2)
    summary += "\n" + check_flows(report, log)
    with capsys.disabled():
        print("\n" + summary)


def check_failover(report: dict[str, Any], log: str) -> str:
    failover = report["scenarios"]["failover"]
    details = json.dumps({k: failover[k] for k in ("lost_ids", "event_log", "unexpected_exits")}, indent=1)
    # The primary was failed over, then killed, while the workers ran and jobs were dispatched.
    assert failover["events"] == {"failover": 1, "kill_primary": 1}, failover["event_log"]
    assert failover["drained"], f"failover did not drain\n{details}\n{log}"
    # An acknowledged dispatch is missing only if the old primary acknowledged it around a
    # failover (asynchronous replication); any other is lost for good.
    assert failover["lost_unexplained"] == 0, f"{failover['lost_unexplained']} job(s) lost\n{details}\n{log}"
    # The workers followed each new primary by themselves: jobs finished after each promotion,
    # and none crashed or was restarted.
    assert all(after is not None for after in failover["resumed_after_s"].values()), failover["resumed_after_s"]
    assert failover["worker_crashes"] == 0, f"worker crashes\n{details}\n{log}"
    assert set(failover["exit_codes_on_sigterm"].values()) == {0}, failover["exit_codes_on_sigterm"]
    assert failover["leases_left"] == 0 and failover["backlog_after"] == 0, failover
    return (
        f"[chaos --short sentinel failover] acknowledged {failover['jobs_acknowledged']}, refused "
        f"{failover['dispatches_refused_jobs']}; lost {failover['lost']} {failover['lost_explained_by_event']} "
        f"(unexplained 0); duplicates {failover['duplicate_jobs']} {failover['duplicates_by_event']}; resumed "
        f"after {failover['resumed_after_s']} s"
    )


@pytest.mark.slow
def test_chaos_short_failover_on_sentinel(tmp_path, capsys):
    require_private_servers("redis-server")
    report, log = run_chaos("sentinel", tmp_path, "failover")
    summary = check_failover(report, log)
    with capsys.disabled():
        print("\n" + summary)
