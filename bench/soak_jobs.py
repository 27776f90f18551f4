"""The jobs ``bench/soak.py`` dispatches (a module of its own: workers import it through ``JOBS["IMPORTS"]``)."""

from __future__ import annotations

import time
from typing import Any

from django_jobs import job

_redis: Any = None


@job
def noop() -> None:
    """Does nothing: what is measured is the worker around it."""


@job
def stamp(sent: float, key: str) -> None:
    """Pushes how long after ``sent`` (``time.time()`` at dispatch) it started, in seconds, to
    the Redis list ``key`` (on ``SOAK_REDIS_URL``, whichever backend carried the job)."""
    latency = time.time() - sent  # first, before connecting to Redis
    global _redis
    if _redis is None:
        import redis
        from django.conf import settings

        _redis = redis.Redis.from_url(settings.SOAK_REDIS_URL)
    _redis.rpush(key, repr(latency))
