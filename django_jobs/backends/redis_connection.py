"""Building the Redis backend's client from its ``OPTIONS``.

``URL`` (``redis://...``) builds a client of its own; ``CACHE`` reuses the pool of a django-redis
cache alias. Redis Sentinel: ``SENTINELS`` (``[(host, port), ...]``) and ``SERVICE``, or a
``redis+sentinel://host:port,host:port/service/db`` URL; the client asks the sentinels for the
service's primary and asks again after a failover (redis-py's ``Sentinel.master_for``).
``CLUSTER`` builds a ``redis.cluster.RedisCluster`` from ``URL`` (any one node) or
``STARTUP_NODES`` (``[(host, port), ...]``): every key of one queue, or of one limit, carries
one hash tag, so each script and transaction touches one slot. :func:`problem` checks the
options of every form. A probe client (the persistence check at start-up and in health checks)
gives up after :data:`PROBE_TIMEOUT`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, NamedTuple
from urllib.parse import unquote

from django.core.exceptions import ImproperlyConfigured

from .. import conf
from . import require

redis = require("redis", "redis")
parsers = require("redis._parsers.commands", "redis")
policies = require("redis.commands.policies", "redis")

# Seconds the persistence probe waits for the server (it runs at start-up and in health checks).
PROBE_TIMEOUT = 5.0
# Kept by the backend's own client: a dead peer is noticed between commands.
CLIENT_KWARGS: dict[str, Any] = {"health_check_interval": 30, "socket_keepalive": True}
PROBE_KWARGS: dict[str, Any] = {"socket_connect_timeout": PROBE_TIMEOUT, "socket_timeout": PROBE_TIMEOUT}
SENTINEL_SCHEME = "redis+sentinel://"
# A sentinel that does not answer within this many seconds is skipped for the next one.
SENTINEL_TIMEOUT = 2.0
# Seconds between two questions to the sentinels about who the primary is (see FollowingPool),
# and after a question they took longer than that to leave unanswered.
RECHECK = 1.0
SLOW_SENTINELS = 30.0
# OPTIONS keys of the sentinel form that go to the primary's connections.
SENTINEL_AUTH = {"DB": "db", "USERNAME": "username", "PASSWORD": "password"}


class Sentinels(NamedTuple):
    """Where to find a Sentinel-managed primary."""

    sentinels: list[tuple[str, int]]
    service: str
    primary_kwargs: dict[str, Any]  # db, username, password of the primary
    sentinel_kwargs: dict[str, Any]  # the sentinels' own connections (password, timeouts)


def shared(options: Mapping[str, Any]) -> bool:
    """Whether the client belongs to someone else (a django-redis cache): never closed here."""
    return bool(options.get("CACHE"))


def connect(name: str, options: Mapping[str, Any], *, probe: bool = False) -> Any:
    """The client for redis backend ``name`` (``probe``: one that gives up after
    :data:`PROBE_TIMEOUT`, for the caller to close; a cache's client keeps its own timeouts)."""
    if options.get("CACHE"):
        return _cache_client(options["CACHE"])
    wanted = problem(options)
    if wanted:
        raise ImproperlyConfigured(f"redis backend {name!r} {wanted}")
    kwargs = PROBE_KWARGS if probe else CLIENT_KWARGS
    if options.get("CLUSTER"):
        return _cluster_client(options, kwargs)
    found = sentinels(options)
    if found is not None:
        manager = redis.sentinel.Sentinel([], sentinel_kwargs=found.sentinel_kwargs)
        manager.sentinels = [SentinelClient(host, port, **found.sentinel_kwargs) for host, port in found.sentinels]
        return manager.master_for(
            found.service,
            connection_pool_class=FollowingPool,
            connection_class=FollowingConnection,
            **found.primary_kwargs,
            **kwargs,
        )
    return redis.Redis.from_url(options["URL"], **kwargs)


def _cluster_client(options: Mapping[str, Any], kwargs: dict[str, Any]) -> Any:
    """A ``RedisCluster`` (options checked by :func:`problem`): it reads the slot map from the
    first startup node that answers. None answering is an outage (``redis.ConnectionError``), as
    for a single server."""
    try:
        if options.get("STARTUP_NODES"):
            nodes = [redis.cluster.ClusterNode(host, port) for host, port in _pairs(options, "STARTUP_NODES")]
            return redis.RedisCluster(startup_nodes=nodes, **kwargs)
        return redis.RedisCluster.from_url(options["URL"], **kwargs)
    except redis.exceptions.RedisClusterException as exc:
        if isinstance(exc.__cause__, (redis.ConnectionError, redis.TimeoutError, OSError)):
            raise redis.ConnectionError(str(exc)) from exc
        raise


BasePolicyResolver: Any = policies.BasePolicyResolver


class ScriptsByKey(BasePolicyResolver):  # type: ignore[misc]
    """``EVALSHA`` routed by its first key, as a cluster client routes it alone."""

    def __init__(self, fallback: Any = None) -> None:
        keyed = parsers.CommandPolicies(parsers.RequestPolicy.DEFAULT_KEYED, parsers.ResponsePolicy.DEFAULT_KEYED)
        super().__init__({"core": {"evalsha": keyed}}, fallback)

    def with_fallback(self, fallback: Any) -> Any:
        return ScriptsByKey(fallback)


CLUSTER_POLICIES = policies.StaticPolicyResolver(fallback=ScriptsByKey())


def pipeline(client: Any) -> Any:
    """A pipeline of ``client``, not a transaction. A cluster's reads each ``EVALSHA``'s slot
    from its keys: redis-py's cluster pipeline does not take its client's ``policy_resolver``
    and asks a server ``COMMAND GETKEYS`` of each script call instead, a round trip each."""
    pipe = client.pipeline(transaction=False)
    if is_cluster(client):
        pipe._policy_resolver = CLUSTER_POLICIES
    return pipe


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


SentinelConnectionPool: Any = redis.sentinel.SentinelConnectionPool
SentinelManagedConnection: Any = redis.sentinel.SentinelManagedConnection
RedisConnectionError: Any = redis.ConnectionError
RedisResponseError: Any = redis.ResponseError
RedisClient: Any = redis.Redis


class SentinelClient(RedisClient):  # type: ignore[misc]
    """The client of one sentinel. One that answers the question with an error (a server there
    that is no sentinel) is passed over for the next, as one that does not answer is: redis-py
    stops at it, and every command then fails however many good sentinels follow."""

    def sentinel_masters(self) -> Any:
        try:
            return super().sentinel_masters()
        except RedisResponseError as exc:
            where = self.connection_pool.connection_kwargs
            raise RedisConnectionError(f"{where.get('host')}:{where.get('port')} is not a sentinel: {exc}") from exc


class NoReplicasError(RedisConnectionError):  # type: ignore[misc]
    """The primary refused a write: fewer replicas than its ``min-replicas-to-write`` are in
    sync with it (``NOREPLICAS``). Nothing was written; like a lost connection, it passes."""


class FollowingConnection(SentinelManagedConnection):  # type: ignore[misc]
    """A connection to a Sentinel-managed primary on which a ``NOREPLICAS`` refusal is a
    :class:`NoReplicasError`: the backend treats it as an outage (a dispatch raises
    ``BackendUnavailable``, a worker waits and tries again), not as a failed command."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if str(exc).startswith("NOREPLICAS"):
                raise NoReplicasError(str(exc)) from exc
            raise


class FollowingPool(SentinelConnectionPool):  # type: ignore[misc]
    """redis-py's pool of connections to a Sentinel-managed primary, which asks the sentinels
    who the primary is when a connection is made, and also at most every :data:`RECHECK` seconds
    when one is handed out. A primary demoted while it still answers (``SENTINEL FAILOVER``, a
    partition) keeps its clients' connections until the sentinels reconfigure it, up to 10 s
    later, and the writes they make there are lost when it resyncs; asking closes idle
    connections to a primary the sentinels no longer name (busy ones close when released)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.next_question = time.monotonic() + RECHECK

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        asked = time.monotonic()
        if asked >= self.next_question:
            pause = RECHECK
            try:
                self.get_master_address()  # closes idle connections when the primary changed
            except redis.ConnectionError:
                # The sentinels cannot say (no primary yet, or none answers): keep the connections,
                # which fail by themselves if the primary is gone. Sentinels that time out are
                # asked less often, or every command would wait for them.
                if time.monotonic() - asked >= RECHECK:
                    pause = SLOW_SENTINELS
            self.next_question = time.monotonic() + pause
        return super().get_connection(*args, **kwargs)


def problem(options: Mapping[str, Any]) -> str | None:
    """What is wrong with ``options`` (``"needs ..."``), or ``None``: the system check reports it
    before a worker starts, and :func:`connect` raises it."""
    if options.get("CACHE"):
        return None
    cluster = options.get("CLUSTER")
    if cluster is not None and not isinstance(cluster, bool):  # "False" from an environment variable
        return f"needs OPTIONS['CLUSTER'] to be True or False, not {cluster!r}"
    try:
        found = sentinels(options)
        if options.get("CLUSTER"):
            return _cluster_problem(options, found) or _hash_tag_problem(options)
        if found is None and options.get("URL"):
            _parsed_url(options["URL"])
    except ImproperlyConfigured as exc:
        return str(exc)
    if not options.get("URL") and found is None:
        return (
            "needs OPTIONS['URL'], OPTIONS['CACHE'] or OPTIONS['SENTINELS'] and OPTIONS['SERVICE'] "
            "(with OPTIONS['CLUSTER']: OPTIONS['URL'] or OPTIONS['STARTUP_NODES'])"
        )
    return None


def _cluster_problem(options: Mapping[str, Any], found: Sentinels | None) -> str | None:
    """What is wrong with the options of a cluster (``OPTIONS['CLUSTER']``), or ``None``."""
    if found is not None:
        return "needs either OPTIONS['CLUSTER'] or Sentinel (SENTINELS, a redis+sentinel:// URL), not both"
    url, nodes = options.get("URL"), options.get("STARTUP_NODES")
    if url and nodes is not None:
        return "needs either OPTIONS['URL'] or OPTIONS['STARTUP_NODES'] with OPTIONS['CLUSTER'], not both"
    if nodes is not None:
        _pairs(options, "STARTUP_NODES")
        return None
    if not url:
        return "needs OPTIONS['URL'] (any one node) or OPTIONS['STARTUP_NODES'] with OPTIONS['CLUSTER']"
    if _parsed_url(url).get("db", 0) != 0:
        return "needs a URL of database 0 with OPTIONS['CLUSTER'] (a cluster has no other)"
    return None


def _hash_tag_problem(options: Mapping[str, Any]) -> str | None:
    """What keeps a queue's keys from sharing their queue's hash tag on a cluster, or ``None``.
    A key is ``<PREFIX>:{<queue>}:<kind>`` and Redis hashes what lies between its first ``{`` and
    the first ``}`` after it: braces in the prefix would take the tag from the prefix, and a
    queue whose name begins with ``}`` would leave it empty (the whole key hashed, each kind of
    key in a slot of its own, which no script may span)."""
    prefix = str(options.get("PREFIX", "django_jobs"))
    if "{" in prefix or "}" in prefix:
        return (
            f"needs a PREFIX without braces with OPTIONS['CLUSTER'] (each key's hash tag is its queue), not {prefix!r}"
        )
    queues = conf.get("QUEUES")
    untagged = (
        [q for q in queues if isinstance(q, str) and q.startswith("}")] if isinstance(queues, list | tuple) else []
    )
    if untagged:
        return (
            f"needs queue names that do not begin with '}}' with OPTIONS['CLUSTER'] (the keys of such a queue "
            f"have no hash tag, and its scripts would span slots), not {untagged[0]!r}"
        )
    return None


def _parsed_url(url: Any) -> dict[str, Any]:
    """A server's ``URL`` as redis-py reads it, without connecting; ``ImproperlyConfigured`` says
    why it cannot be read."""
    if not isinstance(url, str):
        raise ImproperlyConfigured(f"needs OPTIONS['URL'] to be a string, not {type(url).__name__}")
    try:
        parsed: dict[str, Any] = redis.connection.parse_url(url)
    except ValueError as exc:  # its message never shows the URL (nor its password)
        raise ImproperlyConfigured(f"needs a redis://, rediss://, unix:// or {SENTINEL_SCHEME} URL: {exc}") from exc
    return parsed


def sentinels(options: Mapping[str, Any]) -> Sentinels | None:
    """The Sentinel settings of ``options`` (``None``: no sentinels); ``ImproperlyConfigured`` says what
    is wrong with them."""
    url = options.get("URL")
    given = isinstance(url, str) and url.startswith(SENTINEL_SCHEME)
    if given and options.get("SENTINELS"):
        raise ImproperlyConfigured("needs either a redis+sentinel:// URL or OPTIONS['SENTINELS'], not both")
    extra = options.get("SENTINEL_KWARGS") or {}
    if not isinstance(extra, dict):
        raise ImproperlyConfigured(f"needs OPTIONS['SENTINEL_KWARGS'] to be a dict, not {type(extra).__name__}")
    sentinel_kwargs = {"socket_connect_timeout": SENTINEL_TIMEOUT, "socket_timeout": SENTINEL_TIMEOUT, **extra}
    if extra:  # only given arguments can be wrong (a client's construction reads redis-py's metadata)
        try:
            redis.Redis(**sentinel_kwargs).close()  # builds a pool, connects to nothing
        except TypeError as exc:
            raise ImproperlyConfigured(
                f"needs OPTIONS['SENTINEL_KWARGS'] to be arguments of a Redis client: {exc}"
            ) from exc
    if given:
        return _from_url(str(url), sentinel_kwargs)
    if "SENTINELS" not in options and "SERVICE" not in options:
        return None
    service = options.get("SERVICE")
    if not isinstance(service, str) or not service:
        raise ImproperlyConfigured(
            f"needs OPTIONS['SERVICE'], the name the sentinels monitor the primary by, not {service!r}"
        )
    found = _pairs(options, "SENTINELS")
    primary = {kwarg: options[key] for key, kwarg in SENTINEL_AUTH.items() if options.get(key) is not None}
    if not isinstance(primary.get("db", 0), int) or isinstance(primary.get("db"), bool):
        raise ImproperlyConfigured(f"needs OPTIONS['DB'] to be an integer, not {primary['db']!r}")
    return Sentinels(found, service, primary, sentinel_kwargs)


def _pairs(options: Mapping[str, Any], key: str) -> list[tuple[str, int]]:
    """``OPTIONS[key]``, a non-empty list of (host, port) pairs."""
    value = options.get(key)
    if not isinstance(value, (list, tuple)) or not value:
        raise ImproperlyConfigured(f"needs OPTIONS[{key!r}], a non-empty list of (host, port) pairs, not {value!r}")
    return [_pair(entry, key) for entry in value]


def _pair(entry: Any, key: str) -> tuple[str, int]:
    ok = (
        isinstance(entry, (list, tuple))
        and len(entry) == 2
        and isinstance(entry[0], str)
        and entry[0]
        and isinstance(entry[1], int)
        and not isinstance(entry[1], bool)
        and 0 < entry[1] < 65536
    )
    if not ok:
        raise ImproperlyConfigured(f"needs each of OPTIONS[{key!r}] to be a (host, port) pair, not {entry!r}")
    return entry[0], entry[1]


def _from_url(url: str, sentinel_kwargs: dict[str, Any]) -> Sentinels:
    """``redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]``."""
    shape = "redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]"
    rest = url[len(SENTINEL_SCHEME) :]
    hosts, _, path = rest.partition("/")
    userinfo, _, hosts = hosts.rpartition("@")
    parts = path.split("/")
    if not hosts or not parts[0] or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        shown = SENTINEL_SCHEME + ("***@" if userinfo else "") + hosts + "/" + path  # no password
        raise ImproperlyConfigured(f"needs a URL of the form {shape}, not {shown!r}")
    found = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":")
        if name.startswith("[") and name.endswith("]"):  # an IPv6 address, written as URLs write it
            name = name[1:-1]
        if not name or not port.isdigit():
            raise ImproperlyConfigured(f"needs host:port for each sentinel of its URL ({shape}), not {host!r}")
        found.append(_pair((name, int(port)), "SENTINELS"))
    primary: dict[str, Any] = {"db": int(parts[1])} if len(parts) == 2 else {}
    if userinfo:
        username, _, password = userinfo.partition(":")
        primary.update({"username": unquote(username) or None, "password": unquote(password) or None})
    return Sentinels(found, unquote(parts[0]), primary, sentinel_kwargs)


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
    primaries, comma-separated; under Sentinel, the service and its sentinels (asking them who
    the primary is would be a round trip)."""
    if is_cluster(client):
        return ",".join(node.name for node in client.get_primaries())
    pool = client.connection_pool
    if isinstance(pool, redis.sentinel.SentinelConnectionPool):
        found = ",".join(address(sentinel) for sentinel in pool.sentinel_manager.sentinels)
        return f"service {pool.service_name!r} via sentinels {found}"
    kwargs = pool.connection_kwargs
    return str(kwargs["path"]) if kwargs.get("path") else f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
