"""Building the Redis backend's client from its ``OPTIONS``.

``URL`` (``redis://...``) builds a client of its own; ``CACHE`` reuses the pool of a django-redis
cache alias. A probe client (the persistence check at start-up and in health checks) gives up
after :data:`PROBE_TIMEOUT`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from . import require

redis = require("redis", "redis")

# Seconds the persistence probe waits for the server (it runs at start-up and in health checks).
PROBE_TIMEOUT = 5.0
# Kept by the backend's own client: a dead peer is noticed between commands.
CLIENT_KWARGS: dict[str, Any] = {"health_check_interval": 30, "socket_keepalive": True}
PROBE_KWARGS: dict[str, Any] = {"socket_connect_timeout": PROBE_TIMEOUT, "socket_timeout": PROBE_TIMEOUT}


def shared(options: Mapping[str, Any]) -> bool:
    """Whether the client belongs to someone else (a django-redis cache): never closed here."""
    return bool(options.get("CACHE"))


def connect(name: str, options: Mapping[str, Any], *, probe: bool = False) -> Any:
    """The client for redis backend ``name`` (``probe``: one that gives up after
    :data:`PROBE_TIMEOUT`, for the caller to close; a cache's client keeps its own timeouts)."""
    if options.get("CACHE"):
        return _cache_client(options["CACHE"])
    # OPTIONS["CLUSTER"]: a redis.cluster.RedisCluster is built here (issue 24, item 3).
    url = options.get("URL")
    if not url:
        raise ImproperlyConfigured(f"redis backend {name!r} needs OPTIONS['URL'] or OPTIONS['CACHE']")
    return redis.Redis.from_url(url, **(PROBE_KWARGS if probe else CLIENT_KWARGS))


def _cache_client(alias: str) -> Any:
    try:
        from django_redis import get_redis_connection
    except ImportError as exc:
        raise ImproperlyConfigured(
            "OPTIONS['CACHE'] needs django-redis: pip install 'django-reliable-jobs[redis]'"
        ) from exc
    return get_redis_connection(alias)


def address(client: Any) -> str:
    """``host:port`` (or the socket path) a client talks to, for messages."""
    kwargs = client.connection_pool.connection_kwargs
    return str(kwargs["path"]) if kwargs.get("path") else f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
