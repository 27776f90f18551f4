"""When a batch writes a started run's start: the heartbeat thread's next write is due at most
half an ack interval after the handler's start, so that the start is written within one ack
interval (``BATCH_SECONDS``) even with the write's own time. Checked on the schedule the batch
asks of the heartbeat (a recording stand-in), not on a clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.utils import timezone

from django_jobs.backends.base import Lease
from django_jobs.batches import BATCH_SECONDS, Batches
from django_jobs.metrics import InMemoryMetricsCollector


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


def batches(heartbeat: RecordingHeartbeat) -> Batches:
    def settle(action: Callable[[list[Lease]], list[Lease]], leases: list[Lease]) -> list[Lease]:
        return action(leases)

    return Batches(
        backend=Any,  # type: ignore[arg-type]  # never called here
        heartbeat=heartbeat,  # type: ignore[arg-type]
        metrics=InMemoryMetricsCollector(),
        maximum=10,
        lease_seconds=60,
        settle=settle,
        cancel=lambda lease, who: None,
    )


def test_a_start_brings_the_next_write_within_half_an_ack_interval() -> None:
    heartbeat = RecordingHeartbeat()
    held = batches(heartbeat)
    with held._lock:
        held._watch_later()  # as a claim does: the acks' write, one ack interval away
    assert heartbeat.timer is not None
    claimed_due = heartbeat.timer[0]

    before = time.monotonic()
    held.started(lease("a"))
    assert heartbeat.timer is not None and heartbeat.timer[0] <= before + BATCH_SECONDS / 2 + 1e-3
    assert heartbeat.timer[0] < claimed_due

    sooner = heartbeat.timer[0]
    held.started(lease("b"))  # a start never puts the write off
    assert heartbeat.timer[0] == sooner


def test_a_start_with_no_write_pending_schedules_one() -> None:
    heartbeat = RecordingHeartbeat()
    held = batches(heartbeat)
    before = time.monotonic()
    held.started(lease("a"))
    assert heartbeat.timer is not None and heartbeat.timer[0] <= before + BATCH_SECONDS / 2 + 1e-3


def test_a_run_not_claimed_ahead_or_begun_already_schedules_nothing() -> None:
    heartbeat = RecordingHeartbeat()
    held = batches(heartbeat)
    held.started(lease("alone", ahead=False))
    held.started(lease("begun", must_begin=True))
    assert heartbeat.timer is None and not held._begun
