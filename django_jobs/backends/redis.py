"""The Redis backend: every state change is one atomic Lua script (``backends/lua/*.lua``).

Per queue: a waiting zset (priority, then FIFO), a delayed zset (due time), a processing zset
(lease deadlines) with an owners hash (fencing tokens), a failed zset kept for audit, and the
message bodies. An idle worker blocks on a notify list instead of polling. ``fetch_many`` claims
a batch ahead of its run: an ahead hash marks those claims, so the reaper hands a lost one back
without counting a run until the worker ``begin``s it. An aborts hash flags running jobs asked to
abort; the heartbeat's extend reads it.
"""

from __future__ import annotations

import json
import secrets
import time
from datetime import UTC, datetime, timedelta
from functools import cache
from importlib.resources import files
from typing import Any, NamedTuple

from django.core.exceptions import ImproperlyConfigured

from .. import conf
from ..envelope import Envelope
from ..exceptions import AbortRequested, InvalidPayload, JobAborted, LeaseLost, WorkerLost
from ..retry import after_lost_run
from . import require
from .base import AbortRequest, Lease, LiveJob, QueueBackend, decode_lease_body

redis = require("redis", "redis")

SCRIPTS = (
    "enqueue",
    "fetch",
    "ack",
    "ack_fetch",
    "nack",
    "abandon",
    "extend",
    "reap",
    "fetch_many",
    "ack_many",
    "ack_many_fetch",
    "lose",
    "abort",
)
# Priorities share a float64 score with a 40-bit sequence number: keep them exact.
PRIORITY_LIMIT = 8000
REAP_BATCH = 500
# Seconds the persistence probe waits for the server (it runs at start-up and in health checks).
PROBE_TIMEOUT = 5.0


class QueueKeys(NamedTuple):
    """The Redis keys of one queue, by kind.

    Every script receives all of them as ``KEYS``, in this field order; ``common.lua`` names them
    in the same order at its top, so the two lists change together.
    """

    waiting: str  # zset: -priority * 2^40 + sequence -> id, so ZPOPMIN is priority, then FIFO
    delayed: str  # zset: due time (ms) -> id
    processing: str  # zset: lease deadline (ms) -> id
    owners: str  # hash: id -> owner token (fencing)
    bodies: str  # hash: id -> the signed envelope
    priorities: str  # hash: id -> priority
    sequence: str  # counter: FIFO order within a priority
    notify: str  # list: wakes workers blocked in wait_for_work
    failed: str  # zset: failure time (ms) -> id, kept for audit
    errors: str  # hash: id -> last error
    ahead: str  # hash: id -> "1" claimed ahead of its run, "2" and an earlier such claim was lost
    aborts: str  # hash: id -> who asked to abort the running job (its heartbeat reads it)

    @classmethod
    def of(cls, prefix: str, queue: str) -> QueueKeys:
        # The {queue} hash tag keeps one queue's keys in one Redis Cluster slot.
        return cls(*(f"{prefix}:{{{queue}}}:{kind}" for kind in cls._fields))


KINDS = QueueKeys._fields


@cache
def _source(name: str) -> str:
    lua = files("django_jobs.backends") / "lua"
    return (lua / "common.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


def _ms(moment: float | None = None) -> int:
    return int((time.time() if moment is None else moment) * 1000)


def _from_ms(ms: float) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


class RedisBackend(QueueBackend):
    """Options: ``URL`` (``redis://...``) or ``CACHE`` (a django-redis cache alias whose pool is
    reused), ``PREFIX`` (default ``django_jobs``)."""

    supports_priority = True
    pipelines_ack_fetch = True
    supports_prefetch = True

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        super().__init__(name, options)
        self.prefix = options.get("PREFIX", "django_jobs")
        self._client: Any = None
        self._scripts: dict[str, Any] = {}
        self._next_due: dict[str, float] = {}

    # -- connection --

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = self._connect()
            self._scripts = {name: self._client.register_script(_source(name)) for name in SCRIPTS}
        return self._client

    def _connect(self) -> Any:
        if self.options.get("CACHE"):
            try:
                from django_redis import get_redis_connection
            except ImportError as exc:
                raise ImproperlyConfigured(
                    "OPTIONS['CACHE'] needs django-redis: pip install 'django-reliable-jobs[redis]'"
                ) from exc
            return get_redis_connection(self.options["CACHE"])
        url = self.options.get("URL")
        if not url:
            raise ImproperlyConfigured(f"redis backend {self.name!r} needs OPTIONS['URL'] or OPTIONS['CACHE']")
        return redis.Redis.from_url(url, health_check_interval=30, socket_keepalive=True)

    def close(self) -> None:
        if self._client is not None and not self.options.get("CACHE"):
            self._client.connection_pool.disconnect()
        self._client = None

    def keys(self, queue: str) -> QueueKeys:
        return QueueKeys.of(self.prefix, queue)

    def _run(self, script: str, queue: str, *args: Any, client: Any = None) -> Any:
        """Run one Lua script on ``queue``: every script gets all the queue's keys, in
        :class:`QueueKeys` order."""
        self.client  # noqa: B018  (connects and registers the scripts)
        return self._scripts[script](keys=list(self.keys(queue)), args=list(args), client=client)

    def _fenced(self, script: str, lease: Lease, *args: Any) -> None:
        if not self._run(script, lease.queue, lease.token, lease.owner_token, *args):
            raise LeaseLost(f"job {lease.token} is no longer leased by this worker")

    # -- protocol --

    def _push(self, envelope: Envelope, client: Any = None) -> Any:
        due = envelope.available_at.timestamp() if envelope.available_at else 0
        priority = max(-PRIORITY_LIMIT, min(PRIORITY_LIMIT, envelope.priority))
        return self._run(
            "enqueue", envelope.queue, envelope.id, envelope.to_bytes(), priority, _ms(due), _ms(), client=client
        )

    def enqueue(self, envelope: Envelope) -> str:
        self._push(envelope)
        return envelope.id

    def enqueue_many(self, envelopes: list[Envelope]) -> list[str]:
        pipe = self.client.pipeline(transaction=False)
        for envelope in envelopes:
            self._push(envelope, client=pipe)
        pipe.execute()
        return [e.id for e in envelopes]

    def fetch(self, queue: str) -> Lease | None:
        owner, now, deadline = self._new_lease()
        job_id, body = self._run("fetch", queue, now, deadline, owner)
        return self._leased(queue, job_id, body, owner, deadline)

    def ack_and_fetch(self, lease: Lease, queue: str) -> Lease | None:
        if queue != lease.queue:  # one script touches one queue's keys (one cluster slot)
            return super().ack_and_fetch(lease, queue)
        owner, now, deadline = self._new_lease()
        reply = self._run("ack_fetch", queue, lease.token, lease.owner_token, now, deadline, owner)
        if not reply[0]:
            raise LeaseLost(f"job {lease.token} is no longer leased by this worker")
        return self._leased(queue, reply[1], reply[2], owner, deadline)

    @staticmethod
    def _new_lease() -> tuple[str, int, int]:
        now = time.time()
        return secrets.token_hex(16), _ms(now), _ms(now + conf.get("LEASE_TIMEOUT"))

    def _leased(self, queue: str, job_id: bytes | None, body: bytes | None, owner: str, deadline: int) -> Lease | None:
        """The Lease for what a fetch script returned (``job_id`` None: empty, ``body`` = next due)."""
        if job_id is None:
            self._next_due[queue] = float(body) / 1000 if body is not None else 0.0
            return None
        token = job_id.decode()
        lease = Lease(token=token, owner_token=owner, expires_at=_from_ms(deadline), queue=queue)
        if body is None:
            lease.error = InvalidPayload(f"message {token!r} has no body")
        else:
            lease.envelope, lease.error = decode_lease_body(body)
        return lease

    def fetch_many(self, queue: str, limit: int) -> list[Lease]:
        if limit < 1:
            return []
        owner, now, deadline = self._new_lease()
        reply = self._run("fetch_many", queue, now, deadline, owner, limit)
        return self._claimed(queue, reply, owner, deadline)

    def ack_many(self, leases: list[Lease]) -> list[Lease]:
        by_queue: dict[str, list[Lease]] = {}
        for lease in leases:
            by_queue.setdefault(lease.queue, []).append(lease)
        lost: list[Lease] = []
        for queue, group in by_queue.items():  # one script per queue (one cluster slot)
            lost += _lost(group, self._run("ack_many", queue, _acks(group)))
        return lost

    def ack_many_and_fetch(self, leases: list[Lease], queue: str, limit: int) -> tuple[list[Lease], list[Lease]]:
        if limit < 1 or any(lease.queue != queue for lease in leases):
            return super().ack_many_and_fetch(leases, queue, limit)
        owner, now, deadline = self._new_lease()
        acked, reply = self._run("ack_many_fetch", queue, _acks(leases), now, deadline, owner, limit)
        return _lost(leases, acked), self._claimed(queue, reply, owner, deadline)

    def _claimed(self, queue: str, reply: list[Any], owner: str, deadline: int) -> list[Lease]:
        """The Leases of a batch claimed ahead: ``reply`` holds (id, body, must_begin) triples,
        or a single empty one (``_leased`` then records the next due time)."""
        leases = []
        for i in range(0, len(reply), 3):
            lease = self._leased(queue, reply[i], reply[i + 1], owner, deadline)
            if lease is None:
                break
            lease.ahead, lease.must_begin = True, bool(reply[i + 2])
            leases.append(lease)
        return leases

    def ack(self, lease: Lease, *, count_run: bool = True) -> None:
        self._fenced("ack", lease)

    def nack(self, lease: Lease, delay: float, *, error: str = "", count_run: bool = True) -> None:
        env = lease.envelope
        assert env is not None, "only a decoded message can be requeued"
        due = time.time() + max(delay, 0)
        again = env.next_attempt() if count_run else env
        again.available_at = _from_ms(_ms(due))
        reply = self._run("nack", lease.queue, lease.token, lease.owner_token, again.to_bytes(), _ms(due), _ms(), error)
        if reply == 0:
            raise LeaseLost(f"job {lease.token} is no longer leased by this worker")
        if not isinstance(reply, int):  # who asked to abort it: not requeued
            raise AbortRequested(_text(reply))

    def dead_letter(self, lease: Lease, error: str, *, count_run: bool = True) -> None:
        env = lease.envelope
        body = b"" if env is None else (env.next_attempt() if count_run else env).to_bytes()
        self._fenced("abandon", lease, body, _ms(), error)

    def peek(self, job_id: str) -> LiveJob | None:
        """Looks in every queue of ``JOBS["QUEUES"]`` (one round trip): a message is live while
        its body is kept and it is not in the failed set; it is in progress while leased."""
        queues = conf.queues()
        pipe = self.client.pipeline(transaction=False)
        for queue in queues:
            keys = self.keys(queue)
            pipe.hget(keys.bodies, job_id)
            pipe.zscore(keys.processing, job_id)
            pipe.zscore(keys.failed, job_id)
        replies = pipe.execute()
        for i in range(len(queues)):
            body, leased, failed = replies[3 * i : 3 * i + 3]
            if body is None or failed is not None:
                continue
            envelope, _ = decode_lease_body(body)
            if envelope is not None:
                return LiveJob("in_progress" if leased is not None else "pending", envelope)
        return None

    def lose_claims(self, queue: str, owner_token: str, running: str | None) -> None:
        self._run("lose", queue, owner_token, running or "", _ms())

    def extend(self, lease: Lease, seconds: float) -> str | None:
        return self._prolong(lease, seconds, begin=False)

    def begin(self, lease: Lease, seconds: float) -> str | None:
        aborted_by = self._prolong(lease, seconds, begin=True)
        lease.must_begin = False
        return aborted_by

    def _prolong(self, lease: Lease, seconds: float, *, begin: bool) -> str | None:
        """Push the lease's deadline; ``begin`` also ends its claim ahead (a loss counts now).
        Returns who asked to abort the job, if anyone did."""
        deadline = _ms(time.time() + seconds)
        reply = self._run("extend", lease.queue, lease.token, lease.owner_token, deadline, int(begin))
        if reply == 0:
            raise LeaseLost(f"job {lease.token} is no longer leased by this worker")
        lease.expires_at = _from_ms(deadline)
        return None if isinstance(reply, int) else _text(reply)

    def request_abort(self, job_id: str, requested_by: str) -> AbortRequest:
        """Looks in every queue of ``JOBS["QUEUES"]``: a waiting or delayed message is taken out
        atomically and recorded as a cancelled ``Job`` row; a leased one is flagged."""
        from ..audit import record_cancelled  # the models load after the app registry
        from ..history import record
        from ..models import AttemptOutcome

        for queue in conf.queues():
            reply = self._run("abort", queue, job_id, requested_by)
            done = _text(reply[0])
            if done == "asked":
                return "asked"
            if done == "cancelled":
                envelope, _ = decode_lease_body(reply[1])
                if envelope is not None:
                    reason = JobAborted.describe(requested_by)
                    record_cancelled(envelope, reason, self.name, envelope.attempts, queue)
                    record(job_id, envelope.attempts + 1, AttemptOutcome.CANCELLED, error=reason, worker=requested_by)
                return "cancelled"
        return "unknown"

    def reap_expired(self, queue: str | None = None) -> int:
        """Each expired lease counts as a failed run: requeued with backoff, or failed. One
        claimed ahead and never begun goes back to waiting as it was, not counted as a run."""
        return sum(self._reap_queue(q) for q in ([queue] if queue else conf.queues()))

    def _reap_queue(self, queue: str) -> int:
        from ..reaper import lost_run
        from ..retry import reaping, trusted_options

        keys = self.keys(queue)
        now = _ms()
        ids = self.client.zrangebyscore(keys.processing, "-inf", now, start=0, num=REAP_BATCH, withscores=True)
        if not ids:
            return 0
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(keys.owners, [i for i, _ in ids])
        pipe.hmget(keys.bodies, [i for i, _ in ids])
        owners, bodies = pipe.execute()
        reaped = 0
        for (job_id, deadline), owner, body in zip(ids, owners, bodies, strict=True):
            # One message's error is logged and counted and never stops the pass; a lost
            # connection does (every later message would fail the same way).
            with reaping(job_id, queue, fatal=(redis.ConnectionError, redis.TimeoutError)):
                try:
                    error = WorkerLost.describe(_from_ms(deadline))
                except (ValueError, OverflowError, OSError):  # a score written by hand
                    error = "WorkerLost: lease expired (worker crashed or stalled)"
                env, _ = decode_lease_body(body) if body is not None else (None, None)
                if env is None:  # undecodable: nothing to retry, keep it failed for audit
                    action, new_body, due = "fail", b"", 0
                else:
                    # Its own backoff only if it verifies; an unverified message is still recovered
                    # (a lost run) with the global policy, and the worker rejects it when fetched.
                    delay = after_lost_run(env.attempts, env.max_retries, trusted_options(env, queue))
                    action = "fail" if delay is None else "retry"
                    retry_in = delay
                    due = now + int((delay or 0) * 1000)  # same clock as `now`: no delay means ready now
                    new_body = env.next_attempt().to_bytes()
                done = self._run("reap", queue, job_id, owner or b"", now, action, new_body, due, error)
                reaped += done != 0
                if isinstance(done, list):  # asked to abort: cancelled, not requeued
                    if env is not None:
                        self._reaped_aborted(env, queue, _text(done[0]), bool(done[1]), error)
                elif done == 1 and env is not None:  # a lost run (2: claimed ahead, handed back uncounted)
                    lost_run(self, env.id, queue, env.attempts + 1, error, retry_in=retry_in, handler=env.handler)
                    if action == "fail":
                        self.record_failure(env, error, env.attempts + 1, queue)
        return reaped

    def _reaped_aborted(self, env: Envelope, queue: str, who: str, counted: bool, lost: str) -> None:
        """The reaper cancelled a job asked to abort: its record, as :meth:`request_abort` keeps."""
        from ..audit import record_cancelled  # the models load after the app registry
        from ..reaper import aborted_lost_run

        error = f"{JobAborted.describe(who)}\n{lost}"
        record_cancelled(env, error, self.name, env.attempts + int(counted), queue)
        aborted_lost_run(self, env.id, queue, env.attempts + 1, who, error, handler=env.handler)

    def wait_for_work(self, queues: list[str], timeout: float) -> bool:
        """Block on the queues' notify lists, waking early for the next delayed message."""
        now = time.time()
        dues = [d for d in (self._next_due.get(q, 0.0) for q in queues) if d]
        if dues:
            timeout = min(timeout, max(min(dues) - now, 0.0))
        if timeout < 0.01:
            return True
        self.client.blpop([self.keys(q).notify for q in queues], timeout=timeout)
        return True

    def size(self, queue: str) -> int:
        counts = self.stats(queue)
        return counts["pending"] + counts["delayed"] + counts["in_progress"]

    def stats(self, queue: str) -> dict[str, int]:
        keys = self.keys(queue)
        pipe = self.client.pipeline(transaction=False)
        for key in (keys.waiting, keys.delayed, keys.processing, keys.failed):
            pipe.zcard(key)
        waiting, delayed, processing, failed = pipe.execute()
        return {"pending": waiting, "delayed": delayed, "in_progress": processing, "failed": failed}

    def oldest_ready_age(self, queue: str) -> float | None:
        """Redis keeps no enqueue time of its own: a message's readiness is known from its due
        time while it sits in the delayed set past due (no worker has moved it yet), and from
        its envelope's ``available_at`` (set when it was dispatched with a delay or a schedule,
        or requeued for a retry). The age is the older of the first due delayed message and the
        next waiting message, where known; ``None`` when neither tells (a job dispatched to run
        at once carries no time)."""
        keys, now = self.keys(queue), time.time()
        pipe = self.client.pipeline(transaction=False)
        pipe.zrange(keys.waiting, 0, 0)
        pipe.zrangebyscore(keys.delayed, "-inf", _ms(now), start=0, num=1, withscores=True)
        head, due = pipe.execute()
        since = [score / 1000 for _, score in due]
        body = self.client.hget(keys.bodies, head[0]) if head else None
        envelope = decode_lease_body(body)[0] if body is not None else None
        if envelope is not None and envelope.available_at is not None:
            since.append(envelope.available_at.timestamp())
        return max(now - min(since), 0.0) if since else None

    def persistence_warning(self) -> str | None:
        """``CONFIG GET appendonly`` and ``save``: neither AOF nor an RDB save point means a
        restart loses everything. Where CONFIG is disabled (managed Redis), ``INFO persistence``
        tells AOF and whether an RDB snapshot was ever written since the server started."""
        client, throwaway = self._probe_client()
        try:
            where = _address(client)
            try:
                aof = _text(client.config_get("appendonly").get("appendonly"))
                save = _text(client.config_get("save").get("save"))
            except redis.ResponseError:  # CONFIG is disabled or not allowed
                info = client.info("persistence")
                if (
                    info.get("aof_enabled")
                    or info.get("rdb_saves", 0)
                    or info.get("rdb_last_bgsave_time_sec", -1) != -1
                ):
                    return None
                return (
                    f"Redis at {where} has AOF off and has written no RDB snapshot since it started (its save points "
                    "are unknown: CONFIG is disabled): a restart may lose every queued job"
                )
            if aof == "yes" or save.strip():
                return None
            return (
                f"Redis at {where} keeps nothing on disk (no AOF, no RDB save points): a restart loses every queued job"
            )
        finally:
            if throwaway:
                client.close()

    def _probe_client(self) -> tuple[Any, bool]:
        """A client that gives up after ``PROBE_TIMEOUT`` (from ``URL``: its own, to close), or
        the cache's (``CACHE``: its own timeouts apply)."""
        if self.options.get("CACHE") or not self.options.get("URL"):
            return self.client, False
        url = self.options["URL"]
        return redis.Redis.from_url(url, socket_connect_timeout=PROBE_TIMEOUT, socket_timeout=PROBE_TIMEOUT), True

    def purge_failed(self, queue: str, older_than: timedelta | None = None) -> int:
        keys = self.keys(queue)
        limit = _ms(time.time() - older_than.total_seconds()) if older_than else "+inf"
        ids = self.client.zrangebyscore(keys.failed, "-inf", limit)
        if ids:
            pipe = self.client.pipeline(transaction=True)
            pipe.zrem(keys.failed, *ids)
            pipe.hdel(keys.errors, *ids)
            pipe.hdel(keys.bodies, *ids)
            pipe.hdel(keys.priorities, *ids)
            pipe.execute()
        return len(ids)


def _address(client: Any) -> str:
    """``host:port`` (or the socket path) a client talks to, for messages."""
    kwargs = client.connection_pool.connection_kwargs
    return str(kwargs["path"]) if kwargs.get("path") else f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


def _acks(leases: list[Lease]) -> str:
    """The [id, owner] pairs a batch ack script fences on, as JSON."""
    return json.dumps([[lease.token, lease.owner_token] for lease in leases], ensure_ascii=False)


def _lost(leases: list[Lease], acked: list[int]) -> list[Lease]:
    """The leases a batch ack found no longer held (flag 0), in order."""
    return [lease for lease, ok in zip(leases, acked, strict=True) if not ok]
