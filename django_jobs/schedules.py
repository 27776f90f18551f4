"""Periodic jobs: the entries of ``JOBS["SCHEDULE"]`` and when each is due.

This module is pure: it reads settings and computes times, and never touches the database
(:mod:`django_jobs.scheduler` does the dispatching).

An entry (name -> dict)::

    JOBS["SCHEDULE"] = {
        "nightly-report": {
            "job": "shop.jobs.report",      # a @job's key (dotted path) or a HANDLERS key
            "args": [], "kwargs": {},       # for a @job; "payload": {...} for a handler
            "cron": "0 3 * * *",            # or exactly one of the helpers below
            "timezone": "Europe/Paris",     # default: settings.TIME_ZONE
            "queue": "reports", "backend": "default", "priority": 0,
            "enabled": True,
            "missed": "skip",               # or "catch_up_once"
        },
    }

Triggers (exactly one per entry): ``cron`` (needs the ``cron`` extra: croniter), ``every``
(seconds as a number, or ``"30s"``, ``"5m"``, ``"2h"``), ``hourly`` (minute past the hour, an
int; ``True`` = 0), ``daily`` (``"HH:MM"``), ``weekly`` (``"mon 09:00"``), ``monthly``
(``"1 03:00"``: day of month, then time; a day a month lacks is skipped that month).

Calendar triggers (cron, hourly, daily, weekly, monthly) are read as wall-clock times in the
entry's time zone. A time that does not exist (the hour skipped when clocks go forward) runs at
the first instant after the gap; a time that occurs twice (when clocks go back) runs once, at
its first occurrence. ``every`` ticks are fixed instants: multiples of the interval since the
Unix epoch, the same in every zone and on every scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

MissedPolicy = Literal["skip", "catch_up_once"]


class ScheduleError(ValueError):
    """An entry of ``JOBS["SCHEDULE"]`` that cannot be used; the message names the entry and
    says what to fix (the system checks report it)."""


@dataclass(frozen=True)
class Entry:
    """One validated entry."""

    name: str
    job: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    payload: Mapping[str, Any] | None = None  # for a HANDLERS key instead of a @job
    trigger: Mapping[str, Any] = field(default_factory=dict)  # {"cron": "0 3 * * *"}, {"every": 300}, ...
    timezone: str = "UTC"
    queue: str | None = None
    backend: str | None = None
    priority: int | None = None
    enabled: bool = True
    missed: MissedPolicy = "skip"

    def next_tick(self, after: datetime) -> datetime:
        """The first tick strictly after ``after`` (an aware datetime), as an aware UTC datetime."""
        raise NotImplementedError

    def previous_tick(self, at: datetime) -> datetime:
        """The latest tick at or before ``at`` (aware), as an aware UTC datetime. Cheap however
        far back the previous dispatch was: a scheduler asks only for this one tick."""
        raise NotImplementedError

    def describe(self) -> str:
        """The schedule in words: "every 5 minutes", "daily at 03:00 (Europe/Paris)",
        "cron 0 3 * * * (Europe/Paris)", ..."""
        raise NotImplementedError

    def as_definition(self) -> dict[str, Any]:
        """The entry as JSON-able data (what ``Schedule.definition`` stores)."""
        raise NotImplementedError


def parse_entry(name: str, raw: Any) -> Entry:
    """Validate one entry of the setting; raises :class:`ScheduleError`."""
    raise NotImplementedError


def entries() -> dict[str, Entry]:
    """Every entry of ``JOBS["SCHEDULE"]``, validated (raises :class:`ScheduleError` on the
    first bad one; the system checks report them all)."""
    raise NotImplementedError


def errors() -> list[str]:
    """One message per bad entry of ``JOBS["SCHEDULE"]`` (for the system checks)."""
    raise NotImplementedError
