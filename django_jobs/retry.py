"""Retry backoff: how long a failed job waits before its next attempt."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import conf, signing
from .exceptions import BadSignature, InvalidPayload
from .metrics import get_collector

if TYPE_CHECKING:
    from .envelope import Envelope

logger = logging.getLogger("django_jobs.reaper")

STRATEGIES = ("none", "fixed", "exponential", "full_jitter")
JITTER = 0.15
# The longest any job may wait: a dispatch delay, the distance to a scheduled time, a backoff
# base or cap. Anything longer is refused at dispatch, and any delay read back (settings, stored
# options, a computed backoff) is clamped to it, so no date arithmetic can overflow.
MAX_DELAY_SECONDS = 365 * 24 * 3600


def check_delay(value: Any, what: str) -> float:
    """``value`` as seconds, or a clear error: a finite, non-negative number of at most
    :data:`MAX_DELAY_SECONDS`. For values given at dispatch."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float
        seconds = math.inf if value > 0 else -math.inf
    if math.isnan(seconds):
        raise ValueError(f"{what} must be a number of seconds, not NaN")
    if seconds < 0:
        raise ValueError(f"{what} must not be negative (got {value!r})")
    if seconds > MAX_DELAY_SECONDS:
        raise ValueError(f"{what} of {value!r} seconds is too long: at most {MAX_DELAY_SECONDS} seconds (365 days)")
    return seconds


def clamp_delay(value: Any) -> float:
    """Any delay read back, as a finite float in ``[0, MAX_DELAY_SECONDS]``: NaN and values that
    are not numbers become 0, anything above the maximum becomes the maximum."""
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float
        return float(MAX_DELAY_SECONDS) if value > 0 else 0.0
    except (TypeError, ValueError):
        return 0.0
    if math.isnan(seconds):
        return 0.0
    return min(max(seconds, 0.0), float(MAX_DELAY_SECONDS))


@dataclass(frozen=True)
class RetryPolicy:
    """Delay before attempt N (1-based). ``compute_delay(1)`` is always 0.

    ``exponential``: ``base * multiplier ** (attempt - 2)``, capped at ``max``; with jitter
    ±15 %, capped again. ``full_jitter``: ``uniform(0, min(max, base * 2 ** (attempt - 2)))``.
    """

    base: float = 5
    strategy: str = "exponential"
    multiplier: float = 2.0
    max: float = 300
    jitter: bool = True

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown backoff strategy {self.strategy!r}; use one of {', '.join(STRATEGIES)}")
        for field in ("base", "multiplier", "max"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"backoff {field} must be a number, not {type(value).__name__}")
            if isinstance(value, float) and math.isnan(value):
                raise ValueError(f"backoff {field} must be a number, not NaN")
            if value < 0:
                raise ValueError(f"backoff {field} must not be negative")

    @property
    def cap(self) -> float:
        """``max``, itself capped at :data:`MAX_DELAY_SECONDS`."""
        return clamp_delay(self.max)

    def compute_delay(self, attempt: int) -> float:
        """Seconds to wait before running attempt ``attempt`` (1-based): always a finite float
        between 0 and ``min(max, MAX_DELAY_SECONDS)``, whatever the policy's numbers."""
        if attempt <= 1 or self.strategy == "none":
            return 0.0
        if self.strategy == "fixed":
            return min(clamp_delay(self.base), self.cap)
        if self.strategy == "full_jitter":
            return min(clamp_delay(random.uniform(0, self._raw(attempt, 2.0))), self.cap)
        delay = self._raw(attempt, self.multiplier)
        if self.jitter:
            delay = delay * random.uniform(1 - JITTER, 1 + JITTER)
        return min(clamp_delay(delay), self.cap)

    def _raw(self, attempt: int, multiplier: float) -> float:
        if self.base == 0:
            return 0.0  # base * anything: even when the growth factor overflows
        try:
            # float(): an int multiplier would build an exact power of any size (a huge attempt
            # count off the wire); a float power overflows at once instead.
            growth = float(multiplier) ** (attempt - 2)
            # A growth that underflows to 0 while base * growth would not: work it out in logs.
            raw = (
                self.base * growth if growth or not multiplier else _product_in_logs(self.base, multiplier, attempt - 2)
            )
        except OverflowError:
            return self.cap
        return self.cap if math.isnan(raw) else min(clamp_delay(raw), self.cap)

    @classmethod
    def from_settings(cls, **overrides: Any) -> RetryPolicy:
        """The global policy from ``JOBS``; ``overrides`` (a job's ``.backoff()``) win."""
        values = {
            "strategy": conf.get("RETRY_BACKOFF_STRATEGY"),
            "base": conf.get("RETRY_BACKOFF_BASE"),
            "multiplier": conf.get("RETRY_BACKOFF_MULTIPLIER"),
            "max": conf.get("RETRY_BACKOFF_MAX"),
            "jitter": conf.get("RETRY_BACKOFF_JITTER"),
        }
        values.update({k: v for k, v in overrides.items() if k in values})
        return cls(**values)


def policy_for(options: dict[str, Any] | None) -> RetryPolicy:
    """The policy of one job: its own ``.backoff()`` over the global settings.

    A malformed per-job backoff (the options come off the wire) falls back to the global policy.
    """
    overrides = (options or {}).get("backoff") if isinstance(options, dict) else None
    if isinstance(overrides, dict):
        try:
            return RetryPolicy.from_settings(**overrides)
        except (TypeError, ValueError):
            pass
    return RetryPolicy.from_settings()


def may_run(runs: int, max_retries: int) -> bool:
    """The retry budget, the one place it is stated: a job runs at most ``max_retries + 1`` times,
    so a job that has completed ``runs`` runs (successful, failed or lost) may run again only
    while ``runs <= max_retries``. A delivery whose ``attempts`` is past that (runs lost to
    crashes, counted by the broker) is failed without running."""
    return runs <= max_retries


def has_retries_left(attempts: int, max_retries: int) -> bool:
    """Whether a job may run again after the run it is in now, which had ``attempts`` runs
    (0-based, as in the envelope) before it: ``attempts < max_retries``."""
    return may_run(attempts + 1, max_retries)


def after_lost_run(attempts: int, max_retries: int, options: dict[str, Any] | None) -> float | None:
    """A lost lease counts as a failed run: the delay before the job runs again (a finite float
    in ``[0, MAX_DELAY_SECONDS]``), or ``None`` when that run used up its retries (the job fails).

    ``options`` must come from a verified message (:func:`trusted_options`): pass ``None`` to
    apply the global policy."""
    if not has_retries_left(attempts, max_retries):
        return None
    return clamp_delay(policy_for(options).compute_delay(attempts + 2))


def trusted_options(envelope: Envelope, queue: str) -> dict[str, Any] | None:
    """The envelope's ``options`` when its signature verifies for ``queue``, else ``None``.

    The reaper reads a lost job's own backoff from here: a row or message written without the
    signing key is still recovered, but with the global policy, never with options it carries.
    """
    try:
        signing.verify_delivery(envelope, queue)
    except (BadSignature, InvalidPayload):
        return None
    return envelope.options if isinstance(envelope.options, dict) else None


@contextmanager
def reaping(job_id: Any, queue: str, fatal: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Isolate the recovery of one expired lease: an error is logged and counted
    (``jobs_reap_errors``) and the reaper goes on with the next one, so one bad row or message
    never stops a pass. Errors of the ``fatal`` types (a lost connection: every later row would
    fail too) propagate and end the pass."""
    try:
        yield
    except fatal:
        raise
    except Exception:
        logger.exception("reaper: could not recover the expired lease of job %r on %s; skipped", job_id, queue)
        get_collector().increment("jobs_reap_errors", queue=queue)


def _product_in_logs(base: float, multiplier: float, exponent: int) -> float:
    """``base * multiplier ** exponent`` for a power too small for a float (0 below ~1e-308)."""
    logarithm = math.log(base) + exponent * math.log(multiplier)
    return math.exp(logarithm) if logarithm > -745 else 0.0
