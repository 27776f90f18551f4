"""Cross-process markers in a Django cache, set atomically with ``cache.add``."""

from __future__ import annotations

from django.core.cache import caches

from . import conf


def _cache():  # type: ignore[no-untyped-def]
    return caches[conf.get("IDEMPOTENCY_CACHE")]


class CacheLock:
    """A lock held while one delivery runs; it expires with the lease if the worker dies."""

    def __init__(self, key: str, owner: str, ttl: float) -> None:
        self.key, self.owner, self.ttl = key, owner, max(int(ttl) + 1, 1)

    def acquire(self) -> bool:
        return _cache().add(self.key, self.owner, self.ttl)

    def extend(self) -> None:
        """Heartbeat: keep holding the lock for another ``ttl`` while the job runs."""
        cache = _cache()
        if cache.get(self.key) == self.owner:
            cache.touch(self.key, self.ttl)

    def release(self) -> None:
        cache = _cache()
        if cache.get(self.key) == self.owner:
            cache.delete(self.key)
