"""The chaos battery's one job handler (``JOBS["HANDLERS"]["chaos"]``).

Every run INSERTs a start marker into ``chaos_run`` (job id, attempt, pid, start time), does what
its payload's ``action`` says, and a healthy run then sleeps ``ms`` milliseconds and INSERTs its
side effect into ``chaos_effect``. Both are plain INSERTs (no upsert), so a job that runs twice
shows two rows: duplicates are countable, and the timestamps say when each run happened.

A class handler (not ``@job``) because it needs the job id and the attempt number from the
context. Times are ``time.time()`` of the worker, the same clock the driver stamps its chaos
events with (one machine).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from django.db import connection

TABLES = """
CREATE TABLE IF NOT EXISTS chaos_run (
    id bigserial PRIMARY KEY, job_id text NOT NULL, attempt integer NOT NULL, pid integer NOT NULL,
    started_at double precision NOT NULL, action text NOT NULL, bad boolean NOT NULL DEFAULT false);
CREATE INDEX IF NOT EXISTS chaos_run_job ON chaos_run (job_id);
CREATE TABLE IF NOT EXISTS chaos_effect (
    id bigserial PRIMARY KEY, job_id text NOT NULL, attempt integer NOT NULL, pid integer NOT NULL,
    started_at double precision NOT NULL, done_at double precision NOT NULL, bad boolean NOT NULL DEFAULT false);
CREATE INDEX IF NOT EXISTS chaos_effect_job ON chaos_effect (job_id);
"""


class ChaosHandler:
    """``action``: ok (sleep ``ms``, then the side effect) | raise | exit (``os._exit``) |
    hang (sleeps past a soft timeout) | hang_masked (blocks SIGALRM: only the hard timeout ends it)."""

    def handle(self, context: Any) -> str:
        payload = context.payload if isinstance(context.payload, dict) else {}
        action = str(payload.get("action", "ok"))
        bad = bool(payload.get("bad"))  # set only on the tamper flood's messages: must never run
        started = time.time()
        pid = os.getpid()
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO chaos_run (job_id, attempt, pid, started_at, action, bad) VALUES (%s, %s, %s, %s, %s, %s)",
                [context.job_id, context.attempt, pid, started, action, bad],
            )
        if action == "raise":
            raise RuntimeError("poison: this job always raises")
        if action == "exit":
            os._exit(3)
        if action == "hang":
            time.sleep(3600)  # the soft timeout (SIGALRM) interrupts this
        if action == "hang_masked":
            # Like a C call that never returns to the interpreter: no signal reaches it, so only
            # the heartbeat's hard timeout ends the attempt (and the process).
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM})
            time.sleep(3600)
        time.sleep(float(payload.get("ms", 5)) / 1000)
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO chaos_effect (job_id, attempt, pid, started_at, done_at, bad) "
                "VALUES (%s, %s, %s, %s, %s, %s)",
                [context.job_id, context.attempt, pid, started, time.time(), bad],
            )
        return action
