"""Rate and concurrency limits: what they are, which ones a delivery is under, and the rate rule.

A limit is named by what it covers: ``"queue:<name>"`` (every job of a queue) or
``"handler:<key>"`` (every job of one handler: a ``@job`` function's dotted path or a
``JOBS["HANDLERS"]`` key). It caps the jobs running at once (``concurrency``), the starts per
period (``rate``, ``"100/m"``), or both. Limits come from ``JOBS["LIMITS"]`` and from
``@job(concurrency=..., rate=...)``; a worker resolves them from its own settings and registry,
never from the message. The backend enforces them at the start of each run (``acquire``).

No database here. :func:`rate_slot` is the one rate rule; every backend applies it (the
database backend in Python, Redis in Lua), and reads the time from :func:`now`, the one clock
of limits (tests replace it).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed

from . import conf

# Seconds per rate unit: "N/s", "N/m", "N/h", "N/d" (and "N/<k><unit>": N per k units).
UNITS: dict[str, int] = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_RATE = re.compile(r"(\d+)/(\d*)([smhd])")
KINDS = ("queue", "handler")
# The longest limit key a backend stores (the database column's size).
KEY_MAX_LENGTH = 200
# A start reserved for a later time is honoured without asking again when the job comes back at
# most this many seconds late (never more than one period): a worker picks a due job up within
# its poll interval, or after the jobs claimed ahead of it. Later, the reservation lapses and the
# job asks again, so jobs held up by a stopped worker do not all start at once when it returns.
RESERVATION_GRACE = 5.0


def parse_rate(text: object) -> tuple[int, float]:
    """``"100/m"`` -> ``(100, 60.0)``: starts per period of seconds. Units ``s``, ``m``, ``h``,
    ``d``, optionally multiplied (``"5/10s"``: 5 per 10 seconds). Raises ``ValueError`` (a
    value that is not a string: ``TypeError``)."""
    if not isinstance(text, str):
        raise TypeError(f"a rate is a string such as '100/m', not {conf.describe(text)}")
    match = _RATE.fullmatch(text.replace(" ", ""))
    if match is None:
        raise ValueError(
            f"bad rate {text!r}: write starts/period, e.g. '10/s', '100/m', '1000/h', '5/10s' (units s, m, h, d)"
        )
    count, multiple, unit = int(match[1]), int(match[2] or 1), match[3]
    if count < 1:
        raise ValueError(f"bad rate {text!r}: at least one start per period")
    if multiple < 1:
        raise ValueError(f"bad rate {text!r}: the period must be at least 1{unit}")
    return count, float(multiple * UNITS[unit])


def format_rate(count: int, period: float) -> str:
    """``(100, 60.0)`` -> ``"100/m"``; the inverse of :func:`parse_rate`."""
    for unit, seconds in sorted(UNITS.items(), key=lambda item: -item[1]):
        if period % seconds == 0:
            multiple = int(period // seconds)
            return f"{count}/{'' if multiple == 1 else multiple}{unit}"
    return f"{count}/{period:g}s"


@dataclass(frozen=True, slots=True)
class Limit:
    """One limit: its key, the most jobs running at once, the most starts per period."""

    key: str
    concurrency: int | None = None
    rate_count: int | None = None
    rate_period: float | None = None

    @property
    def rate(self) -> str | None:
        """The rate as written (``"100/m"``), or ``None``."""
        if self.rate_count is None or self.rate_period is None:
            return None
        return format_rate(self.rate_count, self.rate_period)

    @property
    def kind(self) -> str:
        """``"queue"`` or ``"handler"``."""
        return self.key.partition(":")[0]

    @classmethod
    def build(cls, key: str, *, concurrency: object = None, rate: object = None) -> Limit:
        """A checked limit; ``ValueError`` (or ``TypeError``, for a rate that is not a string)
        says what is wrong."""
        problem = _key_problem(key)
        if problem:
            raise ValueError(problem)
        problem = _concurrency_problem(concurrency)
        if problem:
            raise ValueError(problem)
        count, period = parse_rate(rate) if rate is not None else (None, None)
        if concurrency is None and count is None:
            raise ValueError("a limit needs a concurrency, a rate, or both")
        return cls(key, cast("int | None", concurrency), count, period)


def _key_problem(key: object) -> str | None:
    if not isinstance(key, str):
        return f"a limit key is a string, not {conf.describe(key)}"
    kind, sep, name = key.partition(":")
    if not sep or kind not in KINDS or not name:
        return f"bad limit key {key!r}: write 'queue:<queue name>' or 'handler:<handler key>'"
    if len(key) > KEY_MAX_LENGTH:
        return f"limit key {key[:40]!r}... is too long: at most {KEY_MAX_LENGTH} characters"
    return None


def entry_problem(key: object, value: object) -> str | None:
    """Why ``JOBS["LIMITS"][key] = value`` is wrong, or ``None``. A ``None`` value lifts that
    cap of a ``@job`` declaration (``{"rate": None}``)."""
    problem = _key_problem(key)
    if problem:
        return problem
    if isinstance(value, Mapping) and not value:
        return f"LIMITS[{key!r}] is empty: give a 'concurrency', a 'rate', or both"
    if not isinstance(value, Mapping):
        return (
            f"LIMITS[{key!r}] must be a dict such as {{'concurrency': 5, 'rate': '10/s'}}, not {conf.describe(value)}"
        )
    unknown = set(value) - {"concurrency", "rate"}
    if unknown:
        return (
            f"LIMITS[{key!r}] has unknown key(s) {', '.join(sorted(map(repr, unknown)))}: use 'concurrency' and 'rate'"
        )
    problem = _concurrency_problem(value.get("concurrency"))
    if problem is None and value.get("rate") is not None:
        try:
            parse_rate(value["rate"])
        except (TypeError, ValueError) as exc:
            problem = str(exc)
    return None if problem is None else f"LIMITS[{key!r}]: {problem}"


def _concurrency_problem(value: object) -> str | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return None
    return f"concurrency must be an int >= 1 or None, not {conf.describe(value)}"


def problems(value: object) -> list[str]:
    """Everything wrong with a ``JOBS["LIMITS"]`` value (empty: it is fine)."""
    if not isinstance(value, Mapping):
        return [
            f"LIMITS must be a dict of limit key -> {{'concurrency': ..., 'rate': ...}}, not {conf.describe(value)}"
        ]
    return [problem for key, entry in value.items() if (problem := entry_problem(key, entry)) is not None]


def _options(limit: Limit) -> dict[str, Any]:
    return {"concurrency": limit.concurrency, "rate": limit.rate}


# -- @job limits ---------------------------------------------------------------------------------

# Handler key -> the limit its @job declared (``handler:<key>``).
_declared: dict[str, Limit] = {}


def declare(handler: str, *, concurrency: int | None = None, rate: str | None = None) -> None:
    """``@job(concurrency=..., rate=...)``: limit every job of ``handler``. Checked now (a bad
    value raises at import, where the decorator is)."""
    if concurrency is None and rate is None:
        _declared.pop(handler, None)
    else:
        _declared[handler] = Limit.build(f"handler:{handler}", concurrency=concurrency, rate=rate)
    _resolved.clear()


# -- resolving -----------------------------------------------------------------------------------

# (handler, queue) -> the limits a delivery is under. Forgotten when JOBS changes or a @job
# declares a limit: a delivery without limits costs one dict lookup.
_resolved: dict[tuple[str, str], tuple[Limit, ...]] = {}


def _forget(*, setting: str, **kwargs: Any) -> None:
    if setting == "JOBS":
        _resolved.clear()


setting_changed.connect(_forget)


def configured() -> dict[str, Limit]:
    """Every limit in force: ``JOBS["LIMITS"]`` over the ``@job`` declarations (an entry's
    ``concurrency`` or ``rate`` replaces the decorator's, ``None`` lifts it). A bad setting
    raises ``ImproperlyConfigured``."""
    value = conf.get("LIMITS")
    found = problems(value)
    if found:
        raise ImproperlyConfigured("JOBS['LIMITS'] is wrong: " + "; ".join(found))
    merged = {limit.key: _options(limit) for limit in _declared.values()}
    for key, entry in value.items():
        merged[key] = {**merged.get(key, {}), **entry}
    result = {}
    for key, options in merged.items():
        if options.get("concurrency") is not None or options.get("rate") is not None:
            result[key] = Limit.build(key, concurrency=options.get("concurrency"), rate=options.get("rate"))
    return result


def limits_for(handler: str, queue: str) -> tuple[Limit, ...]:
    """The limits a job of ``handler`` on ``queue`` runs under, ordered by key (backends take
    them in this order, so two workers never wait on each other's locks)."""
    found = _resolved.get((handler, queue))
    if found is None:
        every = configured()
        found = tuple(every[key] for key in sorted((f"handler:{handler}", f"queue:{queue}")) if key in every)
        _resolved[(handler, queue)] = found
    return found


# -- the rate rule -------------------------------------------------------------------------------


def now() -> float:
    """The time limits are reckoned in (epoch seconds): the worker's clock, as ``available_at``."""
    return time.time()


def rate_slot(starts: Iterable[float], now: float, count: int, period: float) -> float:
    """The earliest time, at or after ``now``, at which one more start keeps every span of
    ``period`` seconds at ``count`` starts or fewer.

    ``starts`` are the times (epoch seconds, any order) of the starts granted or reserved so far,
    future reservations included. Only the ``count``-th latest matters: see :func:`next_start`.
    """
    latest = sorted(starts)[-count:]
    return next_start(latest[0] if len(latest) == count else None, now, period)


def next_start(nth_latest: float | None, now: float, period: float) -> float:
    """:func:`rate_slot` from the ``count``-th latest start alone (``None``: there are fewer
    than ``count``), which a backend reads with one indexed lookup.

    That start at or before ``now - period``: ``now``. Else it plus ``period``, or ``now`` if
    later: any time from there on has at most ``count - 1`` starts within ``period`` of it,
    whatever order the starts were taken in (a reservation given up leaves a hole, never a
    crowd)."""
    if nth_latest is None or nth_latest <= now - period:
        return now
    return max(now, nth_latest + period)


Reservation = Literal["early", "due", "lapsed"]


def reservation_state(slot: float, now: float, period: float) -> Reservation:
    """A job comes back for the start reserved for it at ``slot``: ``"early"`` (wait on),
    ``"due"`` (it starts, counted at ``slot``, without asking again) or ``"lapsed"`` (it came
    back more than :data:`RESERVATION_GRACE`, or one period, late: it asks again)."""
    if now < slot:
        return "early"
    if now - slot <= min(RESERVATION_GRACE, period):
        return "due"
    return "lapsed"


def describe(limits: Iterable[Limit]) -> str:
    """``queue:emails (concurrency 5, rate 10/s)``, for error messages and logs."""
    parts = []
    for limit in limits:
        caps = [f"concurrency {limit.concurrency}"] if limit.concurrency is not None else []
        caps += [f"rate {limit.rate}"] if limit.rate is not None else []
        parts.append(f"{limit.key} ({', '.join(caps)})")
    return ", ".join(parts)
