"""Rate and concurrency limits on the database backend's own tables.

Each limit key has a ``LimitState`` row; every grant and release of that limit first takes it
(``SELECT … FOR UPDATE`` on PostgreSQL and MySQL, ordered by key so two workers never wait on
each other; on SQLite the first statement of the transaction is a write, which serialises
writers), so the count it reads cannot change before it writes.

- Concurrency: a ``LimitSlot`` (key, job, owner token) per running job. It counts only while
  the job's row is ``in_progress`` under that owner token, so a crashed worker's slot frees when
  its lease is reaped, with no clean-up needed; leftover rows are deleted when the limit is full.
  A job refused a slot is parked (``LimitWaiter``); a release wakes the oldest parked job that
  waits in its queue (``available_at = now``, and ``NOTIFY`` on PostgreSQL).
- Rate: ``LimitStart`` rows, granted or reserved, per :func:`~django_jobs.limits.rate_slot`
  (read as :func:`~django_jobs.limits.next_start` of the window's N-th latest start).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from django.db import connections, transaction
from django.db.models import Count, Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from .. import conf
from .. import limits as clock  # the limits' clock: clock.now()
from ..exceptions import LeaseLost
from ..limits import Limit, next_start, reservation_state
from ..models import Job, JobStatus, LimitSlot, LimitStart, LimitState, LimitWaiter
from .base import Hold, Lease, LimitUsage


def _epoch(moment: datetime) -> float:
    return moment.timestamp()


def _moment(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


class DatabaseLimits:
    """The limits of one database alias (``DatabaseBackend`` delegates to it)."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    # -- acquire --

    def acquire(self, lease: Lease, limits: Sequence[Limit]) -> Hold | None:
        """See :meth:`QueueBackend.acquire`."""
        now = _moment(clock.now())
        with transaction.atomic(using=self.alias):
            self._record_caps(limits, self._lock([limit.key for limit in limits], now))
            owned = Job.objects.using(self.alias).filter(
                pk=lease.token, owner_token=lease.owner_token, status=JobStatus.IN_PROGRESS
            )
            if not owned.exists():
                raise LeaseLost(f"job {lease.token} is no longer leased by this worker")
            for limit in limits:
                if limit.concurrency is not None and self._running(limit.key, lease.token) >= limit.concurrency:
                    return self._park(lease, limit, now)
            return self._rate(lease, limits, now)

    def _lock(self, keys: Sequence[str], now: datetime) -> dict[str, LimitState]:
        """Take the state rows of ``keys`` (created on first use), in key order."""
        keys = sorted(keys)
        states = LimitState.objects.using(self.alias)
        # A write first: on SQLite it takes the database's write lock for the whole transaction.
        states.bulk_create([LimitState(key=key, updated_at=now) for key in keys], ignore_conflicts=True)
        return {row.key: row for row in states.select_for_update().filter(key__in=keys).order_by("key")}

    def _record_caps(self, limits: Sequence[Limit], current: dict[str, LimitState]) -> None:
        """Keep the caps in force on each state row (a release reads the room from there)."""
        for limit in limits:
            row, caps = current[limit.key], (limit.concurrency, limit.rate_count, limit.rate_period)
            if (row.concurrency, row.rate_count, row.rate_period) != caps:
                LimitState.objects.using(self.alias).filter(key=limit.key).update(
                    concurrency=limit.concurrency, rate_count=limit.rate_count, rate_period=limit.rate_period
                )

    def _valid_slots(self, key: str) -> QuerySet[LimitSlot]:
        """The slots of ``key`` whose job still runs under the lease that took them."""
        live = Job.objects.using(self.alias).filter(
            pk=OuterRef("job_id"), owner_token=OuterRef("owner_token"), status=JobStatus.IN_PROGRESS
        )
        return LimitSlot.objects.using(self.alias).filter(Exists(live), key=key)

    def _running(self, key: str, job_id: str) -> int:
        return int(self._valid_slots(key).exclude(job_id=job_id).count())

    def _park(self, lease: Lease, limit: Limit, now: datetime) -> Hold:
        """Full: the job waits, parked on ``limit``, for a release to wake it. Slots left by
        crashed workers are deleted here (they no longer count: only the rows go)."""
        slots = LimitSlot.objects.using(self.alias).filter(key=limit.key)
        slots.exclude(pk__in=self._valid_slots(limit.key).values("pk")).delete()
        LimitWaiter.objects.using(self.alias).get_or_create(
            key=limit.key, job_id=lease.token, defaults={"parked_at": now}
        )
        return Hold(float(conf.get("LEASE_TIMEOUT")), limit.key, parked=True)

    def _rate(self, lease: Lease, limits: Sequence[Limit], now: datetime) -> Hold | None:
        """Every concurrency limit has room: take a start under each rate limit, or reserve the
        earliest start they all allow, then take the slots."""
        at, job_id = _epoch(now), lease.token
        starts = LimitStart.objects.using(self.alias)
        honoured, fresh, latest = [], [], (at, "")
        for limit in limits:
            if limit.rate_count is None or limit.rate_period is None:
                continue
            period = limit.rate_period
            since = now - timedelta(seconds=period)
            starts.filter(key=limit.key, at__lte=since).delete()  # out of every window that matters now
            own = starts.filter(key=limit.key, job_id=job_id, reserved=True).order_by("at").first()
            state = None if own is None else reservation_state(_epoch(own.at), at, period)
            if own is not None and state == "lapsed":
                own.delete()
            if own is not None and state in ("early", "due"):
                need = max(_epoch(own.at), at)
                honoured.append(own)
            else:
                window = starts.filter(key=limit.key, at__gt=since).order_by("-at").values_list("at", flat=True)
                nth = window[limit.rate_count - 1 : limit.rate_count].first()
                need = next_start(None if nth is None else _epoch(nth), at, period)
                fresh.append(limit)
            latest = max(latest, (need, limit.key))
        when, key = latest
        if when > at:  # not yet: the fresh limits reserve that start; a reservation held is kept
            reserve = _moment(when)
            starts.bulk_create([LimitStart(key=limit.key, at=reserve, job_id=job_id, reserved=True) for limit in fresh])
            return Hold(when - at, key, parked=False)
        starts.filter(pk__in=[own.pk for own in honoured]).update(reserved=False)
        starts.bulk_create([LimitStart(key=limit.key, at=now, job_id=job_id) for limit in fresh])
        held = [limit.key for limit in limits if limit.concurrency is not None]
        slots = LimitSlot.objects.using(self.alias)
        slots.filter(key__in=held, job_id=job_id).delete()  # a slot of an earlier lease of this job
        slots.bulk_create([LimitSlot(key=k, job_id=job_id, owner_token=lease.owner_token, taken_at=now) for k in held])
        LimitWaiter.objects.using(self.alias).filter(job_id=job_id).delete()
        return None

    # -- release --

    def release(self, lease: Lease) -> None:
        """See :meth:`QueueBackend.release_limits`: free the job's slots, then wake one parked
        job of each of its limits (and of the limits it is parked on) that has room."""
        job_id = lease.token
        slots = LimitSlot.objects.using(self.alias).filter(job_id=job_id, owner_token=lease.owner_token)
        waiting = LimitWaiter.objects.using(self.alias).filter(job_id=job_id)
        keys = sorted(set(slots.values_list("key", flat=True)) | set(waiting.values_list("key", flat=True)))
        if not keys:
            return
        now = _moment(clock.now())
        with transaction.atomic(using=self.alias):
            states = self._lock(keys, now)
            slots.delete()
            woken = [key for key in keys if self._has_room(key, states[key].concurrency) and self._wake(key)]
            if woken and connections[self.alias].vendor == "postgresql":
                self._notify()

    def _has_room(self, key: str, concurrency: int | None) -> bool:
        return concurrency is not None and self._valid_slots(key).count() < concurrency

    def _wake(self, key: str) -> bool:
        """Make the oldest parked job of ``key`` that waits in its queue ready now. A parked job
        still in progress is on its way back to the queue: it checks for room itself once
        there. Parked rows of jobs that are gone or finished are deleted on the way."""
        waiters = LimitWaiter.objects.using(self.alias).filter(key=key).order_by("parked_at", "id")
        jobs, now = Job.objects.using(self.alias), timezone.now()  # the queue's clock
        for waiter in waiters[:50]:
            status = jobs.filter(pk=waiter.job_id).values_list("status", flat=True).first()
            if status == JobStatus.IN_PROGRESS:
                continue
            waiter.delete()
            if status == JobStatus.PENDING and jobs.filter(pk=waiter.job_id, status=JobStatus.PENDING).update(
                available_at=now, updated_at=now
            ):
                return True
        return False

    def _notify(self) -> None:
        """Idle PostgreSQL workers wake at the commit, as for a new job."""
        with connections[self.alias].cursor() as cursor:
            cursor.execute("SELECT pg_notify('django_jobs', '')")

    # -- the dashboard --

    def usage(self, limit: Limit) -> LimitUsage:
        """See :meth:`QueueBackend.limit_usage`."""
        now = _moment(clock.now())
        starts = LimitStart.objects.using(self.alias).filter(key=limit.key)
        started = reserved = 0
        if limit.rate_period is not None:
            window = starts.filter(at__gt=now - timedelta(seconds=limit.rate_period))
            counts = window.aggregate(
                started=Count("id", filter=Q(at__lte=now)), reserved=Count("id", filter=Q(at__gt=now))
            )
            started, reserved = counts["started"] or 0, counts["reserved"] or 0
        return LimitUsage(
            running=self._valid_slots(limit.key).count(),
            starts=started,
            reserved=reserved,
            parked=LimitWaiter.objects.using(self.alias).filter(key=limit.key).count(),
        )
