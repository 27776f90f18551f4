"""The Redis backend: every state change is one atomic Lua script (``backends/lua/*.lua``).

Per queue: a waiting zset (priority, then FIFO), a delayed zset (due time), a processing zset
(lease deadlines) with an owners hash (fencing tokens), a failed zset kept for audit, and the
message bodies. An idle worker blocks on a notify list instead of polling. ``fetch_many`` claims
a batch ahead of its run: an ahead hash marks those claims, so the reaper hands a lost one back
without counting a run until the worker ``begin``s it. An aborts hash flags running jobs asked to
abort; the heartbeat's extend reads it. Rate and concurrency limits have keys and scripts of
their own (``redis_limits.py``).

Dependencies: a message with parents waits in a blocked hash, one member of its queue's edges
zset per parent it still waits for, and is attached to each parent in the parent's own queue (a
dependents zset), so every script still touches one queue's keys. A parent with dependents that
settles writes its outcome into its queue's finished hash, an outbox that Python drains at once
(one resolve script per child, in the child's queue) and that ``resolve_dependents`` replays
after a crash: every step is idempotent. Both zsets are read by lexical range (members are ids
joined by NUL), so a step costs the same whether a parent has one dependent or 100,000, and no
script or pipeline grows with a flow's size.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from functools import cache, cached_property
from importlib.resources import files
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import conf, rows
from ..envelope import Envelope
from ..exceptions import (
    AbortRequested,
    InvalidPayload,
    JobAborted,
    LeaseLost,
    ParentCancelled,
    ParentFailed,
    WorkerLost,
)
from ..ids import time_of
from ..retry import after_lost_run
from . import redis_connection, redis_limits, require
from .base import (
    NO_RESULT,
    AbortAsked,
    AbortRequest,
    Lease,
    LimitedBackend,
    LiveJob,
    Requeue,
    Requeued,
    decode_lease_body,
)

if TYPE_CHECKING:
    from ..audit import Recorded

redis = require("redis", "redis")
logger = logging.getLogger("django_jobs.backends.redis")

SCRIPTS = (
    "enqueue",
    "enqueue_many",
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
    "block",
    "attach",
    "resolve",
    "drained",
    "wake",
)
# Priorities share a float64 score with a 40-bit sequence number: keep them exact.
PRIORITY_LIMIT = 8000
REAP_BATCH = 500
# A failed message's Job row is written just after the script that failed it: the reaper writes
# the rows still missing this long (seconds) after the failure.
RECORD_GRACE = 60.0
# Edges one attach script links (so that a group of thousands does not hold Redis up at once).
LINK_BATCH = 500
# Edges one round of a drain resolves, and commands one pipeline sends: a flow of 100,000 jobs
# is sent and resolved in rounds that each hold Redis up for a moment only.
DRAIN_BATCH = 1000
# Script calls one pipeline sends when storing a bulk, and the bytes of messages above which one
# call is sent without waiting for its DRAIN_BATCH jobs: a bulk of any size or bodies is stored
# in round trips that each hold Redis up for a moment only.
PIPELINE_CALLS = 10
STORE_BYTES = 8 * 1024 * 1024
# Joins the ids of an edge in a member of the dependents and edges zsets (no job id holds it).
SEP = "\0"
# Seconds a worker whose queues span several cluster slots blocks on one slot's notify lists
# before it looks at the next slot's: its wake-up latency is up to (slots - 1) times this.
CLUSTER_WAIT_SLICE = 0.05
# A settle script's flag for a parent whose outcome entered the outbox: its dependents wait for
# a drain (``reap.lua`` says 3 for its failed parents, as its 2 means something else).
HAS_DEPENDENTS = 2
REAPED_WITH_DEPENDENTS = 3
# ``Lease.result`` once a kept result was stored before its dependents were released.
STORED: Any = object()


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
    dependents: str  # zset (lex): "parent id NUL child id NUL child queue", attached while it is live
    finished: str  # hash: parent id -> its outcome, until its dependents are resolved (the outbox)
    blocked: str  # hash: child id -> how many parents it was dispatched with, while it waits
    edges: str  # zset (lex): "child id NUL parent id" for each parent a blocked child still waits for
    unrecorded: str  # zset: failure time (ms) -> id of a failed message whose Job row is not written yet

    @classmethod
    def of(cls, prefix: str, queue: str) -> QueueKeys:
        # The {queue} hash tag keeps one queue's keys in one Redis Cluster slot.
        return cls(*(f"{prefix}:{{{queue}}}:{kind}" for kind in cls._fields))


KINDS = QueueKeys._fields


def _source(name: str) -> str:
    """A script behind its prelude: ``common.lua`` (a queue's keys) or, for a limit's script,
    ``limit_common.lua`` (a limit's keys)."""
    prelude = "limit_common" if name in redis_limits.SCRIPTS else "common"
    return _lua(prelude) + "\n" + _lua(name)


@cache
def _lua(name: str) -> str:
    """The text of ``lua/<name>.lua`` (a prelude is read once, not once per script)."""
    return (files("django_jobs.backends") / "lua" / f"{name}.lua").read_text()


def _ms(moment: float | None = None) -> int:
    return int((time.time() if moment is None else moment) * 1000)


def _from_ms(ms: float) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


class RedisBackend(LimitedBackend):
    """Options: ``URL`` (``redis://...``, or ``redis+sentinel://...``), ``CACHE`` (a django-redis
    cache alias whose pool is reused), ``SENTINELS`` and ``SERVICE``, or ``CLUSTER`` with ``URL``
    or ``STARTUP_NODES`` (``redis_connection.py``); ``PREFIX`` (default ``django_jobs``)."""

    # ReadOnlyError: a primary demoted by a Sentinel failover (MasterNotFoundError, while the
    # sentinels have no primary, is a ConnectionError). ClusterError: a cluster whose slots are
    # not all served (CLUSTERDOWN, while a replica takes over).
    unavailable_errors = (
        redis.ConnectionError,
        redis.TimeoutError,
        redis.exceptions.ReadOnlyError,
        redis.exceptions.ClusterError,
        OSError,
    )
    supports_priority = True
    pipelines_ack_fetch = True
    supports_prefetch = True
    batches_requeues = True
    supports_dependencies = True

    @classmethod
    def options_problem(cls, options: dict[str, Any]) -> str | None:
        return redis_connection.problem(options)

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        super().__init__(name, options)
        self.prefix = options.get("PREFIX", "django_jobs")
        self._client: Any = None
        self._scripts: dict[str, Any] = {}
        self._next_due: dict[str, float] = {}
        self._keys: dict[str, QueueKeys] = {}

    @cached_property
    def limits(self) -> redis_limits.RedisLimits:
        return redis_limits.RedisLimits(self)

    # -- connection --

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = redis_connection.connect(self.name, self.options)
            names = SCRIPTS + redis_limits.SCRIPTS
            self._scripts = {name: self._client.register_script(_source(name)) for name in names}
        return self._client

    def where(self) -> str:
        try:
            address = redis_connection.address(self.client)  # builds the client; connects on its first command
        except Exception:  # noqa: BLE001 - a description must not fail
            address = "?"
        return f"backend {self.name!r} (redis at {address})"

    def close(self) -> None:
        if self._client is not None and not redis_connection.shared(self.options):
            redis_connection.disconnect(self._client)
        self._client = None

    def keys(self, queue: str) -> QueueKeys:
        """The keys of ``queue`` (worked out once: every script call asks)."""
        keys = self._keys.get(queue)
        if keys is None:
            keys = self._keys[queue] = QueueKeys.of(self.prefix, queue)
        return keys

    def _run(self, script: str, queue: str, *args: Any) -> Any:
        """Run one Lua script on ``queue``: every script gets all the queue's keys, in
        :class:`QueueKeys` order."""
        return self.run_script(script, self.keys(queue), args)

    def run_script(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run one registered Lua script: one ``EVALSHA``, one round trip (a cluster sends it to
        the primary of its keys' slot). A server that lost the script (restarted, or a replica
        promoted since) ran nothing: the script is loaded again and the call resent."""
        connection = self.client  # connects and registers the scripts
        lua = self._scripts[script]
        try:
            return connection.evalsha(lua.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            connection.script_load(lua.script)
            return connection.evalsha(lua.sha, len(keys), *keys, *args)

    def script_call(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> tuple[Any, ...]:
        """A command of :meth:`send` that runs one registered Lua script, by its SHA alone (a
        redis-py pipeline given the script itself first asks the server whether it has it, a
        round trip more; a cluster's pipeline refuses it)."""
        self.client  # noqa: B018  (connects and registers the scripts)
        return ("execute_command", "EVALSHA", self._scripts[script].sha, len(keys), *keys, *args)

    def batch(self, script: str, calls: Sequence[tuple[Sequence[str], Sequence[Any]]], *reads: Any) -> list[Any]:
        """One round trip: ``reads`` (``(client method name, *args)``), then ``script`` once
        per (keys, args) of ``calls``; their replies, in order."""
        return self.send([*reads, *(self.script_call(script, keys, args) for keys, args in calls)])

    def send(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``commands`` (``(client method name, *args)``, or :meth:`script_call`'s) in one
        pipeline, not a transaction (a cluster sends each server its share); their replies, in
        order. A script call that found its script gone (a restarted server, a promoted replica)
        did not run: the scripts are loaded again (on every primary) and those calls alone are
        sent again. Then the first error is raised, as a pipeline does."""
        replies = self._pipe(commands)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, redis.exceptions.NoScriptError)]
        if missing:
            for lua in self._scripts.values():
                self.client.script_load(lua.script)
            for i, reply in zip(missing, self._pipe([commands[i] for i in missing]), strict=True):
                replies[i] = reply
        error = next((reply for reply in replies if isinstance(reply, Exception)), None)
        if error is not None:
            raise error
        return replies

    def _pipe(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        pipe = redis_connection.pipeline(self.client)
        for method, *args in commands:
            getattr(pipe, method)(*args)
        return list(pipe.execute(raise_on_error=False))

    def _fenced(self, script: str, lease: Lease, *args: Any) -> int:
        """Run a settle script fenced on ``lease``; its flag (0 raises ``LeaseLost``)."""
        flag: int = self._run(script, lease.queue, lease.token, lease.owner_token, *args)
        if not flag:
            raise LeaseLost(f"job {lease.token} is no longer leased by this worker")
        return flag

    # -- protocol --

    def _block(self, envelope: Envelope) -> list[tuple[Any, ...]]:
        """The commands (for :meth:`send`) that store ``envelope``, which has parents: its open
        edges (``DRAIN_BATCH`` to a command), then itself blocked."""
        keys = self.keys(envelope.queue)
        parents = _parents(envelope)
        members = [f"{envelope.id}{SEP}{parent}" for parent in parents]
        edges = [("zadd", keys.edges, dict.fromkeys(chunk, 0)) for chunk in rows.chunked(members, DRAIN_BATCH)]
        body, priority = envelope.to_bytes(), _priority(envelope)
        return [*edges, self.script_call("block", keys, (envelope.id, body, priority, len(parents)))]

    def _store(self, envelope: Envelope) -> Any:
        """Store ``envelope`` ready, or delayed until its ``available_at``: one ``EVALSHA``."""
        return self._run("enqueue", envelope.queue, *_stored(envelope), _ms())

    def enqueue(self, envelope: Envelope) -> str:
        if envelope.parents:
            self.enqueue_many([envelope])
        else:
            self._store(envelope)
        return envelope.id

    def redispatch(self, envelope: Envelope) -> str:
        """Stored ready (or delayed), never blocked: a parent that still runs and holds it in its
        ``dependents`` later resolves an edge to a job no longer blocked, which changes nothing."""
        self._store(envelope)
        return envelope.id

    def enqueue_many(self, envelopes: list[Envelope]) -> list[str]:
        """The jobs without parents: one ``enqueue_many`` script per queue and ``DRAIN_BATCH``
        jobs (or ``STORE_BYTES`` of messages), ``PIPELINE_CALLS`` of them to a :meth:`send`. The
        children: sends store them blocked, ``DRAIN_BATCH`` to one; then they are attached to
        their parents, which are stored by then even when they are in this batch."""
        now = _ms()
        calls = [(self.keys(queue), [now, *args]) for queue, args in _store_calls(envelopes)]
        for some in rows.chunked(calls, PIPELINE_CALLS):
            self.batch("enqueue_many", some)
        children = [envelope for envelope in envelopes if envelope.parents]
        for batch in rows.chunked(children, DRAIN_BATCH):
            self.send([command for envelope in batch for command in self._block(envelope)])
        edges = [(e.id, e.queue, parent) for e in children for parent in _parents(e)]
        if edges:
            self._attach(edges)
        return [e.id for e in envelopes]

    def fetch(self, queue: str) -> Lease | None:
        owner, now, deadline = self._new_lease()
        job_id, body = self.claim_one(queue, owner, lambda: self._run("fetch", queue, now, deadline, owner))
        return self._leased(queue, job_id, body, owner, _from_ms(deadline))

    def ack_and_fetch(self, lease: Lease, queue: str) -> Lease | None:
        if queue != lease.queue:  # one script touches one queue's keys (one cluster slot)
            return super().ack_and_fetch(lease, queue)
        owner, now, deadline = self._new_lease()
        reply = self.claim_one(
            queue, owner, lambda: self._run("ack_fetch", queue, lease.token, lease.owner_token, now, deadline, owner)
        )
        if not reply[0]:
            raise LeaseLost(f"job {lease.token} is no longer leased by this worker")
        if reply[0] == HAS_DEPENDENTS:
            self._completed([lease])
        return self._leased(queue, reply[1], reply[2], owner, _from_ms(deadline))

    @staticmethod
    def _new_lease() -> tuple[str, int, int]:
        now = time.time()
        return secrets.token_hex(16), _ms(now), _ms(now + conf.get("LEASE_TIMEOUT"))

    def _leased(
        self,
        queue: str,
        job_id: bytes | None,
        body: bytes | None,
        owner: str,
        expires_at: datetime,
        limit: int | None = None,
    ) -> Lease | None:
        """The Lease for what a fetch script returned (``job_id`` None: empty, ``body`` = next
        due); ``limit``: the size cap, read once for a batch."""
        if job_id is None:
            self._next_due[queue] = float(body) / 1000 if body is not None else 0.0
            return None
        token = job_id.decode()
        lease = Lease(token=token, owner_token=owner, expires_at=expires_at, queue=queue)
        if body is None:
            lease.error = InvalidPayload(f"message {token!r} has no body")
        else:
            lease.envelope, lease.error = decode_lease_body(body, limit)
        return lease

    def fetch_many(self, queue: str, limit: int) -> list[Lease]:
        if limit < 1:
            return []
        owner, now, deadline = self._new_lease()
        reply = self._run("fetch_many", queue, now, deadline, owner, limit)
        return self._claimed(queue, reply, owner, deadline)

    def ack_many(self, leases: list[Lease], begun: Sequence[Lease] = ()) -> list[Lease]:
        return self.settle_many(leases, begun)[0]

    def settle_many(
        self, acks: list[Lease], begun: Sequence[Lease] = (), requeues: Sequence[Requeue] = ()
    ) -> tuple[list[Lease], list[Requeued]]:
        by_queue: dict[str, tuple[list[Lease], list[Lease], list[Requeue]]] = {}
        for lease in acks:
            by_queue.setdefault(lease.queue, ([], [], []))[0].append(lease)
        for lease in begun:
            by_queue.setdefault(lease.queue, ([], [], []))[1].append(lease)
        for requeue in requeues:
            by_queue.setdefault(requeue.lease.queue, ([], [], []))[2].append(requeue)
        lost: list[Lease] = []
        done: dict[int, Requeued] = {}
        now = _ms()
        for queue, (group, started, again) in by_queue.items():  # one script per queue (one cluster slot)
            flags, replies = self._run("ack_many", queue, _acks(group), _acks(started), _requeues(again), now)
            self._completed(_parents_done(group, flags))
            lost += _lost(group, flags)
            done.update(zip(map(id, again), map(_requeued, replies), strict=True))
        return lost, [done[id(requeue)] for requeue in requeues]

    def ack_many_and_fetch(self, leases: list[Lease], queue: str, limit: int) -> tuple[list[Lease], list[Lease]]:
        lost, _, claimed = self.settle_many_and_fetch(leases, (), queue, limit)
        return lost, claimed

    def settle_many_and_fetch(
        self, acks: list[Lease], requeues: Sequence[Requeue], queue: str, limit: int
    ) -> tuple[list[Lease], list[Requeued], list[Lease]]:
        if limit < 1 or any(lease.queue != queue for lease in acks) or any(r.lease.queue != queue for r in requeues):
            lost, done = self.settle_many(acks, (), requeues)
            return lost, done, self.fetch_many(queue, limit)
        owner, now, deadline = self._new_lease()
        acked, reply, replies = self._run(
            "ack_many_fetch", queue, _acks(acks), now, deadline, owner, limit, _requeues(requeues)
        )
        self._completed(_parents_done(acks, acked))
        return _lost(acks, acked), [_requeued(one) for one in replies], self._claimed(queue, reply, owner, deadline)

    def _claimed(self, queue: str, reply: list[Any], owner: str, deadline: int) -> list[Lease]:
        """The Leases of a batch claimed ahead: ``reply`` holds (id, body, must_begin) triples,
        or a single empty one (``_leased`` then records the next due time)."""
        leases = []
        expires_at, limit = _from_ms(deadline), conf.get("MAX_MESSAGE_BYTES")  # the same for the whole batch
        for i in range(0, len(reply), 3):
            lease = self._leased(queue, reply[i], reply[i + 1], owner, expires_at, limit)
            if lease is None:
                break
            lease.ahead, lease.must_begin = True, bool(reply[i + 2])
            leases.append(lease)
        return leases

    def ack(self, lease: Lease, *, count_run: bool = True) -> None:
        if self._fenced("ack", lease, "completed") == HAS_DEPENDENTS:
            self._completed([lease])

    def cancel(self, lease: Lease, reason: str, *, count_run: bool = True) -> None:
        """Forget the aborted message and keep a cancelled ``Job`` row; its dependents are then
        resolved as of a cancelled parent."""
        from ..audit import record_cancelled  # the models load after the app registry

        flag = self._fenced("ack", lease, "cancelled")
        if lease.envelope is not None:
            env = lease.envelope
            record_cancelled(env, reason, self.name, env.attempts + int(count_run), lease.queue)
        if flag == HAS_DEPENDENTS:
            self._release([(lease.token, lease.queue)])

    def keep_result(self, lease: Lease, value: Any) -> None:
        """Stored once: its ack, which releases the job's dependents, does not store it again."""
        if lease.result is not STORED:
            super().keep_result(lease, value)
            lease.result = STORED

    def nack(self, lease: Lease, delay: float, *, error: str = "", count_run: bool = True) -> None:
        due = time.time() + max(delay, 0)
        reply = self._run("nack", lease.queue, *_requeue_args(Requeue(lease, due, error, count_run)), _ms())
        if reply == 0:
            raise LeaseLost(f"job {lease.token} is no longer leased by this worker")
        if not isinstance(reply, int):  # who asked to abort it: not requeued
            raise AbortRequested(_text(reply))

    def abandon(self, lease: Lease, error: str, *, count_run: bool = True) -> None:
        """Its failed ``Job`` row is written before its dependents are resolved: a worker killed
        while resolving them leaves the row, and the reaper's sweep resolves the rest."""
        has_dependents = self._fail(lease, error, count_run)
        if lease.envelope is not None:
            env = lease.envelope
            self._record_failure(lease.token, env, error, env.attempts + int(count_run), lease.queue)
        if has_dependents:
            self._release([(lease.token, lease.queue)])

    def dead_letter(self, lease: Lease, error: str, *, count_run: bool = True) -> None:
        if self._fail(lease, error, count_run):
            self._release([(lease.token, lease.queue)])

    def _fail(self, lease: Lease, error: str, count_run: bool) -> bool:
        """The ``abandon`` script (fenced): failed set, error; whether the job has dependents."""
        env = lease.envelope
        body = b"" if env is None else (env.next_attempt() if count_run else env).to_bytes()
        return bool(self._fenced("abandon", lease, body, _ms(), error) == HAS_DEPENDENTS)

    def _record_failure(self, job_id: str | bytes, envelope: Envelope, error: str, attempts: int, queue: str) -> None:
        """:meth:`record_failure` of the failed message ``job_id``, then :meth:`_recorded`. A row
        not written, or an id not taken out of ``unrecorded``, is left to
        :meth:`record_missed_failures`."""
        recorded = self.record_failure(envelope, error, attempts, queue)
        if recorded is not None:
            with contextlib.suppress(*self.unavailable_errors):
                self._recorded(queue, [(job_id, recorded)])

    def _recorded(self, queue: str, written: list[tuple[str | bytes, Recorded]]) -> list[Recorded]:
        """Rows just written for the failed messages of ``queue``: their ids out of ``unrecorded``
        (which every failing script adds them to), and, in the same round trip, a look at the
        failed set: the row of a job no longer failed (retried or purged while its row was being
        written) is deleted again. Returns those deleted."""
        from ..audit import forget  # the models load after the app registry

        keys = self.keys(queue)
        ids = [job_id for job_id, _ in written]
        pipe = self.client.pipeline(transaction=False)
        pipe.zrem(keys.unrecorded, *ids)
        pipe.zmscore(keys.failed, ids)
        _, scores = pipe.execute()
        stale = [recorded for (_, recorded), score in zip(written, scores, strict=True) if score is None]
        if stale:
            forget(stale)
        return stale

    def record_missed_failures(self) -> int:
        """Per queue, every message failed over ``RECORD_GRACE`` seconds ago whose row is still
        unwritten (``REAP_BATCH`` at a time): each still in the failed set and decodable gets its
        row, from its stored body and error; the others (retried or purged since, undecodable)
        need none. Stops at the first row it cannot write (the database is down: the next pass
        tries again). Returns how many rows it created and kept (a row written by a worker that
        died before taking its id out is written again, not counted)."""
        created = 0
        cut = _ms(time.time() - RECORD_GRACE)
        for queue in conf.queues():
            unrecorded = self.keys(queue).unrecorded
            while ids := self.client.zrangebyscore(unrecorded, "-inf", cut, start=0, num=REAP_BATCH):
                more, complete = self._record_missed(queue, ids)
                created += more
                if not complete:
                    return created
        return created

    def _record_missed(self, queue: str, ids: list[bytes]) -> tuple[int, bool]:
        """One batch of :meth:`record_missed_failures`: the rows created and kept, and whether
        every id of the batch is done with (``False``: a row could not be written)."""
        keys = self.keys(queue)
        pipe = self.client.pipeline(transaction=False)
        pipe.zmscore(keys.failed, ids)
        pipe.hmget(keys.bodies, ids)
        pipe.hmget(keys.errors, ids)
        failed, bodies, errors = pipe.execute()
        needless: list[bytes] = []
        written: list[tuple[str | bytes, Recorded]] = []
        complete = True
        for job_id, score, body, error in zip(ids, failed, bodies, errors, strict=True):
            env = decode_lease_body(body)[0] if score is not None and body is not None else None
            if env is None:
                needless.append(job_id)
                continue
            recorded = self.record_failure(env, _text(error), env.attempts, queue)
            if recorded is None:
                complete = False
                break
            written.append((job_id, recorded))
        if needless:
            self.client.zrem(keys.unrecorded, *needless)
        stale = self._recorded(queue, written) if written else []
        return sum(recorded.created and recorded not in stale for _, recorded in written), complete

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

    def lose_claims(self, queue: str, owner_token: str, counted: Sequence[str], *, unrun: bool = False) -> None:
        self._run("lose", queue, owner_token, _ms(), json.dumps(list(counted)), int(unrun))

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
        self.limits.extend(lease, deadline)
        return None if isinstance(reply, int) else _text(reply)

    def abort_requested(self, lease: Lease) -> str | None:
        """One ``HGET`` of the queue's aborts hash."""
        who = self.client.hget(self.keys(lease.queue).aborts, lease.token)
        return None if who is None else _text(who)

    def wake(self, queue: str, job_id: str) -> int:
        """A job parked on a limit: ready now if it waits delayed in ``queue`` (1); 2 if it is
        leased or ready already (on its way to look for room itself), 0 if it is not there."""
        return int(self._run("wake", queue, job_id))

    def request_abort(self, job_id: str, requested_by: str) -> AbortRequest | AbortAsked:
        """Looks in every queue of ``JOBS["QUEUES"]``: a waiting or delayed message is taken out
        atomically and recorded as a cancelled ``Job`` row; a leased one is flagged, unless it
        was already (the aborts hash keeps who asked, not when)."""
        from ..audit import record_cancelled  # the models load after the app registry
        from ..history import record
        from ..models import AttemptOutcome

        for queue in conf.queues():
            reply = self._run("abort", queue, job_id, requested_by)
            done = _text(reply[0])
            if done == "asked":
                return "asked"
            if done == "already":
                return AbortAsked(_text(reply[1]))
            if done == "cancelled":
                envelope, _ = decode_lease_body(reply[1])
                if envelope is not None:
                    reason = JobAborted.describe(requested_by)
                    record_cancelled(envelope, reason, self.name, envelope.attempts, queue)
                    record(job_id, envelope.attempts + 1, AttemptOutcome.CANCELLED, error=reason, worker=requested_by)
                if reply[2] == HAS_DEPENDENTS:
                    self._release([(job_id, queue)])
                return "cancelled"
        return "unknown"

    # -- dependencies --

    def _completed(self, leases: list[Lease]) -> None:
        """These parents completed and jobs depend on them: a kept result is stored first (a
        dependent may be handed it), then their dependents are resolved."""
        if not leases:
            return
        for lease in leases:
            if lease.result is not NO_RESULT and lease.result is not STORED:
                super().keep_result(lease, lease.result)
                lease.result = STORED
        self._release([(lease.token, lease.queue) for lease in leases])

    def _release(self, parents: list[tuple[str, str]]) -> None:
        """Resolve the dependents of parents, (id, queue), that just settled. Their settle is
        done: an error here is logged, not raised (a settle tried again would find its lease
        gone), and the reaper's sweep replays their outbox entries."""
        try:
            self._drain(parents)
        except Exception:
            ids = ", ".join(parent for parent, _ in parents)
            logger.exception("could not resolve the dependents of job(s) %s now; the reaper's sweep will", ids)

    def _attach(self, edges: list[tuple[str, str, str]]) -> None:
        """``_link`` for edges of children just stored blocked. They are dispatched: an error here
        is logged, not raised, and the reaper's sweep links them."""
        try:
            self._link(edges)
        except Exception:
            ids = ", ".join(dict.fromkeys(child for child, _, _ in edges))
            logger.exception("could not attach job(s) %s to their parents now; the reaper's sweep will", ids)

    def _link(self, edges: list[tuple[str, str, str]]) -> int:
        """Attach the edges (child, child's queue, parent) of blocked children to each parent in
        the queue of ``JOBS["QUEUES"]`` that holds it live: the child's own queue is asked first
        (a flow usually keeps to one), the others only for parents it does not hold; one script
        per queue asked and ``LINK_BATCH`` edges. An edge to a parent no longer live is resolved
        at once. Returns how many dependents that moved on."""
        queues = conf.queues()
        said: dict[tuple[str, str, str], str] = {}
        pending = edges
        for own in (True, False):
            asked: dict[str, list[tuple[str, str, str]]] = {}
            for edge in pending:
                for queue in [edge[1]] if own else [q for q in queues if q != edge[1]]:
                    asked.setdefault(queue, []).append(edge)
            chunks = [(q, chunk) for q, some in asked.items() for chunk in rows.chunked(some, LINK_BATCH)]
            calls = [
                (q, [json.dumps([[parent, child, child_queue] for child, child_queue, parent in chunk])])
                for q, chunk in chunks
            ]
            replies: dict[tuple[str, str, str], list[str]] = {}
            for (_, chunk), reply in zip(chunks, self._each("attach", calls), strict=True):
                for edge, outcome in zip(chunk, reply, strict=True):
                    replies.setdefault(edge, []).append(_text(outcome))
            for edge, seen in replies.items():
                said[edge] = "attached" if "attached" in seen else next((s for s in seen if s != "gone"), "gone")
            pending = [edge for edge in pending if said.get(edge) == "gone"]
        loose = [(child, queue, parent, outcome) for (child, queue, parent), outcome in said.items()]
        loose = [edge for edge in loose if edge[3] != "attached"]
        on_record = self._outcomes_on_record([parent for _, _, parent, outcome in loose if outcome == "gone"])
        return self._resolve(
            [
                (child, queue, parent, on_record.get(parent, "completed") if outcome == "gone" else outcome)
                for child, queue, parent, outcome in loose
            ]
        )

    def _outcomes_on_record(self, ids: list[str]) -> dict[str, str]:
        """The outcome of parents this backend no longer holds: a failed or cancelled ``Job`` row
        of this backend says it; otherwise it completed (Redis forgets completed jobs)."""
        from ..models import Job, JobStatus  # the models load after the app registry

        found: dict[str, str] = {}
        for chunk in rows.chunked(ids):
            records = Job.objects.filter(
                pk__in=chunk, backend=self.name, status__in=(JobStatus.FAILED, JobStatus.CANCELLED)
            )
            found.update((str(pk), str(status)) for pk, status in records.values_list("pk", "status"))
        return found

    def _each(self, script: str, calls: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        """Run ``script`` once per (queue, args) of ``calls``, in order, ``DRAIN_BATCH`` calls to a
        pipeline; their replies."""
        replies: list[Any] = []
        for batch in rows.chunked(calls, DRAIN_BATCH):
            replies += self.batch(script, [(self.keys(queue), args) for queue, args in batch])
        return replies

    def _drain(self, parents: list[tuple[str, str]]) -> int:
        """Resolve the edges of settled parents, (id, queue), from their queue's outbox, in rounds
        of at most ``DRAIN_BATCH`` edges: a parent leaves the outbox once its last edge is
        resolved (by ``drained``), and a dependent failed or cancelled in turn cascades. Returns
        how many dependents moved on."""
        resolved = 0
        while parents:
            now, parents = parents[:DRAIN_BATCH], parents[DRAIN_BATCH:]
            each = max(1, DRAIN_BATCH // len(now))  # edges read per parent this round
            pipe = self.client.pipeline(transaction=False)
            for parent, queue in now:
                keys = self.keys(queue)
                pipe.hget(keys.finished, parent)
                pipe.zrangebylex(keys.dependents, *lex_range(parent), 0, each)
            replies = pipe.execute()
            edges, done = [], []
            for i, (parent, queue) in enumerate(now):
                outcome, members = replies[2 * i], replies[2 * i + 1]
                if outcome is None:  # drained meanwhile
                    continue
                for member in members:
                    child, child_queue = _text(member)[len(parent) + 1 :].rsplit(SEP, 1)
                    edges.append((child, child_queue, parent, _text(outcome)))
                done.append(((parent, queue), members))
            settled: list[tuple[str, str]] = []
            resolved += self._resolve(edges, settled)
            left = self._each(
                "drained",
                [(queue, [parent, json.dumps([_text(m) for m in members])]) for (parent, queue), members in done],
            )
            parents += [pair for (pair, _), more in zip(done, left, strict=True) if more] + settled
        return resolved

    def _resolve(self, edges: list[tuple[str, str, str, str]], settled: list[tuple[str, str]] | None = None) -> int:
        """Resolve edges (child, child's queue, parent, the parent's outcome), each in its
        child's queue (``resolve.lua`` applies :func:`~django_jobs.flows.edges_verdict`'s rule).
        A dependent this settles is recorded (a ``Job`` row, its attempt history); one that has
        dependents of its own is appended to ``settled`` for the caller to drain, or drained
        here when ``settled`` is ``None``. Returns how many dependents moved on (became ready,
        failed or cancelled): a replayed edge moves none."""
        from ..audit import record_cancelled  # the models load after the app registry
        from ..flows import EdgesVerdict, record_settled

        if not edges:
            return 0
        now = _ms()
        calls = [
            (child_queue, (child, parent, outcome, now, _reason(parent, outcome)))
            for child, child_queue, parent, outcome in edges
        ]
        cascade: list[tuple[str, str]] = []
        moved = 0
        for (child, child_queue, parent, outcome), reply in zip(edges, self._each("resolve", calls), strict=True):
            state = _text(reply[0])
            moved += state not in ("none", "waiting")
            if state not in ("failed", "cancelled"):
                continue
            verdict = EdgesVerdict("failed" if state == "failed" else "cancelled", parent, _reason(parent, outcome))
            envelope, _ = decode_lease_body(reply[1])
            if envelope is not None:  # an undecodable body stays in the failed set for audit
                if verdict.state == "failed":
                    self._record_failure(child, envelope, verdict.reason, envelope.attempts, child_queue)
                else:
                    record_cancelled(envelope, verdict.reason, self.name, envelope.attempts, child_queue)
                record_settled(child, child_queue, envelope.handler, envelope.attempts + 1, verdict, self.history_alias)
            if reply[2] == HAS_DEPENDENTS:
                cascade.append((child, child_queue))
        if settled is None:
            moved += self._drain(cascade)
        else:
            settled += cascade
        return moved

    def resolve_dependents(self) -> int:
        """The safety net the reaper runs: replay every queue's outbox (parents that settled
        while their dependents' resolution did not finish), then look at each open edge of a
        blocked message again (``_link``): attached to a live parent it waits; otherwise (a
        crash between its dispatch and its attach) the edge is resolved. Every step is
        idempotent. Returns how many dependents moved on."""
        queues = conf.queues()
        outbox = [
            (_text(parent), queue)
            for queue in queues
            for parent, _ in self.client.hscan_iter(self.keys(queue).finished, count=REAP_BATCH)
        ]
        resolved = self._drain(outbox)
        for queue in queues:
            batch: list[tuple[str, str, str]] = []
            for member, _ in self.client.zscan_iter(self.keys(queue).edges, count=REAP_BATCH):
                child, parent = _text(member).rsplit(SEP, 1)
                batch.append((child, queue, parent))
                if len(batch) >= REAP_BATCH:
                    resolved += self._relink(queue, batch)
                    batch = []
            resolved += self._relink(queue, batch)
        return resolved

    def _relink(self, queue: str, edges: list[tuple[str, str, str]]) -> int:
        """``_link`` for open edges of ``queue``'s children that are blocked (the edges of a child
        not yet stored blocked are left alone: its dispatch attaches them)."""
        children = list(dict.fromkeys(child for child, _, _ in edges))
        if not children:
            return 0
        blocked = {
            child
            for child, count in zip(children, self.client.hmget(self.keys(queue).blocked, children), strict=True)
            if count is not None
        }
        return self._link([edge for edge in edges if edge[0] in blocked])

    def ping(self) -> None:
        self.client.ping()

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
                    if done[2] == HAS_DEPENDENTS:
                        self._release([(_text(job_id), queue)])
                # A lost run (2: claimed ahead, handed back uncounted).
                elif done in (1, REAPED_WITH_DEPENDENTS) and env is not None:
                    lost_run(self, env.id, queue, env.attempts + 1, error, retry_in=retry_in, handler=env.handler)
                    if action == "fail":
                        self._record_failure(job_id, env, error, env.attempts + 1, queue)
                if done != 0 and env is not None and owner is not None:  # its limits' slots free now
                    self.limits.reaped(_text(job_id), _text(owner), env.handler, queue)
                if done == REAPED_WITH_DEPENDENTS:
                    self._release([(_text(job_id), queue)])
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
        groups = redis_connection.by_slot(self.client, [self.keys(q).notify for q in queues])
        if len(groups) == 1:
            self.client.blpop(groups[0], timeout=timeout)
            return True
        # BLPOP takes the keys of one cluster slot: block on each slot's lists in turn, a
        # moment each, until one is woken or the time is up.
        end = time.monotonic() + timeout
        while True:
            for keys in groups:
                left = end - time.monotonic()
                if left < 0.01 or self.client.blpop(keys, timeout=min(left, CLUSTER_WAIT_SLICE)):
                    return True

    def size(self, queue: str) -> int:
        counts = self.stats(queue)
        return counts["pending"] + counts["delayed"] + counts["in_progress"] + counts["waiting"]

    def stats(self, queue: str) -> dict[str, int]:
        """``waiting``: the jobs blocked until their parents finished."""
        keys = self.keys(queue)
        pipe = self.client.pipeline(transaction=False)
        for key in (keys.waiting, keys.delayed, keys.processing, keys.failed):
            pipe.zcard(key)
        pipe.hlen(keys.blocked)
        ready, delayed, processing, failed, blocked = pipe.execute()
        return {"pending": ready, "delayed": delayed, "in_progress": processing, "failed": failed, "waiting": blocked}

    def oldest_ready_age(self, queue: str) -> float | None:
        """Redis keeps no enqueue time of its own: a message's readiness is known from its due
        time while it sits in the delayed set past due (no worker has moved it yet), and from
        its envelope's ``available_at`` (set when it was dispatched with a delay or a schedule,
        or requeued for a retry), else its id's time (its dispatch). The age is the older of the
        first due delayed message and the next waiting message; ``None`` when neither tells (an
        id of an earlier version, which carries no time)."""
        keys, now = self.keys(queue), time.time()
        pipe = self.client.pipeline(transaction=False)
        pipe.zrange(keys.waiting, 0, 0)
        pipe.zrangebyscore(keys.delayed, "-inf", _ms(now), start=0, num=1, withscores=True)
        head, due = pipe.execute()
        since = [score / 1000 for _, score in due]
        body = self.client.hget(keys.bodies, head[0]) if head else None
        envelope = decode_lease_body(body)[0] if body is not None else None
        ready = None if envelope is None else envelope.available_at or time_of(envelope.id)
        if ready is not None:
            since.append(ready.timestamp())
        return max(now - min(since), 0.0) if since else None

    def persistence_warning(self) -> str | None:
        """Whether a restart of the server (of any primary of a cluster) loses queued jobs: see
        :func:`_persistence_warning`."""
        client, throwaway = self._probe_client()
        try:
            warnings = [w for server in redis_connection.servers(client) if (w := _persistence_warning(server))]
            return "; ".join(warnings) or None
        finally:
            if throwaway:
                client.close()

    def _probe_client(self) -> tuple[Any, bool]:
        """A client that gives up after ``redis_connection.PROBE_TIMEOUT`` (its own, to close),
        or the cache's (``CACHE``: its own timeouts apply)."""
        if redis_connection.shared(self.options):
            return self.client, False
        return redis_connection.connect(self.name, self.options, probe=True), True

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
            pipe.zrem(keys.unrecorded, *ids)
            pipe.execute()
        return len(ids)


def _persistence_warning(server: Any) -> str | None:
    """``CONFIG GET appendonly`` and ``save``: neither AOF nor an RDB save point means a
    restart loses everything. Where CONFIG is disabled (managed Redis), ``INFO persistence``
    tells AOF and whether an RDB snapshot was ever written since the server started."""
    where = redis_connection.address(server)
    try:
        aof = _text(server.config_get("appendonly").get("appendonly"))
        save = _text(server.config_get("save").get("save"))
    except redis.ResponseError:  # CONFIG is disabled or not allowed
        info = server.info("persistence")
        if info.get("aof_enabled") or info.get("rdb_saves", 0) or info.get("rdb_last_bgsave_time_sec", -1) != -1:
            return None
        return (
            f"Redis at {where} has AOF off and has written no RDB snapshot since it started (its save points "
            "are unknown: CONFIG is disabled): a restart may lose every queued job"
        )
    if aof == "yes" or save.strip():
        return None
    return f"Redis at {where} keeps nothing on disk (no AOF, no RDB save points): a restart loses every queued job"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


def _stored(envelope: Envelope) -> tuple[str, bytes, int, int]:
    """What the store of ``envelope`` takes: its id, body, priority and due time (ms; 0: now)."""
    due = _ms(envelope.available_at.timestamp()) if envelope.available_at else 0
    return envelope.id, envelope.to_bytes(), _priority(envelope), due


def _store_calls(envelopes: list[Envelope]) -> Iterator[tuple[str, list[Any]]]:
    """The jobs of ``envelopes`` without parents, by queue (one script touches one queue's
    keys), in order: (queue, the id, body, priority and due of each) for each script call of at
    most ``DRAIN_BATCH`` jobs and about ``STORE_BYTES`` of messages."""
    by_queue: dict[str, list[Envelope]] = {}
    for envelope in envelopes:
        if not envelope.parents:
            by_queue.setdefault(envelope.queue, []).append(envelope)
    for queue, some in by_queue.items():
        args: list[Any] = []
        size = 0
        for envelope in some:
            stored = _stored(envelope)
            args += stored
            size += len(stored[1])
            if len(args) == 4 * DRAIN_BATCH or size >= STORE_BYTES:
                yield queue, args
                args, size = [], 0
        if args:
            yield queue, args


def _priority(envelope: Envelope) -> int:
    """The job's priority, clamped to what a waiting score keeps exact."""
    return max(-PRIORITY_LIMIT, min(PRIORITY_LIMIT, envelope.priority))


def _parents(envelope: Envelope) -> list[str]:
    """The ids of the jobs ``envelope`` waits for (none repeated)."""
    return list(dict.fromkeys(envelope.parents))


def lex_range(job_id: str) -> tuple[str, str]:
    """The ZRANGEBYLEX bounds of the members of a dependents or edges zset that start with
    ``job_id`` and ``SEP``: that job's edges (common.lua's ``lex_from`` and ``lex_to``)."""
    return f"[{job_id}{SEP}", f"({job_id}\x01"


def _reason(parent: str, outcome: str) -> str:
    """The last error of a dependent settled because of its parent's ``outcome``."""
    return (ParentCancelled if outcome == "cancelled" else ParentFailed).describe(parent)


def _parents_done(leases: list[Lease], flags: list[int]) -> list[Lease]:
    """The leases a batch ack settled while jobs depend on them (flag 2)."""
    return [lease for lease, flag in zip(leases, flags, strict=True) if flag == HAS_DEPENDENTS]


def _acks(leases: list[Lease]) -> str:
    """The [id, owner] pairs a batch ack script fences on, as JSON."""
    return json.dumps([[lease.token, lease.owner_token] for lease in leases], ensure_ascii=False)


def _requeue_args(requeue: Requeue) -> tuple[str, str, bytes, int, str]:
    """What a requeue script takes of a failed run: id, owner, the body it goes back with (one
    more run counted, due then), the due time (ms) and its error."""
    lease = requeue.lease
    env = lease.envelope
    assert env is not None, "only a decoded message can be requeued"
    again = env.next_attempt() if requeue.count_run else replace(env)
    due = _ms(requeue.due)  # a due time already past is ready now
    again.available_at = _from_ms(due)
    # A lone surrogate (a file name Python escaped) would make the whole batch unsendable.
    return lease.token, lease.owner_token, again.to_bytes(), due, requeue.error.encode(errors="replace").decode()


def _requeues(requeues: Sequence[Requeue]) -> str:
    """The requeues a batch script makes, as JSON: [[id, owner, body, due ms, error], ...]."""
    return json.dumps(
        [[*args[:2], args[2].decode(), *args[3:]] for args in map(_requeue_args, requeues)], ensure_ascii=False
    )


def _requeued(reply: Any) -> Requeued:
    """A requeue script's reply: 1 requeued, 0 lost, else who asked to abort the job."""
    return reply == 1 if isinstance(reply, int) else _text(reply)


def _lost(leases: list[Lease], acked: list[int]) -> list[Lease]:
    """The leases a batch ack found no longer held (flag 0), in order."""
    return [lease for lease, ok in zip(leases, acked, strict=True) if not ok]
