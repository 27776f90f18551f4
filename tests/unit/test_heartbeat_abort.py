"""The heartbeat's read of the abort flag between beats (``backend.abort_requested``): with beats
far apart it still passes an abort on within seconds, and a failed read changes nothing but
this thread's connections. The backend is the real ``SyncBackend`` with the flag faked."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from django.utils import timezone

from django_jobs import heartbeat
from django_jobs.backends.base import Lease
from django_jobs.backends.sync import SyncBackend
from django_jobs.heartbeat import Heartbeat
from tests.procs import wait_until

# A beat every 20 minutes: within a test, only the check between beats reads the flag.
LEASE_SECONDS = 3600


class Flagged(SyncBackend):
    """``flag``: who asked to abort (``None``: nobody), or an exception its read raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flag: str | Exception | None = None
        self.reads: list[Lease] = []
        self.extended: list[Lease] = []
        self.resets = 0

    def abort_requested(self, lease: Lease) -> str | None:
        self.reads.append(lease)
        if isinstance(self.flag, Exception):
            raise self.flag
        return self.flag

    def extend(self, lease: Lease, seconds: float) -> None:
        self.extended.append(lease)

    def reset_connection(self) -> None:
        self.resets += 1


@pytest.fixture
def backend() -> Flagged:
    return Flagged("flagged", {})


@pytest.fixture
def beat(backend: Flagged, monkeypatch: pytest.MonkeyPatch) -> Iterator[Heartbeat]:
    monkeypatch.setattr(heartbeat, "ABORT_CHECK", 0.05)  # the tests wait less than a second per read
    beating = Heartbeat(backend, lease_seconds=LEASE_SECONDS)
    beating.start()
    yield beating
    beating.stop()


def leased() -> Lease:
    return Lease(token="job", owner_token="owner", expires_at=timezone.now(), queue="default")


def test_an_abort_asked_between_beats_is_passed_on_within_seconds_and_extends_nothing(backend, beat):
    lease, told = leased(), []
    beat.watch(lease, (), told.append)
    wait_until(lambda: backend.reads, 10, "a first read of the flag")
    assert told == []  # nobody asked yet

    backend.flag = "admin:boss"
    wait_until(lambda: told, 10, "the abort to be passed on")

    assert told == ["admin:boss"]
    assert backend.extended == []  # a read, not a beat: the lease is left as it was
    assert not beat.lost(lease)


def test_a_failed_read_is_quiet_and_leaves_the_lease_and_the_thread_alone(backend, beat, caplog):
    backend.flag = ConnectionError("server restarted")
    lease, told = leased(), []
    with caplog.at_level(logging.DEBUG, logger="django_jobs.worker"):
        beat.watch(lease, (), told.append)
        wait_until(lambda: backend.resets, 10, "the failed read to drop the thread's connections")

    failed = [r.levelno for r in caplog.records if "job job: could not read its abort flag" in r.getMessage()]
    assert failed and set(failed) == {logging.DEBUG}
    assert (told, backend.extended, beat.lost(lease)) == ([], [], False)

    backend.flag = "ops"  # the next read works again
    wait_until(lambda: told, 10, "the abort to be passed on after the failed read")
    assert told == ["ops"]
