"""What the driver reads and writes directly: the side-effect tables, and the backend's own state
(rows, Redis keys, beanstalkd tubes), read back independently of the workers.

Every read retries through an outage (the postgres crash scenario restarts the server under the
driver too): a dead connection is closed and reopened.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any
from unittest import mock

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection

from django_jobs.backends import get_backend
from django_jobs.models import Job, JobStatus

QUEUES = ("default", "other")
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (OperationalError, InterfaceError, ConnectionError, OSError)


def _broker_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = list(OUTAGE_ERRORS)
    try:
        import redis

        errors.append(redis.exceptions.RedisError)
    except ImportError:
        pass
    try:
        import greenstalk

        errors.append(greenstalk.Error)
    except (ImportError, AttributeError):
        pass
    return tuple(errors)


RETRYABLE = _broker_errors()


def retrying(action: Any, timeout: float = 120) -> Any:
    """Run ``action()``; on a connection error close everything and try again until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return action()
        except RETRYABLE:
            if time.monotonic() >= deadline:
                raise
            connection.close()
            get_backend("chaos").close()
            time.sleep(0.2)


def sql(query: str, params: Any = None) -> Any:
    def run() -> Any:
        with connection.cursor() as cursor:
            cursor.execute(query, params)
            return cursor.fetchall() if cursor.description else cursor.rowcount

    return retrying(run)


class Probe:
    """Per-backend reads of queue state: backlog, leases held, failures kept."""

    def __init__(self, kind: str, server: Any = None) -> None:
        self.kind = kind
        self.server = server

    @property
    def backend(self) -> Any:
        return get_backend("chaos")

    # -- clearing between runs --

    def reset(self) -> None:
        sql("TRUNCATE django_jobs_job, chaos_run, chaos_effect")
        if self.kind == "redis":
            retrying(lambda: self.redis().flushdb())
        elif self.kind == "beanstalk":
            retrying(self._empty_tubes)
        self.backend.close()

    def redis(self) -> Any:
        """A client of the backend's server, its Sentinel-managed primary, or every primary of
        its cluster (a cluster's flushdb empties each), from the backend's own OPTIONS."""
        from django_jobs.backends import redis_connection

        return redis_connection.connect("probe", self.backend.options, probe=True)

    def _tube(self, queue: str) -> Any:
        import greenstalk

        name = self.backend.tube_name(queue)
        return greenstalk.Client(self.server.address, encoding=None, use=name, watch=name)

    def _empty_tubes(self) -> None:
        import greenstalk

        for queue in QUEUES:
            client = self._tube(queue)
            try:
                for peek in (client.peek_ready, client.peek_delayed, client.peek_buried):
                    while True:
                        try:
                            client.delete(peek())
                        except greenstalk.NotFoundError:
                            break
            finally:
                client.close()

    # -- state --

    def backlog(self) -> int:
        """Messages not settled yet (ready + delayed + leased), every queue."""
        return retrying(lambda: sum(self.backend.size(q) for q in QUEUES))

    def leased(self) -> int:
        """Leases held right now: in_progress rows / processing entries / reserved jobs."""
        if self.kind == "postgres":
            return sql("SELECT count(*) FROM django_jobs_job WHERE status = 'in_progress'")[0][0]
        return retrying(lambda: sum(self.backend.stats(q)["in_progress"] for q in QUEUES))

    def kept_failed(self) -> int:
        """Failures the backend keeps itself: failed rows / the failed zsets / buried jobs."""
        if self.kind == "postgres":
            return sql("SELECT count(*) FROM django_jobs_job WHERE status = 'failed'")[0][0]
        return retrying(lambda: sum(self.backend.stats(q)["failed"] for q in QUEUES))

    def final_states(self, ids: list[str]) -> dict[str, str]:
        """``completed`` / ``failed`` / ``pending`` / ``in_progress`` per job id.

        The database backend keeps a row per job. Redis and beanstalkd keep nothing for a
        completed job: a job is ``failed`` if it has a failed Job row (every permanent failure
        is recorded as one) and otherwise ``completed`` once the queues hold nothing unsettled
        (the caller checks the backlog is 0 and that the job has a side effect).
        """
        states: dict[str, str] = {}
        rows = dict(Job.objects.filter(pk__in=ids).values_list("id", "status")) if ids else {}
        if self.kind == "postgres":
            for job_id in ids:
                states[job_id] = rows.get(job_id, "missing")
            return states
        unsettled = self.backlog()
        for job_id in ids:
            if rows.get(job_id) == JobStatus.FAILED:
                states[job_id] = "failed"
            else:
                states[job_id] = "completed" if unsettled == 0 else "unknown"
        return states

    def write_missing_rows(self) -> int:
        """Redis: the failed rows a kill left unwritten, written now as the reaper's sweep writes
        them a minute after the failure (the fleet has stopped: no worker is still writing one).
        Returns how many. Other backends: 0."""
        if self.kind != "redis":
            return 0
        from django_jobs.backends import redis as redis_backend

        with mock.patch.object(redis_backend, "RECORD_GRACE", 0.0):
            return int(retrying(self.backend.record_missed_failures))

    def kept_failed_ids(self, ids: list[str]) -> set[str]:
        """Redis: the ids of ``ids`` in a queue's failed set, the broker's own record of a
        permanent failure (its failed ``Job`` row is written after it, by the worker). Other
        backends: none (the database's row is the job; beanstalkd is not asked)."""
        if self.kind != "redis" or not ids:
            return set()

        def ask() -> set[str]:
            pipe = self.backend.client.pipeline(transaction=False)
            for queue in QUEUES:
                for job_id in ids:
                    pipe.zscore(self.backend.keys(queue).failed, job_id)
            scores = pipe.execute()
            return {job_id for i, job_id in enumerate(ids * len(QUEUES)) if scores[i] is not None}

        return retrying(ask)

    def failed_rows(self, ids: list[str]) -> dict[str, tuple[int, str]]:
        """Failed Job rows (attempts, first line of last_error) of these ids."""
        out = {}
        for job_id, attempts, error in Job.objects.filter(pk__in=ids, status=JobStatus.FAILED).values_list(
            "id", "attempts", "last_error"
        ):
            out[job_id] = (attempts, (error or "").splitlines()[0] if error else "")
        return out


def runs_by_job(ids: list[str] | None = None) -> dict[str, list[tuple[int, int, float, str]]]:
    """chaos_run rows: job id -> [(attempt, pid, started_at, action)] in start order."""
    out: dict[str, list[tuple[int, int, float, str]]] = defaultdict(list)
    for job_id, attempt, pid, started, action in sql(
        "SELECT job_id, attempt, pid, started_at, action FROM chaos_run ORDER BY started_at"
    ):
        out[job_id].append((attempt, pid, started, action))
    if ids is not None:
        wanted = set(ids)
        return {k: v for k, v in out.items() if k in wanted}
    return out


def effects_by_job() -> dict[str, list[tuple[int, int, float, float]]]:
    """chaos_effect rows: job id -> [(attempt, pid, started_at, done_at)] in completion order."""
    out: dict[str, list[tuple[int, int, float, float]]] = defaultdict(list)
    for job_id, attempt, pid, started, done in sql(
        "SELECT job_id, attempt, pid, started_at, done_at FROM chaos_effect ORDER BY done_at"
    ):
        out[job_id].append((attempt, pid, started, done))
    return out


def done_count() -> int:
    return sql("SELECT count(DISTINCT job_id) FROM chaos_effect")[0][0]


def pg_connections() -> int:
    return sql("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", [settings.DATABASES["default"]["NAME"]])[0][
        0
    ]
