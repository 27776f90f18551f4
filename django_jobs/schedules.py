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

Triggers (exactly one per entry): ``cron`` (needs the ``cron`` extra: croniter; five fields,
minute hour day-of-month month day-of-week), ``every`` (whole seconds, at least 1, as a number,
or ``"30s"``, ``"5m"``, ``"2h"``), ``hourly`` (minute past the hour, an int; ``True`` = 0),
``daily`` (``"HH:MM"``), ``weekly`` (``"mon 09:00"``), ``monthly`` (``"1 03:00"``: day of month,
then time; a day a month lacks is skipped that month).

Calendar triggers (cron, daily, weekly, monthly) are read as wall-clock times in the entry's time
zone. A time that does not exist (the hour skipped when clocks go forward) runs at the first
instant after the gap; a time that occurs twice (when clocks go back) runs once, at its first
occurrence. ``hourly`` runs whenever the zone's clock shows its minute: once every real hour,
twice in the hour that repeats when clocks go back, and not at all in the hour they skip.
``every`` ticks are fixed instants: multiples of the interval since the Unix epoch, the same in
every zone and on every scheduler.
"""

from __future__ import annotations

import calendar
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, time, timedelta, tzinfo
from functools import cached_property
from importlib import import_module
from typing import Any, Literal, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from . import conf
from .checks import did_you_mean
from .envelope import payload_problem

MissedPolicy = Literal["skip", "catch_up_once"]
MISSED_POLICIES: tuple[MissedPolicy, ...] = ("skip", "catch_up_once")
TRIGGERS = ("cron", "every", "hourly", "daily", "weekly", "monthly")
KEYS = ("job", "args", "kwargs", "payload", *TRIGGERS, "timezone", "queue", "backend", "priority", "enabled", "missed")
NAME_MAX_LENGTH = 200  # Schedule.name
CRON_EXTRA = "pip install 'django-reliable-jobs[cron]'"
DAY_NAMES = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")  # not the locale's
DAYS = tuple(name[:3].lower() for name in DAY_NAMES)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


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

    @cached_property
    def _rule(self) -> _Rule:
        [(kind, value)] = self.trigger.items()
        if kind == "every":
            return _Every(timedelta(seconds=value))
        return _Calendar(_WALLS[kind](value), ZoneInfo(self.timezone), every_occurrence=kind == "hourly")

    def next_tick(self, after: datetime) -> datetime:
        """The first tick strictly after ``after`` (an aware datetime), as an aware UTC datetime."""
        return self._rule.next_tick(_aware(after))

    def previous_tick(self, at: datetime) -> datetime:
        """The latest tick at or before ``at`` (aware), as an aware UTC datetime. Cheap however
        far back the previous dispatch was: a scheduler asks only for this one tick."""
        return self._rule.previous_tick(_aware(at))

    def describe(self) -> str:
        """The schedule in words: "every 5 minutes", "daily at 03:00 (Europe/Paris)",
        "cron 0 3 * * * (Europe/Paris)", ..."""
        [(kind, value)] = self.trigger.items()
        words: str = _WORDS[kind](value)
        if kind != "every" and self.timezone != "UTC":
            words += f" ({self.timezone})"
        return words

    def as_definition(self) -> dict[str, Any]:
        """The entry as JSON-able data (what ``Schedule.definition`` stores); :func:`parse_entry`
        reads it back to an equal entry."""
        arguments = (
            {"payload": self.payload}
            if self.payload is not None
            else {"args": list(self.args), "kwargs": dict(self.kwargs)}
        )
        return {
            "job": self.job,
            **arguments,
            **self.trigger,
            "timezone": self.timezone,
            "queue": self.queue,
            "backend": self.backend,
            "priority": self.priority,
            "enabled": self.enabled,
            "missed": self.missed,
        }


def parse_entry(name: str, raw: Any) -> Entry:
    """Validate one entry of the setting; raises :class:`ScheduleError` (its first problem).
    Whether ``job`` names a registered handler is for :func:`errors` to say (it needs the jobs
    modules imported)."""
    entry, problems = _parse(name, raw)
    if entry is None:
        raise ScheduleError(problems[0])
    return entry


def _parse(name: Any, raw: Any) -> tuple[Entry | None, list[str]]:
    """The entry, or ``None`` and every problem found in it (not only the first)."""
    where = f"SCHEDULE[{name!r}]"
    if not isinstance(name, str) or not name or len(name) > NAME_MAX_LENGTH:
        return None, [f"SCHEDULE key {name!r} must be a non-empty string of at most {NAME_MAX_LENGTH} characters"]
    if not isinstance(raw, dict):
        return None, [f"{where} must be a dict with 'job' and a trigger, not {conf.describe(raw)}"]
    problems = []
    for key in raw:
        if key not in KEYS:
            hint = did_you_mean(key, KEYS) or f"the keys are {', '.join(KEYS)}"
            problems.append(f"{where} has unknown key {key!r} ({hint})")
    if "job" not in raw:
        problems.append(f"{where} has no 'job': name a @job's dotted path or a JOBS['HANDLERS'] key")
    triggers = [key for key in TRIGGERS if key in raw]
    if len(triggers) != 1:
        found = f"{len(triggers)} ({', '.join(map(repr, triggers))})" if triggers else "none"
        problems.append(f"{where} needs exactly one trigger of {', '.join(TRIGGERS)}; it has {found}")
    if "payload" in raw and ("args" in raw or "kwargs" in raw):
        problems.append(f"{where} has 'payload' and 'args'/'kwargs': a @job takes args/kwargs, a handler a payload")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _FIELDS:
            try:
                values[key] = _FIELDS[key](value)
            except _Invalid as exc:
                problems.append(f"{where}[{key!r}] {exc}")
    if problems:
        return None, problems
    values.setdefault("timezone", getattr(settings, "TIME_ZONE", None) or "UTC")
    kind = triggers[0]
    return Entry(name=name, trigger={kind: values.pop(kind)}, **values), []


def entries() -> dict[str, Entry]:
    """Every entry of ``JOBS["SCHEDULE"]``, validated (raises :class:`ScheduleError` on the
    first bad one; the system checks report them all)."""
    return {name: parse_entry(name, raw) for name, raw in _setting().items()}


def errors(unimportable: Collection[str] = ()) -> list[str]:
    """Every problem of every entry of ``JOBS["SCHEDULE"]`` (for the system checks). An entry's
    ``job`` must be registered: import the jobs modules first (``registry.autodiscover()``, or
    the checks' own import of them), as a worker does before its first fetch. A job of one of
    the ``unimportable`` modules is not reported unknown: that module's import error says why."""
    try:
        setting = _setting()
    except ScheduleError as exc:
        return [str(exc)]
    problems = []
    for name, raw in setting.items():
        entry, found = _parse(name, raw)
        problems += found
        if entry is not None and not entry.job.startswith(tuple(f"{module}." for module in unimportable)):
            try:
                _check_job(entry)
            except ScheduleError as exc:
                problems.append(str(exc))
    return problems


def _setting() -> dict[Any, Any]:
    raw = conf.get("SCHEDULE")
    if not isinstance(raw, dict):
        raise ScheduleError(f"SCHEDULE must be a dict of name -> entry, not {conf.describe(raw)}")
    return raw


def _check_job(entry: Entry) -> None:
    """``entry.job`` names a registered @job (whose signature takes the args and kwargs) or a
    handler (which takes a payload)."""
    from . import registry
    from .api import JobFunction

    where = f"SCHEDULE[{entry.name!r}]"
    try:
        handlers = {key for key, path in conf.handlers().items() if path}
    except ImproperlyConfigured:
        return  # a malformed HANDLERS is reported on its own; which names it holds is unknown
    registered = registry.registered()
    function = registered.get(entry.job)
    if isinstance(function, JobFunction):
        if entry.payload is not None:
            raise ScheduleError(f"{where}['payload'] is for a handler: the @job {entry.job} takes 'args'/'kwargs'")
        try:
            function.signature.bind(*entry.args, **entry.kwargs)
        except TypeError as exc:
            raise ScheduleError(f"{where}['args'/'kwargs'] do not fit {entry.job}(): {exc}") from None
    elif entry.job in registered or entry.job in handlers:
        if entry.args or entry.kwargs:
            raise ScheduleError(f"{where}['args'/'kwargs'] are for a @job: the handler {entry.job} takes 'payload'")
    else:
        hint = did_you_mean(entry.job, {*registered, *handlers}) or (
            "register it with @job in an app's jobs module or add it to JOBS['HANDLERS']"
        )
        raise ScheduleError(f"{where}['job'] names unknown job {entry.job!r} ({hint})")


class _Invalid(Exception):
    """A value a field refuses; its message says why ("must be ...")."""


def _aware(moment: datetime) -> datetime:
    if moment.utcoffset() is None:
        raise ValueError(f"an aware datetime is needed, not the naive {moment.isoformat()}")
    return moment


# -- fields: each returns the value normalized, or raises _Invalid saying what is wrong ------------------


def _job(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _Invalid(f"must be a @job's dotted path or a HANDLERS key, not {conf.describe(value)}")
    return value


def _json(value: Any, label: str) -> None:
    problem = payload_problem(value, label)
    if problem is not None:
        raise _Invalid(f"must be JSON data: {problem.text}")


def _args(value: Any) -> tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise _Invalid(f"must be a list, not {conf.describe(value)}")
    _json(value, "args")
    return tuple(value)


def _kwargs(value: Any, label: str = "kwargs") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Invalid(f"must be a dict, not {conf.describe(value)}")
    _json(value, label)
    return dict(value)


def _payload(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    return _kwargs(value, "payload")


def _timezone(value: Any) -> str:
    if isinstance(value, str) and value:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            pass
        else:
            return value
    hint = did_you_mean(value, available_timezones())
    raise _Invalid(f"is not a time zone name ('Europe/Paris', 'UTC'): {value!r}{f' ({hint})' if hint else ''}")


def _queue(value: Any) -> str | None:
    try:
        known = conf.queues()
    except ImproperlyConfigured:
        known = None  # a malformed QUEUES is reported on its own
    return _one_of(value, known, "JOBS['QUEUES']")


def _backend(value: Any) -> str | None:
    backends = conf.get("BACKENDS")
    return _one_of(value, list(backends) if isinstance(backends, dict) else None, "JOBS['BACKENDS']")


def _one_of(value: Any, known: list[str] | None, setting: str) -> str | None:
    """``None`` (the default) or a name in ``known`` (any name when ``known`` is ``None``)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _Invalid(f"must be a name in {setting}, not {conf.describe(value)}")
    if known is not None and value not in known:
        raise _Invalid(f"{value!r} is not in {setting} ({did_you_mean(value, known) or ', '.join(known)})")
    return value


def _priority(value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise _Invalid(f"must be an int, not {conf.describe(value)}")


def _enabled(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise _Invalid(f"must be True or False, not {conf.describe(value)}")


def _missed(value: Any) -> MissedPolicy:
    for policy in MISSED_POLICIES:
        if value == policy:
            return policy
    raise _Invalid(f"must be {' or '.join(map(repr, MISSED_POLICIES))}, not {conf.describe(value)}")


# -- triggers: parsed to a normalized value, which the walls and the words are built from ----------------

_TIME = re.compile(r"(\d{1,2}):(\d\d)")
_EVERY = re.compile(r"(\d+)\s*([smh])")
_UNITS = {"s": 1, "m": 60, "h": 3600}
# croniter's hashed (H) and random (R) fields would give each scheduler different ticks.
_UNSHARED_CRON = re.compile(r"\b[HR]\b", re.IGNORECASE)


def _import_croniter() -> Any:
    """The croniter class (ImportError without the ``cron`` extra)."""
    return import_module("croniter").croniter


def _cron(value: Any) -> str:
    if not isinstance(value, str) or len(value.split()) != 5:
        raise _Invalid(
            f"must be 5 fields (minute hour day-of-month month day-of-week), not {conf.describe(value)}; "
            "for seconds use 'every'"
        )
    expression = " ".join(value.split())
    if _UNSHARED_CRON.search(expression):
        raise _Invalid(f"{expression!r}: hashed (H) and random (R) fields are not supported")
    try:
        croniter = _import_croniter()
    except ImportError:
        raise _Invalid(f"needs croniter: {CRON_EXTRA}") from None
    try:
        croniter(expression, datetime(2000, 1, 1)).get_next(datetime)
    except ValueError as exc:  # croniter's errors are ValueErrors; a date that never comes too
        raise _Invalid(f"{expression!r} is not a valid cron expression: {exc}") from None
    return expression


def _every(value: Any) -> int:
    seconds = value
    if isinstance(value, str) and (match := _EVERY.fullmatch(value.strip())):
        seconds = int(match[1]) * _UNITS[match[2]]
    if isinstance(seconds, int) and not isinstance(seconds, bool) and seconds >= 1:
        return seconds
    raise _Invalid(f"must be whole seconds (at least 1) or a string like '30s', '5m', '2h', not {conf.describe(value)}")


def _hourly(value: Any) -> int:
    if value is True:
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 59:
        return value
    raise _Invalid(f"must be the minute past the hour (0 to 59) or True (= 0), not {conf.describe(value)}")


def _clock(text: str) -> time:
    """``"HH:MM"`` as a time; _Invalid when it is not one."""
    match = _TIME.fullmatch(text)
    if not match or int(match[1]) > 23 or int(match[2]) > 59:
        raise _Invalid(f"{text!r} is not a time HH:MM")
    return time(int(match[1]), int(match[2]))


def _parts(value: Any, count: int, shape: str) -> list[str]:
    parts = value.split() if isinstance(value, str) else []
    if len(parts) != count:
        raise _Invalid(f"must be a string {shape}, not {conf.describe(value)}")
    return parts


def _daily(value: Any) -> str:
    [at] = _parts(value, 1, "'HH:MM'")
    return f"{_clock(at):%H:%M}"


def _weekly(value: Any) -> str:
    day, at = _parts(value, 2, "'<day> HH:MM' ('mon 09:00')")
    short = day.lower()[:3]
    if short not in DAYS or day.lower() not in (short, DAY_NAMES[DAYS.index(short)].lower()):
        raise _Invalid(f"{day!r} is not a day: use {', '.join(DAYS)} (or the full name)")
    return f"{short} {_clock(at):%H:%M}"


def _monthly(value: Any) -> str:
    day, at = _parts(value, 2, "'<day of month> HH:MM' ('1 03:00')")
    if not day.isdigit() or not 1 <= int(day) <= 31:
        raise _Invalid(f"{day!r} is not a day of the month (1 to 31)")
    return f"{int(day)} {_clock(at):%H:%M}"


_FIELDS: dict[str, Callable[[Any], Any]] = {
    "job": _job,
    "args": _args,
    "kwargs": _kwargs,
    "payload": _payload,
    "cron": _cron,
    "every": _every,
    "hourly": _hourly,
    "daily": _daily,
    "weekly": _weekly,
    "monthly": _monthly,
    "timezone": _timezone,
    "queue": _queue,
    "backend": _backend,
    "priority": _priority,
    "enabled": _enabled,
    "missed": _missed,
}


def _every_words(seconds: int) -> str:
    unit, size = next(
        (unit, size) for unit, size in (("hour", 3600), ("minute", 60), ("second", 1)) if seconds % size == 0
    )
    count = seconds // size
    return f"every {unit}" if count == 1 else f"every {count} {unit}s"


def _weekly_words(value: str) -> str:
    day, at = value.split()
    return f"weekly on {DAY_NAMES[DAYS.index(day)]} at {at}"


def _monthly_words(value: str) -> str:
    day, at = value.split()
    return f"monthly on day {day} at {at}"


_WORDS: dict[str, Callable[[Any], str]] = {
    "cron": lambda expression: f"cron {expression}",
    "every": _every_words,
    "hourly": lambda minute: f"hourly at :{minute:02d}",
    "daily": lambda at: f"daily at {at}",
    "weekly": _weekly_words,
    "monthly": _monthly_words,
}


# -- tick maths ----------------------------------------------------------------------------------------


class _Rule(Protocol):
    def next_tick(self, after: datetime) -> datetime: ...

    def previous_tick(self, at: datetime) -> datetime: ...


@dataclass(frozen=True)
class _Every:
    """Multiples of ``interval`` since the Unix epoch: whole-number arithmetic, no iteration."""

    interval: timedelta

    def next_tick(self, after: datetime) -> datetime:
        return EPOCH + ((after - EPOCH) // self.interval + 1) * self.interval

    def previous_tick(self, at: datetime) -> datetime:
        return EPOCH + ((at - EPOCH) // self.interval) * self.interval


class _Walls(Protocol):
    """The wall-clock (naive local) times of a calendar trigger."""

    def after(self, wall: datetime) -> Iterator[datetime]:
        """The times strictly after ``wall``, earliest first."""
        ...

    def at_or_before(self, wall: datetime) -> Iterator[datetime]:
        """The times at or before ``wall``, latest first."""
        ...


@dataclass(frozen=True)
class _Calendar:
    """Wall-clock times in ``zone``, as instants. ``every_occurrence``: a time that occurs twice
    is two ticks and one that does not exist is none; otherwise it is its first occurrence, and
    the first instant after the gap."""

    walls: _Walls
    zone: tzinfo
    every_occurrence: bool

    def _instants(self, wall: datetime) -> list[datetime]:
        found = _occurrences(wall, self.zone)
        if self.every_occurrence:
            return found
        return found[:1] or [_gap_end(wall, self.zone)]

    def next_tick(self, after: datetime) -> datetime:
        wall = _naive(after.astimezone(self.zone))
        # When clocks go back a wall time shows twice: while ``after`` is in the first pass, the
        # wall times up to an hour earlier (``back``) occur again after it. Elsewhere it is zero.
        back = _occurrences(wall, self.zone)[-1] - after
        walls = self.walls.after(wall - back)
        return next(instant for wall in walls for instant in self._instants(wall) if instant > after)

    def previous_tick(self, at: datetime) -> datetime:
        wall = _naive(at.astimezone(self.zone))
        # Likewise, while ``at`` is in the second pass, the wall times up to an hour later
        # (``ahead``) first occurred before it.
        ahead = at - _occurrences(wall, self.zone)[0]
        walls = self.walls.at_or_before(wall + ahead)
        return next(instant for wall in walls for instant in reversed(self._instants(wall)) if instant <= at)


def _naive(local: datetime) -> datetime:
    return local.replace(tzinfo=None, fold=0)


def _occurrences(wall: datetime, zone: tzinfo) -> list[datetime]:
    """Every instant (UTC) at which the clock of ``zone`` shows ``wall``, earliest first: none in
    the gap when clocks go forward, two when they go back and the time repeats."""
    readings = {wall.replace(tzinfo=zone, fold=fold).astimezone(UTC) for fold in (0, 1)}
    return sorted(instant for instant in readings if _naive(instant.astimezone(zone)) == wall)


def _gap_end(wall: datetime, zone: tzinfo) -> datetime:
    """The first instant after the gap that holds ``wall`` (a time the clocks skip). Read with
    the offsets before and after the jump, ``wall`` gives two instants the jump lies between;
    a binary search over whole seconds finds it (zone transitions fall on whole seconds)."""
    low, high = sorted(wall.replace(tzinfo=zone, fold=fold).astimezone(UTC) for fold in (0, 1))
    while high - low > timedelta(seconds=1):
        middle = low + timedelta(seconds=(high - low) // timedelta(seconds=2))
        if _naive(middle.astimezone(zone)) > wall:
            high = middle
        else:
            low = middle
    return high


@dataclass(frozen=True)
class _Periodic:
    """One wall-clock time (or none) per period: an hour, a day, a week or a month."""

    start: Callable[[datetime], datetime]  # the start of the period holding a wall time
    shift: Callable[[datetime, int], datetime]  # the start of the period n periods away
    tick: Callable[[datetime], datetime | None]  # the period's time (None: it has none)

    def after(self, wall: datetime) -> Iterator[datetime]:
        period = self.start(wall)
        while True:
            tick = self.tick(period)
            if tick is not None and tick > wall:
                yield tick
            period = self.shift(period, 1)

    def at_or_before(self, wall: datetime) -> Iterator[datetime]:
        period = self.start(wall)
        while True:
            tick = self.tick(period)
            if tick is not None and tick <= wall:
                yield tick
            period = self.shift(period, -1)


@dataclass(frozen=True)
class _CronWalls:
    """A cron expression's times, from croniter on naive datetimes (whole minutes)."""

    expression: str

    def after(self, wall: datetime) -> Iterator[datetime]:
        times = _import_croniter()(self.expression, wall)
        while True:
            yield times.get_next(datetime)

    def at_or_before(self, wall: datetime) -> Iterator[datetime]:
        # get_prev is strictly before its start: start one minute after wall's minute.
        times = _import_croniter()(self.expression, wall.replace(second=0, microsecond=0) + timedelta(minutes=1))
        while True:
            yield times.get_prev(datetime)


def _midnight(wall: datetime) -> datetime:
    return wall.replace(hour=0, minute=0, second=0, microsecond=0)


def _by(step: timedelta) -> Callable[[datetime, int], datetime]:
    return lambda period, count: period + count * step


def _add_months(period: datetime, count: int) -> datetime:
    index = period.year * 12 + period.month - 1 + count
    return period.replace(year=index // 12, month=index % 12 + 1)


def _hourly_walls(minute: int) -> _Walls:
    return _Periodic(
        start=lambda wall: wall.replace(minute=0, second=0, microsecond=0),
        shift=_by(timedelta(hours=1)),
        tick=lambda hour: hour.replace(minute=minute),
    )


def _daily_walls(value: str) -> _Walls:
    at = _clock(value)
    return _Periodic(_midnight, _by(timedelta(days=1)), lambda day: datetime.combine(day.date(), at))


def _weekly_walls(value: str) -> _Walls:
    day, clock = value.split()
    weekday, at = DAYS.index(day), _clock(clock)
    return _Periodic(
        start=lambda wall: _midnight(wall) - timedelta(days=wall.weekday()),
        shift=_by(timedelta(days=7)),
        tick=lambda monday: datetime.combine(monday.date() + timedelta(days=weekday), at),
    )


def _monthly_walls(value: str) -> _Walls:
    day, clock = value.split()
    number, at = int(day), _clock(clock)

    def tick(first: datetime) -> datetime | None:
        if number > calendar.monthrange(first.year, first.month)[1]:
            return None  # the month has no such day
        return datetime.combine(first.date().replace(day=number), at)

    return _Periodic(lambda wall: _midnight(wall).replace(day=1), _add_months, tick)


_WALLS: dict[str, Callable[[Any], _Walls]] = {
    "cron": _CronWalls,
    "hourly": _hourly_walls,
    "daily": _daily_walls,
    "weekly": _weekly_walls,
    "monthly": _monthly_walls,
}
