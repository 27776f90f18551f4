"""The chaos battery's one job handler (``JOBS["HANDLERS"]["chaos"]``).

Every run INSERTs a start marker into ``chaos_run`` (job id, attempt, pid, start time), does what
its payload's ``action`` says, and a healthy run then sleeps ``ms`` milliseconds and INSERTs its
side effect into ``chaos_effect``. Both are plain INSERTs (no upsert), so a job that runs twice
shows two rows: duplicates are countable, and the timestamps say when each run happened.

A payload with ``durable`` (the dbrestart scenario) writes both rows through a connection of its
own (psycopg, not Django's), retried through a database outage: the body's bookkeeping then
never fails because of the restart under test, and never heals the worker's own connection
(the worker must reconnect by itself). Each row carries a per-run token with a unique index, so
a retried INSERT whose first try committed cannot add a row. ``fail_late`` runs like ``ok`` (a
long sleep) and then raises instead of writing its side effect.

A class handler (not ``@job``) because it needs the job id and the attempt number from the
context. Times are ``time.time()`` of the worker, the same clock the driver stamps its chaos
events with (one machine).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import Any

from django.db import connection

TABLES = """
CREATE TABLE IF NOT EXISTS chaos_run (
    id bigserial PRIMARY KEY, job_id text NOT NULL, attempt integer NOT NULL, pid integer NOT NULL,
    started_at double precision NOT NULL, action text NOT NULL, bad boolean NOT NULL DEFAULT false,
    token text);
CREATE INDEX IF NOT EXISTS chaos_run_job ON chaos_run (job_id);
CREATE UNIQUE INDEX IF NOT EXISTS chaos_run_token ON chaos_run (token);
CREATE TABLE IF NOT EXISTS chaos_effect (
    id bigserial PRIMARY KEY, job_id text NOT NULL, attempt integer NOT NULL, pid integer NOT NULL,
    started_at double precision NOT NULL, done_at double precision NOT NULL, bad boolean NOT NULL DEFAULT false,
    token text);
CREATE INDEX IF NOT EXISTS chaos_effect_job ON chaos_effect (job_id);
CREATE UNIQUE INDEX IF NOT EXISTS chaos_effect_token ON chaos_effect (token);
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
        if payload.get("durable"):
            return self._durable(context, payload, action, started, pid)
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

    def _durable(self, context: Any, payload: dict[str, Any], action: str, started: float, pid: int) -> str:
        token = uuid.uuid4().hex
        _insert_retrying(
            "INSERT INTO chaos_run (job_id, attempt, pid, started_at, action, token) VALUES (%s, %s, %s, %s, %s, %s) "
            "ON CONFLICT (token) DO NOTHING",
            [context.job_id, context.attempt, pid, started, action, token],
        )
        time.sleep(float(payload.get("ms", 5)) / 1000)
        if action == "fail_late":
            raise RuntimeError("fail_late: this long job always raises at its end")
        _insert_retrying(
            "INSERT INTO chaos_effect (job_id, attempt, pid, started_at, done_at, token) "
            "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (token) DO NOTHING",
            [context.job_id, context.attempt, pid, started, time.time(), token],
        )
        return action


def _insert_retrying(query: str, params: list[Any], timeout: float = 300) -> None:
    """One INSERT on a fresh psycopg connection, retried until the database answers."""
    import psycopg
    from django.conf import settings

    db = settings.DATABASES["default"]
    deadline = time.monotonic() + timeout
    while True:
        try:
            with psycopg.connect(
                host=db["HOST"],
                port=db["PORT"],
                user=db["USER"],
                password=db.get("PASSWORD") or None,
                dbname=db["NAME"],
                autocommit=True,
                connect_timeout=3,
            ) as conn:
                conn.execute(query, params)
            return
        except psycopg.OperationalError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
