"""The beanstalkd backend (greenstalk): one tube per queue, on beanstalkd's own mechanisms.

A lease is a reservation: TTR is the lease timeout and the heartbeat ``touch``es it, so a dead
worker's job returns to its tube natively and ``reap_expired`` has nothing to do. Such a lost
delivery shows in the job's ``reserves`` count, which ``fetch`` adds to ``attempts``. Failures
are ``bury``-ed (beanstalkd's dead letter) and recorded as failed ``Job`` rows.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.utils import timezone

from .. import conf
from ..envelope import Envelope
from ..exceptions import LeaseLost
from ..reaper import LOST_RUN_BATCH, settle_lost_runs
from . import require
from .base import Lease, RequeueByCopy, decode_lease_body

if TYPE_CHECKING:
    from greenstalk import Client, Job

greenstalk = require("greenstalk", "beanstalk")

# beanstalkd: 0 is the most urgent of 2**32 priorities; django-jobs: higher runs sooner.
PRIORITY_ZERO = 2**31


@dataclass
class _Tube:
    """One connection per queue: only the connection that reserved a job may touch, delete or
    bury it, so the heartbeat thread shares it under the lock."""

    client: Client[bytes]
    lock: threading.Lock
    stash: Job[bytes] | None = None  # a job reserved by wait_for_work, handed out by the next fetch


class BeanstalkBackend(RequeueByCopy):
    """Options: ``HOST`` (default 127.0.0.1), ``PORT`` (11300), ``PREFIX`` (tube name prefix)."""

    supports_priority = True
    native_lease = True
    native_dead_letter = True

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        super().__init__(name, options)
        self.address = (options.get("HOST", "127.0.0.1"), int(options.get("PORT", 11300)))
        self.prefix = options.get("PREFIX", "django_jobs")
        self._tubes: dict[str, _Tube] = {}
        self._lock = threading.Lock()

    def where(self) -> str:
        host, port = self.address
        return f"backend {self.name!r} (beanstalkd at {host}:{port})"

    def tube_name(self, queue: str) -> str:
        return f"{self.prefix}.{queue}"

    @contextmanager
    def _using(self, queue: str) -> Iterator[_Tube]:
        """The queue's connection, under its lock. Any error but NotFound/TimedOut drops it: a
        refused put leaves unread bytes on the socket, and a restarted server a dead one. The
        next call connects afresh."""
        tube = self._tube(queue)
        with tube.lock:
            try:
                yield tube
            except (greenstalk.NotFoundError, greenstalk.TimedOutError):
                raise
            except Exception:
                self._drop(queue, tube)
                raise

    def _drop(self, queue: str, tube: _Tube) -> None:
        with self._lock:
            if self._tubes.get(queue) is tube:
                del self._tubes[queue]
        try:
            tube.client.close()
        except OSError:
            pass

    def _tube(self, queue: str) -> _Tube:
        tube = self._tubes.get(queue)
        if tube is None:
            with self._lock:
                tube = self._tubes.get(queue)
                if tube is None:
                    name = self.tube_name(queue)
                    client = greenstalk.Client(self.address, encoding=None, use=name, watch=name)
                    tube = self._tubes[queue] = _Tube(client, threading.Lock())
        return tube

    def close(self) -> None:
        for queue, tube in list(self._tubes.items()):
            with tube.lock:
                if tube.stash is not None:
                    # Hand back a job reserved by wait_for_work but never fetched, so it is not
                    # counted as a lost run (fetch subtracts releases from reserves).
                    with contextlib.suppress(Exception):  # closing anyway; beanstalkd releases on disconnect
                        tube.client.release(tube.stash)
                    tube.stash = None
            self._drop(queue, tube)

    @staticmethod
    def _ttr() -> int:
        lease_timeout: float = conf.get("LEASE_TIMEOUT")
        return max(1, math.ceil(lease_timeout))

    def _put(self, tube: _Tube, envelope: Envelope, delay: float) -> int:
        priority = PRIORITY_ZERO - max(1 - PRIORITY_ZERO, min(PRIORITY_ZERO - 1, envelope.priority))
        return tube.client.put(envelope.to_bytes(), priority=priority, delay=math.ceil(max(delay, 0)), ttr=self._ttr())

    # -- protocol --

    def enqueue(self, envelope: Envelope) -> str:
        delay = (envelope.available_at - timezone.now()).total_seconds() if envelope.available_at else 0
        with self._using(envelope.queue) as tube:
            self._put(tube, envelope, delay)
        return envelope.id

    def fetch(self, queue: str) -> Lease | None:
        for _ in range(LOST_RUN_BATCH):
            with self._using(queue) as tube:
                job, tube.stash = tube.stash, None
                if job is None:
                    try:
                        job = tube.client.reserve(timeout=0)
                    except greenstalk.TimedOutError:
                        return None
                stats = tube.client.stats_job(job)
            # The reservation itself fences: only this connection can settle the job.
            lease = Lease(token=str(job.id), owner_token=str(job.id), expires_at=self._expiry(), queue=queue, raw=job)
            lease.envelope, lease.error = decode_lease_body(job.body)
            # Earlier reservations of this very job that ended without a settle (TTR ran out, or
            # the worker's connection died) are lost runs. Our own releases are not: the worker
            # never releases a job it ran (nack puts a copy), only one it never handed out.
            lost = stats["reserves"] - 1 - stats["releases"]
            if lease.envelope is not None:
                lease.token = lease.envelope.id
                lease.envelope.attempts += lost
            if not settle_lost_runs(self, lease, lost, f"beanstalkd handed it out {lost} time(s) without a settle"):
                return lease
        return None

    def _expiry(self) -> datetime:
        now: datetime = timezone.now()
        return now + timedelta(seconds=self._ttr())

    def _settle(self, lease: Lease, command: str) -> None:
        try:
            with self._using(lease.queue) as tube:
                getattr(tube.client, command)(lease.raw)
        except greenstalk.NotFoundError as exc:
            raise LeaseLost(f"job {lease.token} is no longer reserved by this worker") from exc

    def ack(self, lease: Lease, *, count_run: bool = True) -> None:
        self._settle(lease, "delete")

    def put_copy(self, queue: str, envelope: Envelope, delay: float) -> None:
        # release cannot change the body: nack puts a fresh copy, then deletes the original.
        with self._using(queue) as tube:
            self._put(tube, envelope, delay)

    def dead_letter(self, lease: Lease, error: str, *, count_run: bool = True) -> None:
        self._settle(lease, "bury")

    def extend(self, lease: Lease, seconds: float) -> None:
        # touch restarts the job's TTR (the lease timeout).
        self._settle(lease, "touch")
        lease.expires_at = self._expiry()

    def reap_expired(self, queue: str | None = None) -> int:
        return 0  # beanstalkd returns a job whose TTR ran out to its tube by itself

    def wait_for_work(self, queues: list[str], timeout: float) -> bool:
        """One queue: block in ``reserve`` and keep the job for the next fetch."""
        if len(queues) != 1 or timeout < 1:
            return False
        with self._using(queues[0]) as tube:
            if tube.stash is None:
                try:
                    tube.stash = tube.client.reserve(timeout=int(timeout))
                except greenstalk.TimedOutError:
                    pass
        return True

    def _tube_stats(self, queue: str) -> Mapping[str, Any]:
        try:
            with self._using(queue) as tube:
                return tube.client.stats_tube(self.tube_name(queue))
        except greenstalk.NotFoundError:
            return {}  # beanstalkd creates a tube on first use

    def size(self, queue: str) -> int:
        counts = self.stats(queue)
        return counts["pending"] + counts["delayed"] + counts["in_progress"]

    def stats(self, queue: str) -> dict[str, int]:
        raw = self._tube_stats(queue)
        return {
            "pending": raw.get("current-jobs-ready", 0),
            "delayed": raw.get("current-jobs-delayed", 0),
            "in_progress": raw.get("current-jobs-reserved", 0),
            "failed": raw.get("current-jobs-buried", 0),
        }

    def oldest_ready_age(self, queue: str) -> float | None:
        """The job ``peek-ready`` shows (the next to be reserved): its ``age`` since it was put,
        less the ``delay`` it waited for, from ``stats-job``. Whole seconds (beanstalkd's)."""
        try:
            with self._using(queue) as tube:
                stats = tube.client.stats_job(tube.client.peek_ready())
        except greenstalk.NotFoundError:  # none ready (or it was reserved in between)
            return None
        return float(max(stats["age"] - stats["delay"], 0))

    def purge_failed(self, queue: str, older_than: timedelta | None = None) -> int:
        """Delete buried jobs, oldest first. beanstalkd keeps no bury time: ``older_than`` is
        compared with the job's age since it was put, and the purge stops at the first younger one."""
        deleted = 0
        with self._using(queue) as tube:
            while True:
                try:
                    job = tube.client.peek_buried()
                    if older_than and tube.client.stats_job(job)["age"] < older_than.total_seconds():
                        return deleted
                    tube.client.delete(job)
                except greenstalk.NotFoundError:
                    return deleted
                deleted += 1
