"""The jobs ``bench/soak.py`` and ``bench/abort_latency.py`` dispatch (a module of its own:
workers import it through ``JOBS["IMPORTS"]``)."""

from __future__ import annotations

import time
from typing import Any

from django_jobs import current_job, job

_redis: Any = None
# The longest an unaborted ``until_aborted`` runs: the benchmark aborts it long before.
SAFETY_SECONDS = 120


def _client() -> Any:
    """The Redis client of ``SOAK_REDIS_URL``, whichever backend carried the job."""
    global _redis
    if _redis is None:
        import redis
        from django.conf import settings

        _redis = redis.Redis.from_url(settings.SOAK_REDIS_URL)
    return _redis


@job
def noop() -> None:
    """Does nothing: what is measured is the worker around it."""


@job
def stamp(sent: float, key: str) -> None:
    """Pushes how long after ``sent`` (``time.time()`` at dispatch) it started, in seconds, to
    the Redis list ``key``."""
    latency = time.time() - sent  # first, before connecting to Redis
    _client().rpush(key, repr(latency))


@job
def until_aborted(key: str) -> str:
    """Pushes its id to the Redis list ``key`` as it starts, then runs until it is asked to
    abort, looking every 10 ms: a cooperative job, which returns as soon as its worker learns."""
    context = current_job()
    assert context is not None, "run by a worker"
    _client().rpush(key, context.job_id)
    deadline = time.monotonic() + SAFETY_SECONDS
    while not context.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    return "stopped"
