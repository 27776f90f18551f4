"""Idempotency keys: a delivery whose key already succeeded is acked without running.

The key is claimed atomically (``cache.add``) for the length of the lease, and only a
**successful** run marks it done; a failure releases it, so the job's own retries still run.
Concurrent deliveries of one key run the handler at most once: the loser is requeued.

Any key works on every Django cache backend: one over 100 characters, or with characters
memcached refuses (spaces, control or non-ASCII characters), is stored as ``sha256:<hex>`` of
itself (:func:`django_jobs.locks.cache_key`); a short printable ASCII key is stored as it is.
Errors of the cache propagate (so the worker records them) instead of reading as "busy".
"""

from __future__ import annotations

from enum import Enum

from django.core.cache import caches

from . import conf
from .locks import CacheRefused, cache_key

__all__ = ["DONE", "CacheRefused", "Claim", "IdempotencyGuard"]

DONE = "done"


class Claim(Enum):
    RUN = "run"  # this delivery holds the key: run it
    DONE = "done"  # a delivery with this key already succeeded: skip
    BUSY = "busy"  # another delivery holds the key right now: try later


class IdempotencyGuard:
    """Claims and settles idempotency keys in ``JOBS["IDEMPOTENCY_CACHE"]``."""

    prefix = "django_jobs:idem:"

    def __init__(self) -> None:
        self.cache = caches[conf.get("IDEMPOTENCY_CACHE")]

    def cache_key(self, key: str) -> str:
        """The cache key holding ``key``'s marker (a digest for long or unsafe keys)."""
        return cache_key(self.prefix, key)

    def claim(self, key: str, owner: str, hold_seconds: float) -> Claim:
        """Try to hold ``key`` for this delivery for ``hold_seconds`` (the lease).

        Raises :class:`CacheRefused` when the cache neither stores the claim nor holds a
        marker (it fails without an exception), and lets the cache's own errors propagate.
        """
        full = self.cache_key(key)
        for _ in range(3):  # another try covers a marker that expired between add and get
            if self.cache.add(full, owner, max(int(hold_seconds) + 1, 1)):
                return Claim.RUN
            current = self.cache.get(full)
            if current == DONE:
                return Claim.DONE
            if current is not None:
                return Claim.BUSY
        raise CacheRefused(
            f"idempotency cache {conf.get('IDEMPOTENCY_CACHE')!r} refused to store {full!r}: "
            "cache.add failed and the key is not set"
        )

    def extend(self, key: str, owner: str, hold_seconds: float) -> None:
        """Heartbeat: keep holding ``key`` while its delivery still runs."""
        full = self.cache_key(key)
        if self.cache.get(full) == owner:
            self.cache.touch(full, max(int(hold_seconds) + 1, 1))

    def succeeded(self, key: str) -> None:
        """Consume the key: later deliveries with it are skipped for ``IDEMPOTENCY_TTL``."""
        self.cache.set(self.cache_key(key), DONE, conf.get("IDEMPOTENCY_TTL"))

    def failed(self, key: str, owner: str) -> None:
        """Release the key so the job's retry can run."""
        full = self.cache_key(key)
        if self.cache.get(full) == owner:
            self.cache.delete(full)

    def is_done(self, key: str) -> bool:
        marker: object = self.cache.get(self.cache_key(key))
        return marker == DONE
