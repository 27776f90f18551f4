"""Idempotency keys: a delivery whose key already succeeded is acked without running.

The key is claimed atomically (``cache.add``) for the length of the lease, and only a
**successful** run marks it done; a failure releases it, so the job's own retries still run.
Concurrent deliveries of one key run the handler at most once: the loser is requeued.
"""

from __future__ import annotations

from enum import Enum

from django.core.cache import caches

from . import conf

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

    def claim(self, key: str, owner: str, hold_seconds: float) -> Claim:
        """Try to hold ``key`` for this delivery for ``hold_seconds`` (the lease)."""
        full = self.prefix + key
        for _ in range(2):  # a second try covers a marker that expired between add and get
            if self.cache.add(full, owner, max(int(hold_seconds) + 1, 1)):
                return Claim.RUN
            current = self.cache.get(full)
            if current == DONE:
                return Claim.DONE
            if current is not None:
                return Claim.BUSY
        return Claim.BUSY

    def extend(self, key: str, owner: str, hold_seconds: float) -> None:
        """Heartbeat: keep holding ``key`` while its delivery still runs."""
        full = self.prefix + key
        if self.cache.get(full) == owner:
            self.cache.touch(full, max(int(hold_seconds) + 1, 1))

    def succeeded(self, key: str) -> None:
        """Consume the key: later deliveries with it are skipped for ``IDEMPOTENCY_TTL``."""
        self.cache.set(self.prefix + key, DONE, conf.get("IDEMPOTENCY_TTL"))

    def failed(self, key: str, owner: str) -> None:
        """Release the key so the job's retry can run."""
        full = self.prefix + key
        if self.cache.get(full) == owner:
            self.cache.delete(full)

    def is_done(self, key: str) -> bool:
        return self.cache.get(self.prefix + key) == DONE
