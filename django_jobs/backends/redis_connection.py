"""Building the Redis backend's client from its ``OPTIONS``.

``URL`` (``redis://...``) builds a client of its own; ``CACHE`` reuses the pool of a django-redis
cache alias. ``CLUSTER`` builds a ``redis.cluster.RedisCluster`` from ``URL`` (any one node) or
``STARTUP_NODES`` (``[(host, port), ...]``): every key of one queue, or of one limit, carries
one hash tag, so each script and transaction touches one slot. A probe client (the persistence check at start-up and in health checks) gives up
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
    kwargs = PROBE_KWARGS if probe else CLIENT_KWARGS
    if options.get("CLUSTER"):
        return _cluster_client(name, options, kwargs)
    url = options.get("URL")
    if not url:
        raise ImproperlyConfigured(f"redis backend {name!r} needs OPTIONS['URL'] or OPTIONS['CACHE']")
    return redis.Redis.from_url(url, **kwargs)


def _cluster_client(name: str, options: Mapping[str, Any], kwargs: dict[str, Any]) -> Any:
    """A ``RedisCluster``: it reads the slot map from the first startup node that answers. None
    answering is an outage (``redis.ConnectionError``), as for a single server."""
    nodes, url = options.get("STARTUP_NODES"), options.get("URL")
    try:
        if nodes:
            startup = [redis.cluster.ClusterNode(host, int(port)) for host, port in nodes]
            return redis.RedisCluster(startup_nodes=startup, **kwargs)
        if url:
            return redis.RedisCluster.from_url(url, **kwargs)
    except redis.exceptions.RedisClusterException as exc:
        if isinstance(exc.__cause__, (redis.ConnectionError, redis.TimeoutError, OSError)):
            raise redis.ConnectionError(str(exc)) from exc
        raise
    raise ImproperlyConfigured(
        f"redis backend {name!r} with OPTIONS['CLUSTER'] needs OPTIONS['URL'] or 'STARTUP_NODES'"
    )


def is_cluster(client: Any) -> bool:
    """Whether ``client`` talks to a Redis Cluster (``OPTIONS["CLUSTER"]``)."""
    return isinstance(client, redis.RedisCluster)


def servers(client: Any) -> list[Any]:
    """A client per server holding data: the client itself, or each primary's of a cluster."""
    if is_cluster(client):
        return [node.redis_connection for node in client.get_primaries()]
    return [client]


def by_slot(client: Any, keys: list[str]) -> list[list[str]]:
    """``keys`` grouped by cluster slot, in order (a command over several keys takes keys of
    one slot in a cluster); a single group on a single server."""
    if not is_cluster(client):
        return [keys]
    groups: dict[int, list[str]] = {}
    for key in keys:
        groups.setdefault(client.keyslot(key), []).append(key)
    return list(groups.values())


def disconnect(client: Any) -> None:
    """Close the connections of a client of our own (every node's, for a cluster)."""
    if is_cluster(client):
        client.close()
    else:
        client.connection_pool.disconnect()


def _cache_client(alias: str) -> Any:
    try:
        from django_redis import get_redis_connection
    except ImportError as exc:
        raise ImproperlyConfigured(
            "OPTIONS['CACHE'] needs django-redis: pip install 'django-reliable-jobs[redis]'"
        ) from exc
    return get_redis_connection(alias)


def address(client: Any) -> str:
    """``host:port`` (or the socket path) a client talks to, for messages; a cluster's
    primaries, comma-separated."""
    if is_cluster(client):
        return ",".join(node.name for node in client.get_primaries())
    kwargs = client.connection_pool.connection_kwargs
    return str(kwargs["path"]) if kwargs.get("path") else f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
