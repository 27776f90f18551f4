"""Idempotency keys: only a successful run consumes a key; concurrent deliveries of one
key run the handler at most once."""

from __future__ import annotations

import pytest
from django.core.cache import caches
from django.core.cache.backends.locmem import LocMemCache
from django.test import override_settings

from django_jobs import Jobs
from django_jobs.idempotency import CacheRefused, IdempotencyGuard
from django_jobs.locks import CacheLock, cache_key
from django_jobs.worker import QueueWorker
from tests.api_support import (
    RecordingLocMemCache,
    counter,
    drain,
    jobs_settings,
    reentrant,
    reentrant_results,
    row,
    runs,
)
from tests.testapp.jobs import scripted

pytestmark = [pytest.mark.django_db(databases=["default", "postgres"]), pytest.mark.usefixtures("clean_state")]


def test_a_key_that_succeeded_skips_later_deliveries(backend):
    first = scripted.using(backend=backend, idempotency_key="order-1").dispatch(action="ok", key="idem")
    again = scripted.using(backend=backend, idempotency_key="order-1").dispatch(action="ok", key="idem")
    other = scripted.using(backend=backend, idempotency_key="order-2").dispatch(action="ok", key="idem")
    worker = QueueWorker(backend)

    results = drain(worker)
    assert [(r.status, r.job_id) for r in results] == [
        ("acked", first),
        ("skipped-idempotent", again),
        ("acked", other),
    ]
    assert runs("idem") == 2  # the duplicate never ran
    skipped = row(backend, again)
    # Acked without running: settled, and not counted as a run.
    assert (skipped.status, skipped.attempts) == ("completed", 0)
    assert results[1].attempt == 0
    assert row(backend, first).attempts == 1
    assert counter("jobs_skipped_idempotent", queue="default") == 1
    assert counter("jobs_succeeded", queue="default") == 2


def test_a_failed_run_does_not_block_its_own_retry(backend):
    # flaky: the first run fails, the second succeeds.
    job_id = scripted.using(backend=backend, idempotency_key="charge-7", max_retries=2).dispatch(
        action="flaky", key="charge", fail_times=1
    )
    worker = QueueWorker(backend)
    assert [r.status for r in drain(worker)] == ["requeued", "acked"]
    assert runs("charge") == 2
    job = row(backend, job_id)
    assert (job.status, job.attempts) == ("completed", 2)
    assert counter("jobs_skipped_idempotent") == 0
    # Now the key is consumed: a later delivery with it is skipped.
    scripted.using(backend=backend, idempotency_key="charge-7").dispatch(action="ok", key="charge")
    assert worker.process_once().status == "skipped-idempotent"
    assert runs("charge") == 2


def test_a_key_whose_job_failed_permanently_stays_usable(backend):
    scripted.using(backend=backend, idempotency_key="k-fail").dispatch(action="raise", key="kf")
    second = scripted.using(backend=backend, idempotency_key="k-fail").dispatch(action="ok", key="kf")
    worker = QueueWorker(backend)
    assert [r.status for r in drain(worker)] == ["dead-lettered", "acked"]
    assert row(backend, second).status == "completed"
    assert runs("kf") == 2


def test_a_delivery_whose_key_is_held_by_a_running_delivery_is_requeued(backend):
    # The first job, while it runs, has a second worker process the duplicate delivery.
    first = reentrant.using(backend=backend, idempotency_key="dup", priority=10).dispatch(key="A", backend=backend)
    second = reentrant.using(backend=backend, idempotency_key="dup").dispatch(key="B", backend=backend)
    worker = QueueWorker(backend, ["other"])

    outer = worker.process_once()
    assert (outer.status, outer.job_id) == ("acked", first)
    [nested] = reentrant_results
    # Held, not done: requeued without counting a run (and without running).
    assert (nested.status, nested.job_id, nested.attempt) == ("requeued", second, 0)
    assert (row(backend, second).status, row(backend, second).attempts) == ("pending", 0)
    assert runs("B") == 0
    # The holder succeeded, so the requeued duplicate is now skipped: one run in all.
    later = worker.process_once()
    assert (later.status, later.job_id) == ("skipped-idempotent", second)
    assert runs("A") + runs("B") == 1
    assert (row(backend, second).status, row(backend, second).attempts) == ("completed", 0)


def test_a_held_key_released_by_a_failure_lets_the_duplicate_run(backend):
    first = reentrant.using(backend=backend, idempotency_key="dup2", priority=10).dispatch(
        key="A", backend=backend, fail=True
    )
    second = reentrant.using(backend=backend, idempotency_key="dup2").dispatch(key="B", backend=backend)
    worker = QueueWorker(backend, ["other"])

    assert worker.process_once().status == "dead-lettered"  # A failed, after B was requeued
    assert reentrant_results[0].status == "requeued"
    later = worker.process_once()
    assert (later.status, later.job_id) == ("acked", second)
    assert runs("B") == 1
    assert row(backend, first).status == "failed"


def test_guard_claims_are_atomic_and_owned():
    guard = IdempotencyGuard()
    assert guard.claim("k", "owner-1", 60).value == "run"
    assert guard.claim("k", "owner-2", 60).value == "busy"
    guard.failed("k", "owner-2")  # not the holder: releases nothing
    assert guard.claim("k", "owner-3", 60).value == "busy"
    guard.failed("k", "owner-1")
    assert guard.claim("k", "owner-3", 60).value == "run"
    guard.succeeded("k")
    assert guard.is_done("k")
    assert guard.claim("k", "owner-4", 60).value == "done"


CACHES_WITH_IDEM = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "idem": {"BACKEND": "tests.api_support.RecordingLocMemCache", "LOCATION": "idem"},
}


def test_idempotency_cache_and_ttl_are_respected():
    RecordingLocMemCache.timeouts.clear()
    with override_settings(CACHES=CACHES_WITH_IDEM), jobs_settings(IDEMPOTENCY_CACHE="idem", IDEMPOTENCY_TTL=4321):
        scripted.using(idempotency_key="ttl-key").dispatch(action="ok", key="ttl")
        assert QueueWorker("default").process_once().status == "acked"
        idem = caches["idem"]
        # The success marker lives in the configured cache, for IDEMPOTENCY_TTL seconds...
        assert idem.get(IdempotencyGuard.prefix + "ttl-key") == "done"
        assert RecordingLocMemCache.timeouts[IdempotencyGuard.prefix + "ttl-key"] == 4321
        # ...and not in the default cache.
        assert caches["default"].get(IdempotencyGuard.prefix + "ttl-key") is None
        idem.clear()


def test_an_expired_key_no_longer_skips():
    # IDEMPOTENCY_TTL=0: Django caches expire a 0-second entry at once, so the success is
    # forgotten immediately and the second delivery runs (no sleep needed to see the TTL work).
    with jobs_settings(IDEMPOTENCY_TTL=0):
        scripted.using(idempotency_key="short").dispatch(action="ok", key="short")
        scripted.using(idempotency_key="short").dispatch(action="ok", key="short")
        assert [r.status for r in drain(QueueWorker("default"))] == ["acked", "acked"]
    assert runs("short") == 2


def test_jobs_without_a_key_are_never_skipped():
    for _ in range(2):
        scripted.dispatch(action="ok", key="nokey")
    assert [r.status for r in drain(QueueWorker("default"))] == ["acked", "acked"]
    assert runs("nokey") == 2


def test_idempotency_key_with_the_sync_backend(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        for _ in range(2):
            scripted.using(backend="sync", idempotency_key="sync-key").dispatch(action="ok", key="sync-idem")
    assert runs("sync-idem") == 1
    assert [r.status for r in Jobs.backend("sync").last_results[-2:]] == ["acked", "skipped-idempotent"]


# -- keys every cache backend accepts --


@pytest.mark.parametrize("key", ["order-1", "close-month-2026-06", "a" * 100, "x:y/z#1"])
def test_a_short_printable_ascii_key_is_stored_as_it_is(key):
    # Unchanged across the upgrade that started hashing long keys: existing markers stay valid.
    assert IdempotencyGuard().cache_key(key) == IdempotencyGuard.prefix + key


@pytest.mark.parametrize(
    "key",
    [
        "a" * 101,
        "x" * 255,
        "with space",
        "tab\there",
        "new\nline",
        "nul\x00",
        "del\x7f",
        "clé",
        "🔑",
        "sha256:" + "0" * 64,
    ],
)
def test_a_long_or_unsafe_key_is_stored_as_its_digest(key):
    full = IdempotencyGuard().cache_key(key)
    assert full.startswith(IdempotencyGuard.prefix + "sha256:")
    assert len(full) == len(IdempotencyGuard.prefix) + 7 + 64
    assert full.isascii() and " " not in full
    assert full != IdempotencyGuard().cache_key(key + "!")


def test_a_long_key_works_end_to_end():
    key = "k" * 250
    guard = IdempotencyGuard()
    assert guard.claim(key, "owner-1", 60).value == "run"
    assert guard.claim(key, "owner-2", 60).value == "busy"
    guard.succeeded(key)
    assert guard.is_done(key) and not guard.is_done(key[:-1])


def test_cache_lock_keys_are_hashed_only_when_needed():
    assert CacheLock("django_jobs:single:reports.monthly", "o", 10).key == "django_jobs:single:reports.monthly"
    long_key = "django_jobs:single:" + "h" * 240
    lock = CacheLock(long_key, "o", 10)
    assert lock.key == cache_key(CacheLock.prefix, long_key) and lock.key.startswith("django_jobs:lock:sha256:")
    assert lock.acquire() and not CacheLock(long_key, "other", 10).acquire()
    lock.release()
    assert CacheLock(long_key, "other", 10).acquire()


class RefusingCache(LocMemCache):
    """Fails every write without an exception, as DatabaseCache does with a database error."""

    def add(self, *args, **kwargs):
        return False


class BrokenCache(LocMemCache):
    def add(self, *args, **kwargs):
        raise ConnectionError("cache server unreachable")


def _with_cache(cache_class: str):
    caches_setting = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "idem": {"BACKEND": f"{__name__}.{cache_class}", "LOCATION": cache_class},
    }
    return override_settings(CACHES=caches_setting, JOBS={"IDEMPOTENCY_CACHE": "idem"})


def test_a_cache_that_silently_refuses_a_claim_raises_instead_of_reading_as_busy():
    with _with_cache("RefusingCache"):
        with pytest.raises(CacheRefused, match="refused to store"):
            IdempotencyGuard().claim("k", "owner", 60)
        with pytest.raises(CacheRefused, match="refused to store"):
            CacheLock("django_jobs:single:h", "owner", 60).acquire()


def test_a_cache_error_propagates_from_the_guard_and_the_lock():
    with _with_cache("BrokenCache"):
        with pytest.raises(ConnectionError):
            IdempotencyGuard().claim("k", "owner", 60)
        with pytest.raises(ConnectionError):
            CacheLock("django_jobs:single:h", "owner", 60).acquire()
