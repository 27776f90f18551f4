"""Rate and concurrency limits on the Redis backend (``redis_limits.py``, ``lua/limit_*.lua``,
``lua/wake.lua``), against a real Redis server: the protocol driven by hand, the scripts fed
fixed times, and the Lua rate rule checked against :func:`django_jobs.limits.rate_slot`.

tests/integration/test_limits.py runs the backend-neutral cases on Redis too; these are the
cases that read Redis's own keys, or need more than one limit key or a moved lease deadline.
Every key lives under this session's prefix, which the ``redis_up`` fixture clears.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_jobs import conf, dashboard, limits
from django_jobs.backends.base import Hold, Lease, LimitUsage
from django_jobs.backends.redis import RedisBackend
from django_jobs.backends.redis_limits import LimitKeys
from django_jobs.limits import RESERVATION_GRACE, Limit, rate_slot, reservation_state
from tests.testapp.jobs import scripted

pytestmark = pytest.mark.django_db

HANDLER_KEY = "handler:tests.testapp.jobs.scripted"
QUEUE_KEY = "queue:default"


@pytest.fixture
def backend(redis_topology_backend: RedisBackend) -> RedisBackend:
    """On a single Redis, then on the Redis Cluster."""
    return redis_topology_backend


class Clock:
    """The limits' clock, moved by hand."""

    def __init__(self, start: float) -> None:
        self.time = start

    def __call__(self) -> float:
        return self.time


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fixed = Clock(float(int(time.time())))
    monkeypatch.setattr(limits, "now", fixed)
    return fixed


def leases(backend: RedisBackend, count: int, queue: str = "default") -> list[Lease]:
    """``count`` jobs enqueued on ``queue``, then leased, in order."""
    for _ in range(count):
        backend.enqueue(scripted.using(queue=queue).builder(action="ok", key=None).build())
    found = [backend.fetch(queue) for _ in range(count)]
    assert all(lease is not None for lease in found)
    return [lease for lease in found if lease is not None]


def parked_hold() -> Hold:
    return Hold(float(conf.get("LEASE_TIMEOUT")), QUEUE_KEY, parked=True)


def defer(backend: RedisBackend, lease: Lease, hold: Hold) -> None:
    """What the worker does with a hold: requeue without a run, then (parked) look for room."""
    backend.nack(lease, hold.delay, count_run=False)
    if hold.parked:
        backend.release_limits(lease)


def finish(backend: RedisBackend, lease: Lease) -> None:
    backend.ack(lease)
    backend.release_limits(lease)


def member(lease: Lease) -> bytes:
    return f"{lease.token}|{lease.owner_token}".encode()


def slots(backend: RedisBackend, key: str = QUEUE_KEY) -> dict[bytes, float]:
    return dict(backend.client.zrange(LimitKeys.of(backend.prefix, key).slots, 0, -1, withscores=True))


def parked_ids(backend: RedisBackend, key: str = QUEUE_KEY) -> list[str]:
    return [json.loads(m)[1] for m in backend.client.zrange(LimitKeys.of(backend.prefix, key).parked, 0, -1)]


def waiting_ids(backend: RedisBackend, queue: str = "default") -> set[str]:
    return {m.decode() for m in backend.client.zrange(backend.keys(queue).waiting, 0, -1)}


def delayed_ids(backend: RedisBackend, queue: str = "default") -> set[str]:
    return {m.decode() for m in backend.client.zrange(backend.keys(queue).delayed, 0, -1)}


# -- concurrency ---------------------------------------------------------------------------------


def test_slots_are_scored_by_lease_deadline_and_a_release_wakes_the_oldest_parked_job(backend, clock):
    """The clock stands still: c and d are parked in the same millisecond, in that order."""
    limit = Limit(QUEUE_KEY, concurrency=2)
    a, b, c, d = leases(backend, 4)
    assert backend.acquire(a, [limit]) is None
    assert backend.acquire(b, [limit]) is None
    for waiting in (c, d):
        hold = backend.acquire(waiting, [limit])
        assert hold == parked_hold()
        defer(backend, waiting, hold)

    assert slots(backend) == {member(a): a.expires_at.timestamp() * 1000, member(b): b.expires_at.timestamp() * 1000}
    assert parked_ids(backend) == [c.token, d.token]
    assert delayed_ids(backend) == {c.token, d.token}

    finish(backend, a)

    assert waiting_ids(backend) == {c.token}
    assert delayed_ids(backend) == {d.token}
    assert parked_ids(backend) == [d.token]
    assert backend.limit_usage(limit) == LimitUsage(running=1, starts=0, reserved=0, parked=1)


def test_a_release_skips_a_parked_job_still_leased_which_wakes_itself_once_requeued(backend):
    limit = Limit(QUEUE_KEY, concurrency=1)
    holder, early, later = leases(backend, 3)
    assert backend.acquire(holder, [limit]) is None
    early_hold = backend.acquire(early, [limit])  # parked first, but still on its way back
    assert early_hold is not None
    later_hold = backend.acquire(later, [limit])
    assert later_hold is not None
    defer(backend, later, later_hold)

    finish(backend, holder)

    assert waiting_ids(backend) == {later.token}
    assert parked_ids(backend) == [early.token]  # kept: it looks for room itself
    defer(backend, early, early_hold)  # room: `later` has not started yet
    assert waiting_ids(backend) == {later.token, early.token}
    assert parked_ids(backend) == []


def test_a_parked_job_gone_from_its_queue_is_forgotten_and_the_next_one_woken(backend):
    limit = Limit(QUEUE_KEY, concurrency=1)
    holder, gone, next_one = leases(backend, 3)
    assert backend.acquire(holder, [limit]) is None
    for waiting in (gone, next_one):
        hold = backend.acquire(waiting, [limit])
        assert hold is not None
        defer(backend, waiting, hold)
    assert backend.request_abort(gone.token, "test") == "cancelled"

    finish(backend, holder)

    assert waiting_ids(backend) == {next_one.token}
    assert parked_ids(backend) == []


def test_a_slot_past_its_lease_deadline_no_longer_counts(backend):
    limit = Limit(QUEUE_KEY, concurrency=1)
    stalled, other = leases(backend, 2)
    assert backend.acquire(stalled, [limit]) is None
    assert backend.acquire(other, [limit]) is not None
    backend.client.zadd(LimitKeys.of(backend.prefix, QUEUE_KEY).slots, {member(stalled): time.time() * 1000 - 1})

    assert backend.acquire(other, [limit]) is None

    assert slots(backend) == {member(other): other.expires_at.timestamp() * 1000}


def test_the_heartbeat_moves_the_slots_of_a_limited_lease_and_nothing_for_others(backend, monkeypatch):
    limit = Limit(QUEUE_KEY, concurrency=1)
    limited, unlimited = leases(backend, 2)
    assert backend.acquire(limited, [limit]) is None
    before = limited.expires_at

    backend.extend(limited, 600)

    assert limited.expires_at > before
    assert slots(backend) == {member(limited): limited.expires_at.timestamp() * 1000}
    pipelines: list[object] = []
    real = backend.client.pipeline
    monkeypatch.setattr(backend.client, "pipeline", lambda *a, **k: pipelines.append(1) or real(*a, **k))
    backend.extend(unlimited, 600)
    assert pipelines == []  # one script call, as before limits existed


def test_the_reaper_frees_the_slots_of_a_lease_it_recovers(backend, settings):
    settings.JOBS = {**settings.JOBS, "LIMITS": {QUEUE_KEY: {"concurrency": 1}}}
    [limit] = limits.limits_for("tests.testapp.jobs.scripted", "default")
    crashed, other = leases(backend, 2)
    assert backend.acquire(crashed, [limit]) is None
    backend.lose_claims("default", crashed.owner_token, [crashed.token])  # its supervisor saw it die

    assert backend.reap_expired("default") == 1

    assert slots(backend) == {}
    assert backend.acquire(other, [limit]) is None


# -- the rate rule, with fixed times -------------------------------------------------------------


def lua_acquire(backend: RedisBackend, now: int, job: str, count: int, period: int, owner: str = "o") -> list[Any]:
    """limit_acquire.lua at ``now`` (ms) under ``count`` starts per ``period`` ms:
    [status, member, kind, start]."""
    args = (now, f"{job}|{owner}", job, now + 60_000, 0, count, period, round(RESERVATION_GRACE * 1000), f"[{job}]")
    reply = backend.run_script("limit_acquire", LimitKeys.of(backend.prefix, QUEUE_KEY), args)
    return [reply[0], reply[1].decode(), reply[2].decode(), reply[3]]


def test_the_window_grants_its_starts_then_reserves_the_next_free_ones(backend):
    T = 1_000_000_000_000  # ms
    assert lua_acquire(backend, T, "a", 3, 1000) == [1, "a|o", "fresh", 0]
    assert lua_acquire(backend, T + 100, "b", 3, 1000) == [1, "b|o", "fresh", 0]
    assert lua_acquire(backend, T + 200, "c", 3, 1000) == [1, "c|o", "fresh", 0]
    assert lua_acquire(backend, T + 300, "d", 3, 1000) == [2, "d|o", "reserved", T + 1000]  # a + period
    assert lua_acquire(backend, T + 400, "e", 3, 1000) == [2, "e|o", "reserved", T + 1100]  # b + period
    assert lua_acquire(backend, T + 500, "d", 3, 1000) == [2, "d|o", "early", T + 1000]  # the same one
    assert lua_acquire(backend, T + 1000, "f", 3, 1000) == [2, "f|o", "reserved", T + 1200]  # d's is taken
    assert lua_acquire(backend, T + 1000, "d", 3, 1000) == [1, "d|o", "due", 0]
    assert lua_acquire(backend, T + 3500, "g", 3, 1000) == [1, "g|o", "fresh", 0]  # all slid out
    window = LimitKeys.of(backend.prefix, QUEUE_KEY).window
    assert backend.client.zrange(window, 0, -1) == [b"g|o"]
    assert backend.client.hgetall(LimitKeys.of(backend.prefix, QUEUE_KEY).reserved) == {}


def test_a_reservation_is_honoured_up_to_the_grace_then_lapses(backend):
    T, grace = 1_000_000_000_000, round(RESERVATION_GRACE * 1000)
    lua_acquire(backend, T, "a", 1, 60_000)
    assert lua_acquire(backend, T, "late", 1, 60_000)[3] == T + 60_000
    assert lua_acquire(backend, T, "on-time", 1, 60_000)[3] == T + 120_000

    assert lua_acquire(backend, T + 60_000 + grace + 1, "late", 1, 60_000) == [2, "late|o", "reserved", T + 180_000]
    assert lua_acquire(backend, T + 120_000 + grace, "on-time", 1, 60_000) == [1, "on-time|o", "due", 0]


# The Lua rule and the pure one see the same starts at the same clock. Times are quarter seconds,
# exact in binary floating point, so the seconds the pure functions take compare exactly too.
steps = st.lists(st.tuples(st.integers(0, 12), st.integers(0, 4)), min_size=1, max_size=25)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(count=st.integers(1, 4), quarters=st.integers(1, 30), steps=steps)
def test_the_lua_rate_rule_gives_what_the_pure_one_gives(backend, count, quarters, steps):
    period, T = quarters * 250, 1_000_000_000_000
    backend.client.delete(*LimitKeys.of(backend.prefix, QUEUE_KEY))
    starts: dict[str, int] = {}  # window member -> start (ms), granted or reserved
    reserved: dict[str, str] = {}  # job -> its reserved member
    now = T
    for step, (gap, job_number) in enumerate(steps):
        now += gap * 250
        job, owner = f"job{job_number}", str(step)
        # What the pure rule says: starts at or before now - period no longer matter, for the
        # rate and for a reservation among them (the backends drop them before they look).
        starts = {m: at for m, at in starts.items() if at > now - period}
        reserved = {j: m for j, m in reserved.items() if m in starts}
        own = reserved.get(job)
        state = reservation_state(starts[own] / 1000, now / 1000, period / 1000) if own else None
        if own and state == "early":
            expected = [2, own, "early", starts[own]]
        elif own and state == "due":
            del reserved[job]
            expected = [1, own, "due", 0]
        else:
            if own:  # lapsed
                del starts[reserved.pop(job)]
            start = round(rate_slot([at / 1000 for at in starts.values()], now / 1000, count, period / 1000) * 1000)
            starts[f"{job}|{owner}"] = start
            if start > now:
                reserved[job] = f"{job}|{owner}"
                expected = [2, f"{job}|{owner}", "reserved", start]
            else:
                expected = [1, f"{job}|{owner}", "fresh", 0]

        assert lua_acquire(backend, now, job, count, period, owner) == expected, (step, now - T)


# -- more than one limit: all or nothing ---------------------------------------------------------


def test_a_slot_taken_under_one_limit_is_given_back_when_another_is_full(backend):
    handler, queue = Limit(HANDLER_KEY, concurrency=2), Limit(QUEUE_KEY, concurrency=1)
    a, b = leases(backend, 2)
    assert backend.acquire(a, [handler, queue]) is None

    assert backend.acquire(b, [handler, queue]) == parked_hold()

    assert slots(backend, HANDLER_KEY) == {member(a): a.expires_at.timestamp() * 1000}
    assert (parked_ids(backend, HANDLER_KEY), parked_ids(backend, QUEUE_KEY)) == ([], [b.token])


def test_a_slot_given_back_wakes_a_job_parked_on_it_meanwhile(backend):
    handler, queue = Limit(HANDLER_KEY, concurrency=1), Limit(QUEUE_KEY, concurrency=1)
    stalled, parked, holder, refused = leases(backend, 4)
    assert backend.acquire(stalled, [handler]) is None
    hold = backend.acquire(parked, [handler])
    assert hold is not None
    defer(backend, parked, hold)
    assert backend.acquire(holder, [queue]) is None
    # The stalled slot expires unseen; `refused` takes it, then finds the queue limit full.
    backend.client.zadd(LimitKeys.of(backend.prefix, HANDLER_KEY).slots, {member(stalled): 1})

    assert backend.acquire(refused, [handler, queue]) is not None

    assert slots(backend, HANDLER_KEY) == {}
    assert waiting_ids(backend) == {parked.token}


def test_starts_granted_under_one_rate_move_to_the_start_another_rate_allows(backend, clock):
    handler, queue = (
        Limit(HANDLER_KEY, rate_count=2, rate_period=60.0),
        Limit(QUEUE_KEY, rate_count=1, rate_period=60.0),
    )
    a, b = leases(backend, 2)
    assert backend.acquire(a, [handler, queue]) is None
    now = round(clock.time * 1000)

    assert backend.acquire(b, [handler, queue]) == Hold(60.0, QUEUE_KEY, parked=False)

    window = LimitKeys.of(backend.prefix, HANDLER_KEY).window
    assert backend.client.zscore(window, member(b)) == now + 60_000  # reserved then, not now
    assert backend.limit_usage(handler) == LimitUsage(running=0, starts=1, reserved=1, parked=0)
    clock.time += 60
    assert backend.acquire(b, [handler, queue]) is None  # both reservations are due
    assert backend.limit_usage(handler) == LimitUsage(running=0, starts=1, reserved=0, parked=0)


def test_a_lost_lease_takes_nothing_under_any_limit(backend):
    handler, queue = Limit(HANDLER_KEY, concurrency=1, rate_count=5, rate_period=60.0), Limit(QUEUE_KEY, concurrency=1)
    [lease] = leases(backend, 1)
    backend.nack(lease, 0, count_run=False)  # no longer ours

    with pytest.raises(Exception, match="no longer leased"):
        backend.acquire(lease, [handler, queue])

    for limit in (handler, queue):
        assert backend.limit_usage(limit) == LimitUsage(running=0, starts=0, reserved=0, parked=0)


# -- wake.lua, keys ------------------------------------------------------------------------------


def test_wake_readies_a_delayed_job_and_tells_a_leased_or_gone_one(backend):
    delayed, leased = leases(backend, 2)
    backend.nack(delayed, 600, count_run=False)

    assert backend.wake("default", delayed.token) == 1
    assert waiting_ids(backend) == {delayed.token}
    assert backend.wake("default", delayed.token) == 2  # ready already
    assert backend.wake("default", leased.token) == 2
    assert backend.wake("default", "no-such-job") == 0


def test_a_limits_keys_share_one_hash_tag_of_their_own():
    keys = LimitKeys.of("p", "queue:emails")
    assert {key.split("}")[0] for key in keys} == {"p:{limit:queue:emails"}
    assert keys.slots == "p:{limit:queue:emails}:slots"


def test_a_restarted_redis_keeps_the_limits_and_is_given_the_scripts_again(private_redis):
    """A restart (AOF replayed) keeps the slots and the parked jobs; the scripts, which a
    restart forgets, are loaded again by the first batch that finds them missing."""
    backend = RedisBackend("private", {"URL": private_redis.url, "PREFIX": "restart"})
    limit = Limit(QUEUE_KEY, concurrency=1)
    try:
        holder, waiting = leases(backend, 2)
        assert backend.acquire(holder, [limit]) is None

        private_redis.restart()

        hold = backend.acquire(waiting, [limit])
        assert hold == parked_hold()
        defer(backend, waiting, hold)
        finish(backend, holder)
        assert waiting_ids(backend) == {waiting.token}
    finally:
        backend.client.flushall()
        backend.close()


def test_the_dashboard_shows_the_redis_usage_of_each_limit(backend, settings):
    settings.JOBS = {**settings.JOBS, "LIMITS": {QUEUE_KEY: {"concurrency": 3, "rate": "10/m"}}}
    [limit] = limits.limits_for("tests.testapp.jobs.scripted", "default")
    [lease] = leases(backend, 1)
    assert backend.acquire(lease, [limit]) is None

    rows = [row for row in dashboard.limit_rows() if row.backend == "redis"]

    assert rows == [dashboard.LimitRow("redis", limit, LimitUsage(running=1, starts=1, reserved=0, parked=0))]
