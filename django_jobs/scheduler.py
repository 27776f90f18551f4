"""The scheduler: dispatches the jobs of ``JOBS["SCHEDULE"]`` when they fall due.

Each (entry, tick) is dispatched exactly once however many schedulers run: a scheduler claims a
tick by inserting its ``ScheduleTick`` row, whose (schedule, tick) pair is unique, in the
transaction that dispatches the job; the loser of a race gets an ``IntegrityError`` and moves on.

Which tick is due follows from the entry and its latest scheduled tick (for an entry that never
ran, from when it was first synced): only the latest tick at or before now can be due, so a pass
costs the same after a minute or a month of downtime. ``missed="skip"`` runs that tick only
within :data:`GRACE` of it; ``missed="catch_up_once"`` runs it however late.

Clocks disagree: a scheduler whose clock is ahead claims a tick the others have not reached, and
jumps over the unclaimed ones before it. Such a tick is due on a scheduler whose clock reached
it since that scheduler's previous pass (it was due while this one ran): the schedulers behind
dispatch what the one ahead jumped over, each as its own clock reaches it. A clock stepped back
reaches nothing new until it is past the furthest time it read before.

A database backend's job commits with its claim. A broker's job is pushed when the claim
commits, and ``dispatched_at`` is set once the push returned: a tick claimed but never marked
(its scheduler died between the commit and the push, or the push failed) is dispatched again
after :data:`REDISPATCH_AFTER`, under the same idempotency key, while its entry is enabled. Once
the entry's row is disabled (in the settings, or removed from them) such a tick is abandoned
instead (``abandoned_at``): it is never sent, and enabling the entry again sends none of them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial

from django.db import IntegrityError, connections, router, transaction
from django.db.models import Max, Q, QuerySet
from django.utils import timezone

from . import conf, registry, schedules
from .api import JobBuilder, JobFunction, Jobs
from .backends import get_backend
from .backends.base import QueueBackend, atomic_alias
from .exceptions import DispatchCancelled, HandlerNotAllowed
from .logfields import log_fields
from .metrics import get_collector
from .models import Schedule, ScheduleTick
from .schedules import Entry, ScheduleError

logger = logging.getLogger("django_jobs.scheduler")

# A tick missed by more than this (or 2 poll intervals, if longer) is skipped by missed="skip".
GRACE = timedelta(seconds=60)
# Seconds between passes at most (a pass also runs as soon as the next tick is due).
POLL = 1.0
# How far apart the schedulers' clocks may be (docs/schedules.md, "Clock skew").
MAX_SKEW = timedelta(seconds=60)
# A tick claimed this long ago and still not marked dispatched is dispatched again: its claimer
# had 30 s to push it, read on any clock within MAX_SKEW of the claimer's.
REDISPATCH_AFTER = timedelta(seconds=30) + MAX_SKEW
# The longest wait between passes while they fail (the database is unreachable).
MAX_BACKOFF = 30.0
# How often a scheduler records its passes on its entries' rows (``Schedule.last_pass_at``),
# at most: the admin warns when none has passed for a minute. One update every 15 s, not a pass.
RECORD_PASS = timedelta(seconds=15)


@dataclass(frozen=True)
class Dispatched:
    """A tick that became a job."""

    name: str
    tick: datetime
    job_id: str
    queue: str
    handler: str
    manual: bool = False

    def __str__(self) -> str:
        when = "run now" if self.manual else f"tick {self.tick.isoformat()}"
        return f"{self.name} ({when}): job {self.job_id} {self.handler} queue={self.queue}"


@dataclass(frozen=True)
class _Claims:
    """An entry's claimed scheduled ticks: the latest, and the latest at or before now."""

    latest: datetime | None = None
    by_now: datetime | None = None


def idempotency_key(name: str, tick: datetime) -> str:
    """The key every dispatch of ``name``'s ``tick`` carries, so a tick sent twice runs once."""
    return f"schedule:{name}:{tick.astimezone(UTC).isoformat()}"


def job_builder(entry: Entry, tick: datetime) -> JobBuilder:
    """The job ``entry`` dispatches for ``tick``: its ``@job`` called with its args and kwargs,
    or its ``JOBS["HANDLERS"]`` key with its payload; with its queue, backend and priority."""
    function = registry.registered().get(entry.job)
    if isinstance(function, JobFunction):
        builder = function.builder(*entry.args, **entry.kwargs)
    elif conf.handlers().get(entry.job):
        builder = Jobs.define(entry.job, entry.payload)
    else:
        raise HandlerNotAllowed(f"unknown job {entry.job!r}: register it with @job or JOBS['HANDLERS']")
    builder.options(queue=entry.queue, backend=entry.backend, priority=entry.priority)
    return builder.idempotency_key(idempotency_key(entry.name, tick))


class Scheduler:
    """Dispatches the due ticks of ``entries`` (default: ``JOBS["SCHEDULE"]``).

    ``clock`` gives the current time (aware); ``poll`` is the longest wait between passes of
    :meth:`run`; ``on_dispatch`` is called with each :class:`Dispatched` tick.
    """

    def __init__(
        self,
        entries: Mapping[str, Entry] | None = None,
        *,
        clock: Callable[[], datetime] = timezone.now,
        poll: float = POLL,
        on_dispatch: Callable[[Dispatched], object] | None = None,
    ) -> None:
        registry.autodiscover()  # the @job functions an entry may name
        self.entries = dict(schedules.entries() if entries is None else entries)
        self.clock = clock
        self.poll = poll
        self.grace = max(GRACE, timedelta(seconds=2 * poll))
        self.on_dispatch = on_dispatch
        self.alias: str = router.db_for_write(ScheduleTick)
        self.metrics = get_collector()
        self.dispatched = 0  # ticks this scheduler dispatched
        self._synced = False
        # Entry name -> the furthest time this scheduler's clock read in a pass that handled it.
        self._reached: dict[str, datetime] = {}
        # Entry name -> the tick whose failure was logged: a retry failing again logs at DEBUG.
        self._failing: dict[str, datetime | None] = {}
        self._recorded: datetime | None = None  # when this scheduler last recorded a pass

    # -- the settings, in the database --

    def sync(self, now: datetime | None = None) -> None:
        """Write one ``Schedule`` row per entry; rows of entries no longer in the settings are
        disabled, never deleted (their ticks stay). A new row's ``created_at`` is now: an entry
        runs only for ticks after it was first synced."""
        now = now or self.clock()
        rows = Schedule.objects.using(self.alias)
        for name, entry in self.entries.items():
            values = {
                "definition": entry.as_definition(),
                "description": _fit(entry.describe(), Schedule._meta.get_field("description").max_length),
                "time_zone": entry.timezone,
                "enabled": entry.enabled,
                "in_settings": True,
                "next_run": entry.next_tick(now) if entry.enabled else None,
                "updated_at": now,
            }
            rows.update_or_create(name=name, defaults=values, create_defaults={**values, "created_at": now})
        removed = rows.exclude(name__in=list(self.entries)).filter(Q(enabled=True) | Q(in_settings=True))
        removed.update(enabled=False, in_settings=False, next_run=None, updated_at=now)
        self._synced = True

    # -- one pass --

    def run_pass(self, now: datetime | None = None) -> list[Dispatched]:
        """Dispatch every tick due at ``now`` (default: the clock's time), after the ticks left
        undispatched by a crashed scheduler. One entry's failure is logged, never raised: the
        others still run. Errors of the passes' own queries (the database is down) propagate."""
        now = now or self.clock()
        if not self._synced:
            self.sync(now)
        done = self._redispatch(now)
        enabled = [name for name, entry in self.entries.items() if entry.enabled]
        rows = Schedule.objects.using(self.alias).filter(name__in=enabled, enabled=True)
        ticks = ScheduleTick.objects.using(self.alias).filter(schedule_id__in=enabled, manual=False)
        claimed = ticks.values("schedule_id").annotate(latest=Max("tick"), by_now=Max("tick", filter=Q(tick__lte=now)))
        claims = {row["schedule_id"]: _Claims(row["latest"], row["by_now"]) for row in claimed}
        for row in rows:
            entry = self.entries[row.name]
            tick = None
            try:
                tick = self._due(entry, row.created_at, claims.get(row.name, _Claims()), now)
                if tick is None:
                    self._refresh_next_run(row, entry, now)
                dispatched = None if tick is None else self._dispatch(entry, tick, now)
            except Exception as exc:  # noqa: BLE001 - one entry's failure must not stop the others
                self._failed(entry, tick, exc)
                continue
            self._reached[entry.name] = max(now, self._reached.get(entry.name, now))
            self._failing.pop(entry.name, None)
            if dispatched is not None:
                done.append(dispatched)
        self._record_pass(now)
        return done

    def _record_pass(self, now: datetime) -> None:
        """Write ``now`` as the last pass of this scheduler's entries, ``RECORD_PASS`` after the
        last write (at once if its clock went back)."""
        if self._recorded is not None and timedelta(0) <= now - self._recorded < RECORD_PASS:
            return
        Schedule.objects.using(self.alias).filter(name__in=list(self.entries)).update(last_pass_at=now)
        self._recorded = now

    def _due(self, entry: Entry, created: datetime, claims: _Claims, now: datetime) -> datetime | None:
        """The tick to dispatch now, if any: the latest one at or before ``now``, after the entry
        was ``created`` and, for ``missed="skip"``, within the grace period, when it is later
        than every claimed tick, or when it is unclaimed, a later one is claimed (by a scheduler
        whose clock is ahead) and this scheduler's clock reached it since its previous pass, for
        the first time."""
        tick = entry.previous_tick(now)
        if tick <= created or (entry.missed == "skip" and now - tick > self.grace):
            return None
        if claims.latest is None or tick > claims.latest:
            return tick
        reached = self._reached.get(entry.name)
        unclaimed = claims.by_now is None or claims.by_now < tick
        return tick if unclaimed and reached is not None and reached < tick else None

    def _refresh_next_run(self, row: Schedule, entry: Entry, now: datetime) -> None:
        """Keep ``next_run`` (for people) ahead of now when a tick was skipped."""
        if row.next_run is None or row.next_run <= now:
            Schedule.objects.using(self.alias).filter(name=row.name).update(next_run=entry.next_tick(now))

    def _stranded(self, now: datetime) -> QuerySet[ScheduleTick]:
        """The ticks claimed more than ``REDISPATCH_AFTER`` ago and never marked dispatched
        (their scheduler died before its push, or the push failed), nor abandoned."""
        return ScheduleTick.objects.using(self.alias).filter(
            dispatched_at__isnull=True, abandoned_at__isnull=True, claimed_at__lt=now - REDISPATCH_AFTER
        )

    def _redispatch(self, now: datetime) -> list[Dispatched]:
        """Dispatch the stranded ticks again, those of entries enabled here and in the database;
        abandon those of entries the database shows disabled. Others (an entry another
        scheduler's settings enable, unknown to this one) are left to the schedulers that know them."""
        stranded = self._stranded(now)
        for row in stranded.filter(schedule__enabled=False).order_by("claimed_at"):
            self._abandon(row, now)
        enabled = [name for name, entry in self.entries.items() if entry.enabled]
        done = []
        for row in stranded.filter(schedule_id__in=enabled, schedule__enabled=True).order_by("claimed_at"):
            entry = self.entries[row.schedule_id]
            try:
                dispatched = self._dispatch(entry, row.tick, now, manual=row.manual, stale=row)
            except Exception as exc:  # noqa: BLE001 - one entry's failure must not stop the others
                self._failed(entry, row.tick, exc)
                continue
            if dispatched is not None:
                logger.warning(
                    "schedule %r: tick %s was claimed at %s but never dispatched; dispatched it again",
                    entry.name,
                    row.tick.isoformat(),
                    row.claimed_at.isoformat(),
                    extra=log_fields(dispatched.job_id, dispatched.queue, dispatched.handler, outcome="scheduled"),
                )
                done.append(dispatched)
        return done

    def _abandon(self, row: ScheduleTick, now: datetime) -> None:
        """Mark a stranded tick of a disabled entry abandoned (unless another scheduler took it
        over meanwhile): it is never sent."""
        if self._stranded(now).filter(pk=row.pk).update(abandoned_at=now):
            logger.warning(
                "schedule %r: tick %s was claimed at %s but never dispatched, and the entry is disabled; abandoned it",
                row.schedule_id,
                row.tick.isoformat(),
                row.claimed_at.isoformat(),
                extra=log_fields(row.job_id or None, None, outcome="abandoned"),
            )

    # -- a manual tick --

    def run_now(self, name: str) -> str:
        """Dispatch ``name``'s job now, outside its schedule (the admin's "run now"): a manual
        tick at the current time. Returns the job id; raises what the dispatch raised."""
        entry = self.entries.get(name)
        if entry is None:
            raise ScheduleError(f"no entry {name!r} in JOBS['SCHEDULE']")
        now = self.clock()
        if not self._synced:
            self.sync(now)
        dispatched = self._dispatch(entry, now, now, manual=True)
        if dispatched is None:  # an instant already taken: not expected of a clock
            raise IntegrityError(f"schedule {name!r} already has a tick at {now.isoformat()}")
        return dispatched.job_id

    # -- claim and dispatch --

    def _dispatch(
        self, entry: Entry, tick: datetime, now: datetime, *, manual: bool = False, stale: ScheduleTick | None = None
    ) -> Dispatched | None:
        """Claim ``tick`` (insert its row, or take over the ``stale`` one) and dispatch its job
        in the same transaction. ``None``: another scheduler has it, or a ``job_dispatching``
        receiver cancelled a scheduled tick (which is spent: it is not retried)."""
        builder = job_builder(entry, tick)
        backend = get_backend(builder.backend_name)
        ticks = ScheduleTick.objects.using(self.alias)
        claimed = False
        try:
            with self._transaction(backend):
                if stale is None:
                    row = ticks.create(schedule_id=entry.name, tick=tick, manual=manual, claimed_at=now, job_id="")
                elif not self._stranded(now).filter(pk=stale.pk).update(claimed_at=now):
                    return None  # another scheduler took it over (or abandoned it) first
                else:
                    row = stale
                claimed = True
                try:
                    envelope = builder.build()
                except DispatchCancelled as exc:
                    if manual and stale is None:  # a person asked: they are told why not
                        raise
                    ticks.filter(pk=row.pk).update(dispatched_at=now)
                    logger.info(
                        "schedule %r: tick %s cancelled by a job_dispatching receiver: %s",
                        entry.name,
                        tick.isoformat(),
                        exc.args[0],
                        extra=log_fields(None, entry.queue, entry.job, outcome="cancelled"),
                    )
                    return None
                backend.submit([envelope])
                # A database backend's job commits with this transaction; a broker's push
                # happens at its commit, and marks the tick dispatched once it returned.
                ticks.filter(pk=row.pk).update(job_id=envelope.id, dispatched_at=now if backend.transactional else None)
                later = Q(last_run__isnull=True) | Q(last_run__lte=tick)
                Schedule.objects.using(self.alias).filter(later, name=entry.name).update(
                    last_run=tick, last_job_id=envelope.id, next_run=entry.next_tick(now), updated_at=now
                )
                if not backend.transactional:
                    # After the push: both run at the commit of the transaction the push waits for.
                    transaction.on_commit(partial(self._mark_dispatched, row.pk), using=atomic_alias())
        except IntegrityError:
            if claimed:
                raise
            logger.debug("schedule %r: tick %s is another scheduler's", entry.name, tick.isoformat())
            return None
        dispatched = Dispatched(entry.name, tick, envelope.id, envelope.queue, envelope.handler, manual)
        self._dispatched(dispatched)
        return dispatched

    @contextmanager
    def _transaction(self, backend: QueueBackend) -> Iterator[None]:
        """One transaction on the ticks' database; a database backend that keeps its jobs in
        another database gets its own transaction inside it, committed just before."""
        jobs_alias: str = getattr(backend, "alias", self.alias) if backend.transactional else self.alias
        inner = transaction.atomic(using=jobs_alias) if jobs_alias != self.alias else nullcontext()
        with transaction.atomic(using=self.alias), inner:
            yield

    def _mark_dispatched(self, pk: int) -> None:
        ScheduleTick.objects.using(self.alias).filter(pk=pk).update(dispatched_at=self.clock())

    def _dispatched(self, dispatched: Dispatched) -> None:
        """Log, count and report a dispatch."""
        logger.info(
            "schedule %r: dispatched %s",
            dispatched.name,
            dispatched,
            extra=log_fields(dispatched.job_id, dispatched.queue, dispatched.handler, outcome="scheduled"),
        )
        self.metrics.increment("jobs_scheduled", queue=dispatched.queue)
        self.dispatched += 1
        if self.on_dispatch is not None:
            self.on_dispatch(dispatched)

    def _failed(self, entry: Entry, tick: datetime | None, error: Exception) -> None:
        """Log an entry's failure (at ERROR once per tick; its retries at DEBUG)."""
        fields = log_fields(None, entry.queue, entry.job)
        when = "" if tick is None else f" tick {tick.isoformat()}"
        if entry.name in self._failing and self._failing[entry.name] == tick:
            logger.debug("schedule %r:%s failed again", entry.name, when, exc_info=error, extra=fields)
            return
        self._failing[entry.name] = tick
        logger.exception(
            "schedule %r:%s could not be dispatched; trying again next pass", entry.name, when, extra=fields
        )

    # -- the loop --

    def run(self, stop: threading.Event) -> None:
        """Sync, then pass every ``poll`` seconds or as soon as a tick is due, until ``stop``
        is set (checked between passes). A failed pass (the database is unreachable) is logged
        once per outage, and passes are retried with a backoff of up to ``MAX_BACKOFF``."""
        backoff = 0.0
        while not stop.is_set():
            try:
                if not self._synced:
                    self.sync()
                self.run_pass()
                wait = self._until_next_pass()
            except Exception:  # the loop outlives any outage
                _drop_connections()
                if not backoff:
                    logger.exception("scheduler: a pass failed; retrying with a backoff until one succeeds")
                backoff = min(max(2 * backoff, self.poll), MAX_BACKOFF)
                stop.wait(backoff)
                continue
            if backoff:
                logger.warning("scheduler: passes succeed again")
                backoff = 0.0
            stop.wait(wait)

    def _until_next_pass(self) -> float:
        """Seconds until the next pass: ``poll``, or less when an entry's next tick comes sooner."""
        now = self.clock()
        ahead = [(entry.next_tick(now) - now).total_seconds() for entry in self.entries.values() if entry.enabled]
        return max(min([self.poll, *ahead]), 0.001)


def _drop_connections() -> None:
    """After a failed pass: close this thread's database connections (outside a transaction),
    so the next pass connects afresh instead of reusing a broken one."""
    for connection in connections.all(initialized_only=True):
        if not connection.in_atomic_block:
            with contextlib.suppress(Exception):  # a dead connection may fail to close; it is gone
                connection.close()


def _fit(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters (a long cron expression in words may not fit its column)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"
