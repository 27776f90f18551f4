"""The beanstalkd backend (greenstalk): one tube per queue, on beanstalkd's own mechanisms.

A lease is a reservation: TTR is the lease timeout and the heartbeat ``touch``es it, so a dead
worker's job returns to its tube natively and ``reap_expired`` has nothing to do. Such a lost
delivery shows in the job's ``reserves`` count, which ``fetch`` adds to ``attempts``. Failures
are ``bury``-ed (beanstalkd's dead letter) and recorded as failed ``Job`` rows.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from .. import conf
from ..audit import record_failure
from ..envelope import Envelope
from ..exceptions import LeaseLost
from . import require
from .base import Lease, QueueBackend, decode_lease_body

greenstalk = require("greenstalk", "beanstalk")

# beanstalkd: 0 is the most urgent of 2**32 priorities; django-jobs: higher runs sooner.
PRIORITY_ZERO = 2**31


@dataclass
class _Tube:
    """One connection per queue: only the connection that reserved a job may touch, delete or
    bury it, so the heartbeat thread shares it under the lock."""

    client: Any
    lock: threading.Lock
    stash: Any = None  # a job reserved by wait_for_work, handed out by the next fetch


class BeanstalkBackend(QueueBackend):
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

    def tube_name(self, queue: str) -> str:
        return f"{self.prefix}.{queue}"

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
        with self._lock:
            for tube in self._tubes.values():
                try:
                    tube.client.close()
                except OSError:
                    pass
            self._tubes.clear()

    @staticmethod
    def _ttr() -> int:
        return max(1, math.ceil(conf.get("LEASE_TIMEOUT")))

    def _put(self, tube: _Tube, envelope: Envelope, delay: float) -> int:
        priority = PRIORITY_ZERO - max(-PRIORITY_ZERO, min(PRIORITY_ZERO - 1, envelope.priority))
        return tube.client.put(envelope.to_bytes(), priority=priority, delay=math.ceil(max(delay, 0)), ttr=self._ttr())

    # -- protocol --

    def enqueue(self, envelope: Envelope) -> str:
        delay = (envelope.available_at - timezone.now()).total_seconds() if envelope.available_at else 0
        tube = self._tube(envelope.queue)
        with tube.lock:
            self._put(tube, envelope, delay)
        return envelope.id

    def fetch(self, queue: str) -> Lease | None:
        tube = self._tube(queue)
        with tube.lock:
            job, tube.stash = tube.stash, None
            if job is None:
                try:
                    job = tube.client.reserve(timeout=0)
                except greenstalk.TimedOutError:
                    return None
            reserves = tube.client.stats_job(job)["reserves"]
        # The reservation itself fences: only this connection can settle the job.
        lease = Lease(token=str(job.id), owner_token=str(job.id), expires_at=self._expiry(), queue=queue, raw=job)
        lease.envelope, lease.error = decode_lease_body(job.body)
        if lease.envelope is not None:
            lease.token = lease.envelope.id
            # Earlier reservations of this very job ended without a settle: lost runs.
            lease.envelope.attempts += reserves - 1
        return lease

    def _expiry(self) -> datetime:
        return timezone.now() + timedelta(seconds=self._ttr())

    def _settle(self, lease: Lease, command: str) -> None:
        tube = self._tube(lease.queue)
        with tube.lock:
            try:
                getattr(tube.client, command)(lease.raw)
            except greenstalk.NotFoundError as exc:
                raise LeaseLost(f"job {lease.token} is no longer reserved by this worker") from exc

    def ack(self, lease: Lease, *, count_run: bool = True) -> None:
        self._settle(lease, "delete")

    def nack(self, lease: Lease, delay: float, *, error: str = "", count_run: bool = True) -> None:
        # release cannot change the body: touch (still ours?), put a fresh copy, then delete the
        # original. A crash in between duplicates the job; it never loses it.
        env = lease.envelope
        assert env is not None, "only a decoded message can be requeued"
        self._settle(lease, "touch")
        tube = self._tube(lease.queue)
        with tube.lock:
            self._put(tube, env.next_attempt() if count_run else env, delay)
        self._settle(lease, "delete")

    def abandon(self, lease: Lease, error: str, *, count_run: bool = True) -> None:
        self._settle(lease, "bury")
        if lease.envelope is not None:
            record_failure(lease.envelope, error, self.name, lease.envelope.attempts + int(count_run))

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
        tube = self._tube(queues[0])
        with tube.lock:
            if tube.stash is None:
                try:
                    tube.stash = tube.client.reserve(timeout=int(timeout))
                except greenstalk.TimedOutError:
                    pass
        return True

    def _tube_stats(self, queue: str) -> dict[str, Any]:
        tube = self._tube(queue)
        with tube.lock:
            try:
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

    def purge_failed(self, queue: str, older_than: timedelta | None = None) -> int:
        """Delete buried jobs (beanstalkd keeps no bury time, so ``older_than`` is ignored)."""
        tube = self._tube(queue)
        deleted = 0
        with tube.lock:
            while True:
                try:
                    tube.client.delete(tube.client.peek_buried())
                except greenstalk.NotFoundError:
                    return deleted
                deleted += 1
