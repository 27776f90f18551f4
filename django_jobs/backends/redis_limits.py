"""Rate and concurrency limits on the Redis backend: one Lua script per limit (``limit_*.lua``).

Each limit key has four keys of its own, under one hash tag (``{limit:<key>}``), so a script on
one limit is atomic and Redis Cluster safe: the slots of the running jobs (scored by their
lease deadlines, so a crashed worker's slot frees when its lease expires), the window of starts
granted or reserved (:func:`~django_jobs.limits.rate_slot`), the reservations, and the parked
jobs. A job's limits (a handler's and its queue's) have different hash tags: :meth:`acquire`
asks them all in one pipeline and undoes, limit by limit, what was taken where another refused.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import conf
from .. import limits as clock  # the limits' clock: clock.now()
from ..exceptions import LeaseLost
from ..limits import RESERVATION_GRACE, Limit, limits_for
from .base import Hold, Lease, LimitUsage

if TYPE_CHECKING:
    from .redis import RedisBackend

SCRIPTS = ("limit_acquire", "limit_release")
# How many parked jobs one release looks at for one it can wake.
WAKE_CANDIDATES = 10


class LimitKeys(NamedTuple):
    """The Redis keys of one limit, by kind, in the order ``limit_common.lua`` names them."""

    slots: str  # zset: '<job id>|<owner>' -> lease deadline (ms): the running jobs
    window: str  # zset: '<job id>|<owner>' -> start (ms): starts granted or reserved
    reserved: str  # hash: job id -> its member of the window, reserved for it
    parked: str  # zset: JSON [queue, job id] -> park time (ms): jobs waiting for a slot

    @classmethod
    def of(cls, prefix: str, key: str) -> LimitKeys:
        # The {limit:<key>} hash tag keeps one limit's keys in one Redis Cluster slot.
        return cls(*(f"{prefix}:{{limit:{key}}}:{kind}" for kind in cls._fields))


@dataclass(frozen=True, slots=True)
class Taken:
    """What a lease holds under its limits, kept in ``Lease.raw`` (unused otherwise by Redis)
    from :meth:`RedisLimits.acquire` to :meth:`RedisLimits.release`."""

    slots: tuple[Limit, ...] = ()  # the concurrency limits whose slot it holds
    parked: Limit | None = None  # the limit it is parked on


class _Reply(NamedTuple):
    """What ``limit_acquire.lua`` did under one limit."""

    status: int  # 1 granted, 0 parked, 2 held by the rate until `start`
    member: str  # its start's member of the window ('' without one)
    kind: str  # 'fresh' | 'due' (granted), 'reserved' | 'early' (held), '' (no start)
    start: int  # ms, when held


def _ms(seconds: float) -> int:
    # Rounded, not truncated: two readings of a moved clock differ by exactly what it moved.
    return round(seconds * 1000)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisLimits:
    """The limits of one Redis backend (``RedisBackend`` delegates to it)."""

    def __init__(self, backend: RedisBackend) -> None:
        self.backend = backend

    def keys(self, key: str) -> LimitKeys:
        return LimitKeys.of(self.backend.prefix, key)

    def _batch(self, script: str, calls: Sequence[tuple[Limit, Sequence[Any]]], *reads: Any) -> list[Any]:
        """``script`` under each limit of ``calls``, after ``reads``: one round trip."""
        return self.backend.batch(script, [(self.keys(limit.key), args) for limit, args in calls], *reads)

    # -- acquire --

    def acquire(self, lease: Lease, limits: Sequence[Limit]) -> Hold | None:
        """See :meth:`QueueBackend.acquire`. One round trip when granted: the ownership check
        and every limit's script in one pipeline (an ownership lost meanwhile leaves a slot
        that the reaper frees with the lease). A refusal undoes the grants of the other limits
        in one more round trip; until then they count, which may park or delay another job a
        little early (an undone slot wakes a parked job)."""
        now = _ms(clock.now())
        member, parked = f"{lease.token}|{lease.owner_token}", _parked(lease.queue, lease.token)
        deadline, grace = _ms(lease.expires_at.timestamp()), _ms(RESERVATION_GRACE)
        queue = self.backend.keys(lease.queue)
        owner, leased, *raw = self._batch(
            "limit_acquire",
            [(limit, (now, member, lease.token, deadline, *_caps(limit), grace, parked)) for limit in limits],
            ("hget", queue.owners, lease.token),
            ("zscore", queue.processing, lease.token),
        )
        replies = [_Reply(int(r[0]), _text(r[1]), _text(r[2]), int(r[3])) for r in raw]
        if owner is None or _text(owner) != lease.owner_token or leased is None:
            self._undo(lease, now, limits, replies, keep=None, until=0)
            raise LeaseLost(f"job {lease.token} is no longer leased by this worker")
        full = next((limit for limit, reply in zip(limits, replies, strict=True) if reply.status == 0), None)
        if full is not None:  # concurrency first: it is parked on the first full limit
            self._undo(lease, now, limits, replies, keep=full, until=0)
            lease.raw = Taken(parked=full)
            return Hold(float(conf.get("LEASE_TIMEOUT")), full.key, parked=True)
        held = [(reply.start, limit.key) for limit, reply in zip(limits, replies, strict=True) if reply.status == 2]
        if held:  # the latest start any rate allows, reserved under every rate limit
            when, key = max(held)
            later = self._undo(lease, now, limits, replies, keep=None, until=when)
            when, key = max([(when, key), *later])
            return Hold((when - now) / 1000, key, parked=False)
        lease.raw = Taken(slots=tuple(limit for limit in limits if limit.concurrency is not None))
        return None

    def _undo(
        self, lease: Lease, now: int, limits: Sequence[Limit], replies: list[_Reply], *, keep: Limit | None, until: int
    ) -> list[tuple[int, str]]:
        """Give back what the acquire took under each limit: its slot (waking a parked job in
        its place); its start: dropped or, when the rates hold the job ``until`` a later start,
        reserved then or later; a due reservation it used goes back to it. It stays parked only
        on ``keep``. Returns the (start, key) of starts reserved later than ``until``."""
        member, parked = f"{lease.token}|{lease.owner_token}", _parked(lease.queue, lease.token)
        undone: list[tuple[Limit, Sequence[Any]]] = []
        for limit, reply in zip(limits, replies, strict=True):
            slot = member if reply.status == 1 and limit.concurrency is not None else ""
            unpark = parked if reply.status == 0 and limit is not keep else ""
            action = _give_back(reply, until)
            if slot or unpark or action:
                undone.append((limit, (now, slot, lease.token, unpark, action, reply.member, until, *_caps(limit), 1)))
        if not undone:
            return []
        later = []
        for (limit, _), reply in zip(undone, self._batch("limit_release", undone), strict=True):
            if int(reply[0]) > until:
                later.append((int(reply[0]), limit.key))
            self._wake(limit, reply[1:])
        return later

    # -- release --

    def release(self, lease: Lease) -> None:
        """See :meth:`QueueBackend.release_limits`: free the lease's slots; wake one parked
        job of each of its limits that has room (for a parked job, now back in its queue, of
        the limit it is parked on: perhaps itself)."""
        taken = lease.raw
        if not isinstance(taken, Taken):
            return
        lease.raw = None
        member = f"{lease.token}|{lease.owner_token}"
        freed = [(limit, member) for limit in taken.slots]
        if taken.parked is not None:
            freed.append((taken.parked, ""))
        self._free(freed)

    def reaped(self, job_id: str, owner: str, handler: str, queue: str) -> None:
        """The reaper recovered a lease of ``owner``: its slots free now, not at their deadline
        (a worker seen dead expires its leases at once). Nobody is woken, as on the database
        backend: a parked job comes back by itself when its safety delay ends."""
        member = f"{job_id}|{owner}"
        self._free([(limit, member) for limit in limits_for(handler, queue) if limit.concurrency], wake=False)

    def _free(self, freed: list[tuple[Limit, str]], *, wake: bool = True) -> None:
        if not freed:
            return
        now = _ms(clock.now())
        calls = [(limit, (now, member, "", "", "", "", 0, *_caps(limit), int(wake))) for limit, member in freed]
        for (limit, _), reply in zip(freed, self._batch("limit_release", calls), strict=True):
            self._wake(limit, reply[1:])

    def _wake(self, limit: Limit, candidates: list[bytes]) -> None:
        """Wake the first of ``candidates`` (parked on ``limit``) waiting in its queue: ready
        now. One still leased is on its way back and looks for room itself once requeued; one
        no longer in its queue is forgotten."""
        parked = self.keys(limit.key).parked
        for candidate in candidates:
            queue, job_id = json.loads(candidate)
            woken = self.backend.wake(queue, job_id)
            if woken != 2:
                self.backend.client.zrem(parked, candidate)
            if woken == 1:
                return

    # -- the heartbeat --

    def extend(self, lease: Lease, deadline: int) -> None:
        """The heartbeat pushed the lease's deadline (ms): its slots follow. Nothing for a lease
        holding none: jobs without a concurrency limit pay nothing."""
        taken = lease.raw
        if not isinstance(taken, Taken) or not taken.slots:
            return
        member = f"{lease.token}|{lease.owner_token}"
        pipe = self.backend.client.pipeline(transaction=False)
        for limit in taken.slots:  # XX: a slot given back or expired stays so
            pipe.zadd(self.keys(limit.key).slots, {member: deadline}, xx=True)
        pipe.execute()

    # -- the dashboard --

    def usage(self, limit: Limit) -> LimitUsage:
        """See :meth:`QueueBackend.limit_usage`."""
        now, keys = _ms(clock.now()), self.keys(limit.key)
        period = _ms(limit.rate_period or 0)
        pipe = self.backend.client.pipeline(transaction=False)
        pipe.zcount(keys.slots, f"({now}", "+inf")
        pipe.zcount(keys.window, f"({now - period}", now)
        pipe.zcount(keys.window, f"({now}", "+inf")
        pipe.zcard(keys.parked)
        running, starts, reserved, parked = pipe.execute()
        if limit.rate_count is None:
            starts = reserved = 0
        return LimitUsage(running=running, starts=starts, reserved=reserved, parked=parked)


def _caps(limit: Limit) -> tuple[int, int, int]:
    """(concurrency, starts, period ms) as the scripts take them: 0 where there is no cap."""
    return limit.concurrency or 0, limit.rate_count or 0, _ms(limit.rate_period or 0)


def _parked(queue: str, job_id: str) -> str:
    """A job's member of a parked set."""
    return json.dumps([queue, job_id], ensure_ascii=False)


def _give_back(reply: _Reply, until: int) -> str:
    """What becomes of the start an acquire took or reserved under one limit when the job is
    refused anyway (``limit_release.lua``'s action). A due reservation goes back to its job,
    one not yet due stays as it was. Any other start is dropped or, when the rates hold the job
    ``until`` a later start, reserved then (or later, if that limit's window has filled since)."""
    if reply.kind == "due":
        return "restore"
    if reply.kind not in ("fresh", "reserved"):
        return ""
    if not until:
        return "drop"
    return "defer" if reply.kind == "fresh" or reply.start < until else ""
