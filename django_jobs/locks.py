"""Cross-process markers in a Django cache, set atomically with ``cache.add``.

Keys are made safe for every Django cache backend (memcached refuses keys over 250 bytes or
with spaces and control characters, ``DatabaseCache`` keeps 255 characters): a short key of
printable ASCII is used as it is, anything else is replaced by its SHA-256 digest.

Cache errors are not swallowed: an exception of the cache propagates to the caller, and a cache
that reports failure without an exception (``DatabaseCache`` turns database errors into a
``False`` from ``add``) raises :class:`CacheRefused`.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from django.core.cache import caches

from . import conf

if TYPE_CHECKING:
    from django.core.cache.backends.base import BaseCache

# Longest key (after its fixed prefix) kept readable: with the prefix, Django's KEY_PREFIX and
# version, it stays far within memcached's 250 bytes and DatabaseCache's 255 characters.
READABLE_KEY_LENGTH = 100
HASHED = "sha256:"


class CacheRefused(RuntimeError):
    """The cache neither stored a marker nor holds one: it fails without saying so."""


def cache_key(prefix: str, key: str) -> str:
    """``prefix + key`` when ``key`` is short printable ASCII; else ``prefix + "sha256:<hex>"``.

    Keys starting with ``sha256:`` are hashed too, so a readable key never equals a digest.
    """
    if (
        len(key) <= READABLE_KEY_LENGTH
        and key.isascii()
        and key.isprintable()
        and " " not in key
        and not key.startswith(HASHED)
    ):
        return prefix + key
    return prefix + HASHED + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def _cache() -> BaseCache:
    return caches[conf.get("IDEMPOTENCY_CACHE")]


def add_or_raise(cache: BaseCache, key: str, value: str, ttl: int) -> bool:
    """``cache.add``: ``True`` when stored, ``False`` when the key is held. Raises
    :class:`CacheRefused` when the add fails although nothing holds the key."""
    for _ in range(3):  # a holder may expire or release the key between our add and get
        if cache.add(key, value, ttl):
            return True
        if cache.get(key) is not None:
            return False
    raise CacheRefused(
        f"cache {conf.get('IDEMPOTENCY_CACHE')!r} refused to store {key!r}: cache.add failed and the key is not set"
    )


class CacheLock:
    """A lock held while one delivery runs; it expires with the lease if the worker dies."""

    prefix = "django_jobs:lock:"

    def __init__(self, key: str, owner: str, ttl: float) -> None:
        # The caller's key as it is when safe; else a digest under this class's own prefix.
        self.key = key if cache_key("", key) == key else cache_key(self.prefix, key)
        self.owner, self.ttl = owner, max(int(ttl) + 1, 1)

    def acquire(self) -> bool:
        return add_or_raise(_cache(), self.key, self.owner, self.ttl)

    def extend(self) -> None:
        """Heartbeat: keep holding the lock for another ``ttl`` while the job runs."""
        cache = _cache()
        if cache.get(self.key) == self.owner:
            cache.touch(self.key, self.ttl)

    def release(self) -> None:
        cache = _cache()
        if cache.get(self.key) == self.owner:
            cache.delete(self.key)
