"""Retry backoff: how long a failed job waits before its next attempt."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from . import conf

STRATEGIES = ("none", "fixed", "exponential", "full_jitter")
JITTER = 0.15


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
            if getattr(self, field) < 0:
                raise ValueError(f"backoff {field} must not be negative")

    def compute_delay(self, attempt: int) -> float:
        """Seconds to wait before running attempt ``attempt`` (1-based)."""
        if attempt <= 1 or self.strategy == "none":
            return 0.0
        if self.strategy == "fixed":
            return float(min(self.base, self.max))
        if self.strategy == "full_jitter":
            return random.uniform(0, self._raw(attempt, 2.0))
        delay = self._raw(attempt, self.multiplier)
        if self.jitter:
            delay = min(delay * random.uniform(1 - JITTER, 1 + JITTER), self.max)
        return max(delay, 0.0)

    def _raw(self, attempt: int, multiplier: float) -> float:
        if self.base == 0:
            return 0.0  # base * anything: even when the growth factor overflows
        try:
            raw = self.base * multiplier ** (attempt - 2)
        except OverflowError:
            return float(self.max)
        return float(min(raw, self.max))

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


def after_lost_run(attempts: int, max_retries: int, options: dict[str, Any] | None) -> float | None:
    """A lost lease counts as a failed run: the delay before the job runs again, or ``None``
    when that run used up its retries (the job fails)."""
    if attempts + 1 > max_retries:
        return None
    return policy_for(options).compute_delay(attempts + 2)
