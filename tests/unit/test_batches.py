"""When a batch writes a started run's start: the heartbeat thread's next write is due at most
half an ack interval after the handler's start, so that the start is written within one ack
interval (``BATCH_SECONDS``) even with the write's own time. Checked on the schedule the batch
asks of the heartbeat (a recording stand-in), not on a clock. And a failed run's requeue: held
for the batch's write, then counted, or settled cancelled if the job was asked to
abort; its attempt row written before the requeue."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from django_jobs import history
from django_jobs.backends.base import Lease, Requeue, Requeued
from django_jobs.batches import BATCH_SECONDS, Batches, Settled
from django_jobs.history import Deferred
from django_jobs.metrics import InMemoryMetricsCollector
from django_jobs.models import AttemptOutcome
from django_jobs.pipeline import Outcome, Verdict


class RecordingHeartbeat:
    """Keeps the one timer ``after`` sets, as the heartbeat thread does."""

    def __init__(self) -> None:
        self.timer: tuple[float, Callable[[], None]] | None = None

    def after(self, moment: float, action: Callable[[], None]) -> None:
        self.timer = (moment, action)

    def cancel(self) -> None:
        self.timer = None


def lease(token: str, *, ahead: bool = True, must_begin: bool = False) -> Lease:
    expires = timezone.now() + timedelta(seconds=60)
    return Lease(
        token=token, owner_token="o" * 32, expires_at=expires, queue="default", ahead=ahead, must_begin=must_begin
    )


def batches(heartbeat: RecordingHeartbeat, backend: Any = Any, outcomes: list[Any] | None = None) -> Batches:
    def settle(action: Callable[[list[Lease]], Settled], leases: list[Lease], pauses: tuple[float, ...]) -> Settled:
        return action(leases)

    seen = [] if outcomes is None else outcomes
    return Batches(
        backend=backend,
        heartbeat=heartbeat,  # type: ignore[arg-type]
        metrics=InMemoryMetricsCollector(),
        maximum=10,
        lease_seconds=60,
        settle=settle,
        cancel=lambda lease, who: None,
        requeued=lambda done: seen.extend(("requeued", lease.token) for lease, _ in done),
        refused=lambda lease, verdict, who: seen.append(("refused", lease.token, who)),
        history=Deferred(),
    )


class SettlingBackend:
    """Writes a batch as ``settle_many`` does: each requeue's outcome comes from ``outcomes``."""

    def __init__(self, outcomes: dict[str, Requeued]) -> None:
        self.outcomes = outcomes
        self.calls: list[tuple[list[str], list[str]]] = []

    def settle_many(self, acks: list[Lease], begun: Any, requeues: list[Requeue]) -> Settled:
        self.calls.append(([lease.token for lease in acks], [requeue.lease.token for requeue in requeues]))
        return [], [self.outcomes[requeue.lease.token] for requeue in requeues]


def test_a_start_brings_the_next_write_within_half_an_ack_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]  # the batches' clock, moved by hand: a thread switched out between reads moves nothing
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    heartbeat = RecordingHeartbeat()
    held = batches(heartbeat)
    with held._lock:
        held._watch_later()  # as a claim does: the acks' write, one ack interval away
    assert heartbeat.timer is not None
    claimed_due = heartbeat.timer[0]
    assert claimed_due == pytest.approx(now[0] + BATCH_SECONDS)

    now[0] += BATCH_SECONDS / 5
    held.started(lease("a"))
    assert heartbeat.timer is not None and heartbeat.timer[0] == pytest.approx(now[0] + BATCH_SECONDS / 2)
    assert heartbeat.timer[0] < claimed_due

    sooner = heartbeat.timer[0]
    now[0] += BATCH_SECONDS / 5
    held.started(lease("b"))  # a start never puts the write off
    assert heartbeat.timer[0] == sooner


class ClaimingBackend:
    """Writes what a claim carries and hands out the next batch: ``batches`` in turn."""

    def __init__(self, *batches: list[Lease]) -> None:
        self.batches = list(batches)
        self.written: list[list[str]] = []

    def settle_many_and_fetch(self, acks: list[Lease], requeues: list[Requeue], queue: str, limit: int) -> Any:
        self.written.append([lease.token for lease in acks])
        return [], [], self.batches.pop(0)


def test_a_claim_that_wrote_the_waiting_acks_lets_the_next_start_set_the_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batches shorter than the ack interval: every ack and start is written with the next
    claim, and the heartbeat thread writes nothing. The write a start scheduled is then not
    kept for the next batch's jobs (each such write is one more statement, from another thread,
    while jobs run): the next start schedules its own, half an interval from itself."""
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    heartbeat = RecordingHeartbeat()
    backend = ClaimingBackend([lease("b")])
    held = batches(heartbeat, backend)
    held.tickets = type("Unlimited", (), {"reserve": lambda *a: 0, "give_back": lambda *a: None})()
    first = lease("a")
    held.started(first)
    assert heartbeat.timer is not None
    first_due = heartbeat.timer[0]
    held.ack_later(first)
    held.ended(first)

    now[0] += BATCH_SECONDS / 5
    held.claim(["default"], False)  # writes the ack of "a", claims "b"
    assert backend.written == [["a"]]
    now[0] += BATCH_SECONDS / 5  # past nothing yet: "b" starts before "a"'s write was due
    next_ = held.take()
    assert next_ is not None
    held.started(next_)
    assert heartbeat.timer is not None and heartbeat.timer[0] == pytest.approx(now[0] + BATCH_SECONDS / 2)
    assert heartbeat.timer[0] > first_due


def test_a_start_with_no_write_pending_schedules_one() -> None:
    heartbeat = RecordingHeartbeat()
    held = batches(heartbeat)
    before = time.monotonic()
    held.started(lease("a"))
    after = time.monotonic()  # the thread may be switched out between the two: bound it by both
    assert heartbeat.timer is not None and before + BATCH_SECONDS / 2 <= heartbeat.timer[0] <= after + BATCH_SECONDS / 2


def test_a_run_not_claimed_ahead_or_begun_already_schedules_nothing() -> None:
    heartbeat = RecordingHeartbeat()
    held = batches(heartbeat)
    held.started(lease("alone", ahead=False))
    held.started(lease("begun", must_begin=True))
    assert heartbeat.timer is None and not held._begun


def failed() -> Verdict:
    return Verdict(Outcome.REQUEUED, "RuntimeError: boom", delay=0.0)


def row(token: str) -> dict[str, Any]:
    return history.attempt_row(token, 1, AttemptOutcome.RETRYING)


class TellingSupervisor:
    """A pool's supervisor as the batch tells it: the failed runs and the successes not written,
    up to ``room`` of each."""

    def __init__(self, room: int = 10) -> None:
        self.room, self.unwritten_runs, self.unacked = room, set(), set()

    def in_hand(self, lease: Lease, running: bool) -> None:
        pass

    def unwritten(self, lease: Lease) -> bool:
        return self._keep(self.unwritten_runs, lease)

    def succeeded(self, lease: Lease) -> bool:
        return self._keep(self.unacked, lease)

    def _keep(self, kept: set[str], lease: Lease) -> bool:
        if len(kept) >= self.room:
            return False
        kept.add(lease.token)
        return True

    def written(self, leases: Any) -> None:
        tokens = {lease.token for lease in leases}
        self.unwritten_runs -= tokens
        self.unacked -= tokens


def test_a_failed_run_is_requeued_with_the_batch_then_counted() -> None:
    heartbeat, outcomes = RecordingHeartbeat(), []
    backend = SettlingBackend({"a": True, "b": False, "c": "admin"})
    held = batches(heartbeat, backend, outcomes)
    assert all(held.requeue_later(lease(token), failed(), row(token)) for token in "abc")
    assert heartbeat.timer is not None  # written within an ack interval
    assert not backend.calls and not outcomes  # nothing written or counted yet
    held.flush()
    assert backend.calls == [([], ["a", "b", "c"])]
    assert outcomes == [("refused", "c", "admin"), ("requeued", "a")]  # "b" was lost: neither
    held.flush()
    assert len(backend.calls) == 1  # written once


def test_a_lease_past_half_its_time_is_requeued_at_once() -> None:
    held = batches(RecordingHeartbeat())
    late = lease("late")
    late.expires_at = timezone.now() + timedelta(seconds=10)
    assert not held.requeue_later(late, failed(), row("late"))
    assert not held._requeues and not held.history


def test_a_failed_run_whose_start_is_not_written_is_requeued_at_once_without_a_supervisor() -> None:
    """Its process could die before the batch's next write (the next job kills it), and nobody
    would count it: its claim ahead goes back uncounted when the reaper finds it."""
    heartbeat = RecordingHeartbeat()
    held = batches(heartbeat)
    quick = lease("quick")
    held.started(quick)
    assert not held.requeue_later(quick, failed(), row("quick"))
    assert not held._requeues and not held.history
    held.ended(quick)
    written = lease("written")
    held.started(written)
    held._begun.clear()  # as the heartbeat's write of its start does
    assert held.requeue_later(written, failed(), row("written"))


def test_a_supervisor_told_of_the_failed_run_lets_it_wait_for_the_batch() -> None:
    """Under a pool, the supervisor counts the failed runs it was told of if the process dies:
    the requeue waits for the batch, and the supervisor forgets it once written. A supervisor
    with no room left: the requeue is written at once."""
    backend = SettlingBackend({"quick": True, "full": True})
    held, supervisor = batches(RecordingHeartbeat(), backend), TellingSupervisor(room=1)
    held.supervisor = supervisor
    quick, full = lease("quick"), lease("full")
    held.started(quick)
    assert held.requeue_later(quick, failed(), row("quick"))
    assert supervisor.unwritten_runs == {"quick"}
    held.started(full)
    assert not held.requeue_later(full, failed(), row("full"))  # no room: written at once
    held.flush()
    assert backend.calls == [([], ["quick"])]
    assert supervisor.unwritten_runs == set()


def test_a_supervisor_told_of_the_success_lets_its_ack_wait_for_the_batch() -> None:
    """Under a pool, the supervisor acks the successes it was told of if the process dies: the
    ack waits for the batch, and the supervisor forgets it once written. A supervisor with no
    room left: the ack is written at once."""
    backend = SettlingBackend({})
    acked_now: list[str] = []
    backend.ack = lambda lease: acked_now.append(lease.token)  # type: ignore[attr-defined]
    held, supervisor = batches(RecordingHeartbeat(), backend), TellingSupervisor(room=1)
    held.supervisor = supervisor
    held.ack_later(lease("quick"))
    assert supervisor.unacked == {"quick"} and not acked_now
    held.ack_later(lease("full"))
    assert acked_now == ["full"]  # no room: written at once
    held.flush()
    assert backend.calls == [(["quick"], [])]
    assert supervisor.unacked == set()


class OrderRecorder:
    """What reaches the database, in order: history rows and the batch's settles."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, list[str]]] = []
        monkeypatch.setattr(history, "record_many", lambda rows, using=None: self.rows(rows))

    def rows(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            self.events.append(("rows", [r["job_id"] for r in rows]))

    def settle_many(self, acks: list[Lease], begun: Any, requeues: list[Requeue]) -> Settled:
        self.events.append(("settle", [requeue.lease.token for requeue in requeues]))
        return [], [True] * len(requeues)

    def settle_many_and_fetch(
        self, acks: list[Lease], requeues: list[Requeue], queue: str, limit: int
    ) -> tuple[list[Lease], list[Requeued], list[Lease]]:
        lost, done = self.settle_many(acks, (), requeues)
        return lost, done, []


@pytest.mark.parametrize("write", ["heartbeat", "claim", "finish"])
def test_the_rows_of_the_requeues_are_written_before_the_settle_makes_the_retries_claimable(
    monkeypatch: pytest.MonkeyPatch, write: str
) -> None:
    """Whichever write takes them (the heartbeat's ``_watch``, the next claim, the run's end),
    the rows a batch keeps (a run's requeued at once among them) go in one statement before the
    settle of its requeues: a retry is never claimable before its row exists."""
    backend, heartbeat = OrderRecorder(monkeypatch), RecordingHeartbeat()
    held = batches(heartbeat, backend)
    held.supervisor = TellingSupervisor()
    held.tickets = type("Unlimited", (), {"reserve": lambda *a: 0, "give_back": lambda *a: None})()
    held.history.later(row("earlier"))  # a run requeued at once: its row kept
    for token in "ab":
        started = lease(token)
        held.started(started)
        assert held.requeue_later(started, failed(), row(token))
    if write == "heartbeat":
        assert heartbeat.timer is not None
        heartbeat.timer[1]()
    elif write == "claim":
        held.claim(["default"], stopping=False)
    else:
        held.finish()
    assert backend.events == [("rows", ["earlier", "a", "b"]), ("settle", ["a", "b"])]


@pytest.mark.django_db
def test_kept_rows_are_written_before_the_rows_written_after_them() -> None:
    """A job's attempts stay in order: the row of its first run, kept for the batch's write,
    goes before the row of its second run written now (a dead letter: not kept)."""
    rows = history.Deferred()
    rows.later(history.attempt_row("job", 1, AttemptOutcome.RETRYING, error="first"))
    rows.write([history.attempt_row("job", 2, AttemptOutcome.FAILED, error="second")])
    assert [(a.attempt, a.outcome, a.error) for a in history.attempts_of("job")] == [
        (1, AttemptOutcome.RETRYING, "first"),
        (2, AttemptOutcome.FAILED, "second"),
    ]
    assert not rows


def test_a_write_of_the_kept_rows_under_way_holds_back_the_settle_of_their_requeues(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The main thread writes a run's row with the rows kept before it (a dead letter's) while
    the heartbeat's ``_watch`` takes the batch's requeues: the requeues wait until the rows are
    written, though the heartbeat finds no row left to write (on SQLite, that ``INSERT`` waits
    for the database's lock; the retry was claimed and run, its row written, before it)."""
    backend, heartbeat = OrderRecorder(monkeypatch), RecordingHeartbeat()
    inserting, release = threading.Event(), threading.Event()

    def slow_rows(rows: list[dict[str, Any]], using: str | None = None) -> None:
        inserting.set()
        release.wait(10)
        backend.rows(rows)

    monkeypatch.setattr(history, "record_many", slow_rows)
    held = batches(heartbeat, backend)
    held.supervisor = TellingSupervisor()
    started = lease("a")
    held.started(started)
    assert held.requeue_later(started, failed(), row("a"))
    main = threading.Thread(target=held.history.write, args=([row("dead")],))
    main.start()
    assert inserting.wait(10)
    assert heartbeat.timer is not None
    beat = threading.Thread(target=heartbeat.timer[1])
    beat.start()
    beat.join(0.2)  # time for the settle to overtake the rows, were it allowed to
    release.set()
    main.join(10)
    beat.join(10)
    assert backend.events == [("rows", ["a", "dead"]), ("settle", ["a"])]


def test_the_next_claim_waits_for_the_heartbeats_write_of_the_batchs_requeues(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The heartbeat's write of a batch's requeues is under way (on SQLite, waiting for the
    database's lock) when the main thread claims the next batch: the claim waits for it. Else
    the worker process tells its supervisor of the new claim while the old claim's failed runs
    are still unwritten, and the supervisor of a process that dies then counts none of them,
    which run again uncounted. (Seen with 3 processes on SQLite and SIGKILLs: 9 jobs of one
    batch, ``max_retries=3``, ran 5 times, their first attempt twice, their leases reaped a
    lease timeout later instead of recovered by the supervisor.)"""
    backend, heartbeat = OrderRecorder(monkeypatch), RecordingHeartbeat()
    writing, release = threading.Event(), threading.Event()
    settle_many = backend.settle_many

    def slow_settle(acks: list[Lease], begun: Any, requeues: list[Requeue]) -> Settled:
        writing.set()
        release.wait(10)
        return settle_many(acks, begun, requeues)

    monkeypatch.setattr(backend, "settle_many", slow_settle)
    monkeypatch.setattr(
        backend, "settle_many_and_fetch", lambda *a: (backend.events.append(("claim", [])), ([], [], []))[1]
    )
    held = batches(heartbeat, backend)
    held.supervisor = TellingSupervisor()
    held.tickets = type("Unlimited", (), {"reserve": lambda *a: 0, "give_back": lambda *a: None})()
    started = lease("a")
    held.started(started)
    assert held.requeue_later(started, failed(), row("a"))
    assert heartbeat.timer is not None
    beat = threading.Thread(target=heartbeat.timer[1])
    beat.start()
    assert writing.wait(10)
    main = threading.Thread(target=held.claim, args=(["default"], False))
    main.start()
    main.join(0.2)  # time for the claim to overtake the write, were it allowed to
    release.set()
    beat.join(10)
    main.join(10)
    assert backend.events == [("rows", ["a"]), ("settle", ["a"]), ("claim", [])]
