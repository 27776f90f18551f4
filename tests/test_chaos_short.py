"""The chaos battery's short version (``bench/chaos.py --short``) against PostgreSQL and Redis.

``bench/chaos.py`` runs real ``jobs_work`` processes against a database it creates for itself
(``chaos_ci_<pid>_<backend>``, dropped at the end) and, for Redis, a PRIVATE ``redis-server`` it
starts on a free port (never the shared one). Two scenarios, ~300 jobs each:

- crash: three workers drain 300 jobs while the script SIGKILLs one every few seconds (and
  restarts it), SIGSTOPs another past its 2 s lease (then SIGCONTs it), and, on Redis, kills
  and restarts the server twice. In ``--short`` mode the shared PostgreSQL server is NOT
  restarted: the other test files of this pytest process use it.
- tamper: 300 bad messages (garbage, wrong signing key, replayed onto another queue, oversize)
  interleaved with 300 good ones, written straight into the table / the Redis keys.

Only outcomes are asserted (nothing lost, nothing bad executed, no worker crash, chaos did
happen); the figures (duplicates, latencies, throughput) vary with the machine and are printed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
from django.conf import settings

from tests.conftest import require_service
from tests.procs import REPO_ROOT

SCRIPT = REPO_ROOT / "bench" / "chaos.py"


def run_chaos(backend: str, tmp_path: Any) -> tuple[dict[str, Any], str]:
    db = settings.DATABASES["postgres"]
    out = tmp_path / f"chaos-{backend}.json"
    # One database per session and backend: concurrent sessions on one server never collide.
    name = f"chaos_ci_{os.getpid()}_{backend}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JOBS_TEST_", "CHAOS_"))}
    env["CHAOS_PG_PASSWORD"] = db.get("PASSWORD") or ""
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--backend",
            backend,
            "--scenario",
            "crash,tamper",
            "--short",
            "--db-name",
            name,
            "--pg-host",
            db["HOST"],
            "--pg-port",
            str(db["PORT"]),
            "--pg-user",
            db["USER"],
            "--out",
            str(out),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    log = f"exit {proc.returncode}\n--- stderr (tail)\n{proc.stderr[-6000:]}"
    assert out.exists(), f"bench/chaos.py wrote no report\n{log}"
    report = json.loads(out.read_text())
    assert proc.returncode == 0 and not report["errors"], f"{report['errors']}\n{log}"
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


@pytest.mark.slow
@pytest.mark.postgres
def test_chaos_short_on_postgres(postgres_up, tmp_path, capsys):
    report, log = run_chaos("postgres", tmp_path)
    assert report["scenarios"]["crash"]["broker_restarts_enabled"] is False, "--short must not restart PostgreSQL"
    summary = check(report, log, broker_restarts=0)
    with capsys.disabled():
        print("\n" + summary)


@pytest.mark.slow
@pytest.mark.postgres
def test_chaos_short_on_redis(postgres_up, redis_up, tmp_path, capsys):
    require_service("redis-server", shutil.which("redis-server") is not None, "redis-server is not on PATH")
    report, log = run_chaos("redis", tmp_path)
    # The private redis-server is killed and restarted from its AOF twice.
    summary = check(report, log, broker_restarts=2)
    with capsys.disabled():
        print("\n" + summary)
