"""The beanstalkd backend (greenstalk): one tube per queue, on beanstalkd's own mechanisms.

A lease is a reservation: TTR is the lease timeout and the heartbeat ``touch``es it, so a dead
worker's job returns to its tube natively and ``reap_expired`` has nothing to do. Such a lost
delivery shows in the job's ``reserves`` count, which ``fetch`` adds to ``attempts``. Failures
are ``bury``-ed (beanstalkd's dead letter) and recorded as failed ``Job`` rows.

A job is reserved only when it is to run, one at a time, so every lost reservation is a lost
run. The commands of a fetch go out together (beanstalkd answers pipelined commands in order):
the ack of the job before, the ``reserve``, the ``stats-job`` of the job that ``peek-ready``
showed next the time before (normally the one reserved), and a ``peek-ready`` for the next time.
A worker's job thus costs one round trip.
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
    import greenstalk
    from greenstalk import Job
else:
    greenstalk = require("greenstalk", "beanstalk")

# beanstalkd: 0 is the most urgent of 2**32 priorities; django-jobs: higher runs sooner.
PRIORITY_ZERO = 2**31


class _Client(greenstalk.Client[bytes]):
    """greenstalk's client, plus commands written together and their replies read in order
    (greenstalk itself sends one command and waits for its reply)."""

    def send(self, *commands: bytes) -> None:
        self._sock.sendall(b"\r\n".join(commands) + b"\r\n")

    def reply(self, expected: bytes) -> list[bytes] | None:
        """The values of the next reply, ``None`` for ``NOT_FOUND`` or ``TIMED_OUT``; any other
        error raises (and the connection is dropped: replies may be left unread)."""
        try:
            return greenstalk._parse_response(self._reader.readline(), expected)
        except (greenstalk.NotFoundError, greenstalk.TimedOutError):
            return None

    def job_reply(self, expected: bytes) -> Job[bytes] | None:
        """The job of a ``RESERVED`` or ``FOUND`` reply, body read, or ``None``."""
        values = self.reply(expected)
        if values is None:
            return None
        job_id, size = values
        return greenstalk.Job(int(job_id), self._read_chunk(int(size)))

    def counts_reply(self) -> tuple[int, int] | None:
        """``reserves`` and ``releases`` from a ``stats-job`` reply, or ``None``."""
        values = self.reply(b"OK")
        if values is None:
            return None
        stats = self._read_chunk(int(values[0]))
        return _stat(stats, b"reserves"), _stat(stats, b"releases")


def _stat(stats: bytes, name: bytes) -> int:
    start = stats.index(b"\n" + name + b": ") + len(name) + 3
    return int(stats[start : stats.index(b"\n", start)])


@dataclass(slots=True)
class _Reserved:
    """A job reserved on this connection, with its ``reserves`` and ``releases`` once read."""

    job: Job[bytes]
    counts: tuple[int, int] | None = None


@dataclass
class _Tube:
    """One connection per queue: only the connection that reserved a job may touch, delete or
    bury it, so the heartbeat thread shares it under the lock."""

    client: _Client
    lock: threading.Lock
    # A job reserved but not handed out yet (by wait_for_work, or by an ack that found its own
    # lease lost): the next fetch hands it out.
    stash: _Reserved | None = None
    # The job ``peek-ready`` showed next: the next fetch asks for its ``stats-job`` with its
    # ``reserve``, which normally reserves that very job.
    next_id: int | None = None


class BeanstalkBackend(RequeueByCopy):
    """Options: ``HOST`` (default 127.0.0.1), ``PORT`` (11300), ``PREFIX`` (tube name prefix)."""

    supports_priority = True
    native_lease = True
    native_dead_letter = True
    pipelines_ack_fetch = True

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
                    client = _Client(self.address, encoding=None, use=name, watch=name)
                    tube = self._tubes[queue] = _Tube(client, threading.Lock())
        return tube

    def close(self) -> None:
        for queue, tube in list(self._tubes.items()):
            with tube.lock:
                if tube.stash is not None:
                    # Hand back a job reserved but never handed out, so it is not counted as a
                    # lost run (fetch subtracts releases from reserves), at its own priority.
                    job, tube.stash = tube.stash.job, None
                    with contextlib.suppress(Exception):  # closing anyway; beanstalkd releases on disconnect
                        tube.client.release(job, priority=tube.client.stats_job(job)["pri"])
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
                reserved, tube.stash = tube.stash, None
                if reserved is None:
                    _, reserved = self._reserve(tube)
                if reserved is None:
                    return None
                counts = reserved.counts or self._counts(tube, reserved.job)
            if counts is None:
                continue  # deleted since (its reservation had run out): not ours any more
            lease = self._lease(queue, reserved.job, counts)
            if lease is not None:
                return lease
        return None

    def ack_and_fetch(self, lease: Lease, queue: str) -> Lease | None:
        """The ``delete`` goes out with the next fetch's commands: one round trip. When the
        delete finds the lease lost, the job reserved with it waits for the next fetch."""
        if queue != lease.queue:
            return super().ack_and_fetch(lease, queue)
        with self._using(queue) as tube:
            if tube.stash is None:
                deleted, tube.stash = self._reserve(tube, lease.raw)
            else:  # the next job is reserved already
                tube.client.send(b"delete %d" % lease.raw.id)
                deleted = tube.client.reply(b"DELETED") is not None
            reserved = tube.stash is not None
        if not deleted:
            raise LeaseLost(f"job {lease.token} is no longer reserved by this worker")
        return self.fetch(queue) if reserved else None

    def _reserve(self, tube: _Tube, ack: Job[bytes] | None = None) -> tuple[bool, _Reserved | None]:
        """One write: the ``delete`` of ``ack``, a ``reserve`` that does not wait, the
        ``stats-job`` of the job shown next the time before, and a ``peek-ready``. Returns
        whether ``ack`` was deleted, and the job reserved (its counts read when it was the one
        shown, as it normally is: the ``stats-job`` follows the ``reserve``)."""
        client, shown = tube.client, tube.next_id
        commands = [b"reserve-with-timeout 0", b"peek-ready"]
        if shown is not None:
            commands.insert(1, b"stats-job %d" % shown)
        if ack is not None:
            commands.insert(0, b"delete %d" % ack.id)
        client.send(*commands)
        deleted = ack is None or client.reply(b"DELETED") is not None
        job = client.job_reply(b"RESERVED")
        counts = client.counts_reply() if shown is not None else None
        self._shown(tube)
        if job is None:
            return deleted, None
        return deleted, _Reserved(job, counts if job.id == shown else None)

    def _counts(self, tube: _Tube, job: Job[bytes]) -> tuple[int, int] | None:
        """``reserves`` and ``releases`` of a job reserved here (``None``: it is gone), with a
        ``peek-ready`` for the next fetch."""
        tube.client.send(b"stats-job %d" % job.id, b"peek-ready")
        counts = tube.client.counts_reply()
        self._shown(tube)
        return counts

    @staticmethod
    def _shown(tube: _Tube) -> None:
        """Read the reply of a ``peek-ready``: the job the next ``reserve`` should get."""
        upcoming = tube.client.job_reply(b"FOUND")
        tube.next_id = None if upcoming is None else upcoming.id

    def _lease(self, queue: str, job: Job[bytes], counts: tuple[int, int]) -> Lease | None:
        """The lease of a reserved job, or ``None`` when its lost runs settled it."""
        # The reservation itself fences: only this connection can settle the job.
        lease = Lease(token=str(job.id), owner_token=str(job.id), expires_at=self._expiry(), queue=queue, raw=job)
        lease.envelope, lease.error = decode_lease_body(job.body)
        # Earlier reservations of this very job that ended without a settle (TTR ran out, or
        # the worker's connection died) are lost runs. Our own releases are not: the worker
        # never releases a job it ran (nack puts a copy), only one it never handed out.
        reserves, releases = counts
        lost = reserves - 1 - releases
        if lease.envelope is not None:
            lease.token = lease.envelope.id
            lease.envelope.attempts += lost
        if settle_lost_runs(self, lease, lost, f"beanstalkd handed it out {lost} time(s) without a settle"):
            return None
        return lease

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
                    tube.stash = _Reserved(tube.client.reserve(timeout=int(timeout)))
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
