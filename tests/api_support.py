"""Helpers for the in-process API / bad-input / idempotency / metrics / admin / command / check tests.

Its fixtures (``backend``, ``clean_state``) reach every test module through ``pytest_plugins`` in
tests/conftest.py: ask for them by name (or with ``pytest.mark.usefixtures``), never import them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import pytest
from django.conf import settings
from django.core.cache import caches
from django.core.cache.backends.base import DEFAULT_TIMEOUT
from django.core.cache.backends.locmem import LocMemCache
from django.test import override_settings

from django_jobs import Jobs, job
from django_jobs.metrics import get_collector
from django_jobs.models import Job
from django_jobs.worker import QueueWorker, WorkerResult
from tests.testapp.models import SideEffect

BACKENDS = ["default", "pg"]  # the database backend on SQLite and on PostgreSQL


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each test runs on the database backend over SQLite and over PostgreSQL."""
    if request.param == "pg":
        request.getfixturevalue("postgres_up")
    return request.param


# -- settings --------------------------------------------------------------------------------


@contextmanager
def jobs_settings(**changes: Any) -> Iterator[None]:
    """``override_settings(JOBS=...)`` on top of the test settings (the override replaces the
    whole dict, so the test backends and queues are copied in)."""
    with override_settings(JOBS={**settings.JOBS, **changes}):
        yield


# -- small accessors ---------------------------------------------------------------------------


def alias(backend: str) -> str:
    """The database alias a database backend stores its rows in."""
    return Jobs.backend(backend).alias


def row(backend: str, job_id: str) -> Job:
    return Job.objects.using(alias(backend)).get(pk=job_id)


def runs(key: str, db: str = "default") -> int:
    """How many times a scripted job recording under ``key`` really executed."""
    return SideEffect.objects.using(db).filter(key=key).count()


def counter(name: str, **labels: str) -> float:
    return get_collector().get(name, **labels)


def drain(worker: QueueWorker, limit: int = 20) -> list[WorkerResult]:
    """Process until the worker finds nothing due (bounded, so a bug cannot loop forever)."""
    results = []
    for _ in range(limit):
        result = worker.process_once()
        if result.status == "empty":
            return results
        results.append(result)
    raise AssertionError(f"still not empty after {limit} deliveries: {[r.status for r in results]}")


@pytest.fixture
def clean_state() -> Iterator[None]:
    """Idempotency keys and single-instance locks live in the locmem cache, which outlives a test."""
    for cache in caches.all():
        cache.clear()
    GiveUpHandler.calls.clear()
    reentrant_results.clear()
    yield
    for cache in caches.all():
        cache.clear()


# -- handlers used by the tests ----------------------------------------------------------------


class GiveUpHandler:
    """A class handler (``JOBS["HANDLERS"]``) that always fails and lets ``can_retry`` decide.

    The payload says up to which attempt ``can_retry`` agrees: ``{"retry_until": N}``.
    """

    calls: ClassVar[list[tuple[str, Any]]] = []

    def handle(self, context: Any) -> None:
        GiveUpHandler.calls.append(("run", context.attempt))
        raise RuntimeError("give-up handler failed")

    def can_retry(self, attempt: int, error: BaseException) -> bool:
        GiveUpHandler.calls.append(("can_retry", (attempt, type(error).__name__)))
        return attempt < 2


reentrant_results: list[WorkerResult] = []


@job(queue="other")
def reentrant(
    key: str, db: str = "default", backend: str = "default", busy_delay: float = 0.0, fail: bool = False
) -> None:
    """While this job runs, a second worker processes the next delivery on its queue.

    That is a real "another delivery is still running" situation, in one thread: whatever the
    running delivery holds (its single-instance lock, its idempotency key) is held for real.
    """
    SideEffect.objects.using(db).create(key=key)
    reentrant_results.append(QueueWorker(backend, ["other"], busy_delay=busy_delay).process_once())
    if fail:
        raise RuntimeError("reentrant failure")


@job
def bare_job(x: int, *, label: str = "") -> int:
    """Registered with a bare ``@job``: every option at its default."""
    return x * 2


@job(queue="emails", max_retries=3, priority=4, timeout=30, name="welcome mail")
def configured_job(user_id: int) -> int:
    """Registered with options that every dispatch inherits unless ``using()`` overrides them."""
    return user_id


class RecordingLocMemCache(LocMemCache):
    """A locmem cache that remembers the timeout of every ``set`` (to check IDEMPOTENCY_TTL)."""

    timeouts: ClassVar[dict[str, Any]] = {}

    def set(self, key: Any, value: Any, timeout: Any = DEFAULT_TIMEOUT, version: Any = None) -> None:
        RecordingLocMemCache.timeouts[key] = timeout
        super().set(key, value, timeout, version)
