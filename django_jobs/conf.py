"""The ``JOBS`` settings dict, read lazily so ``override_settings`` always works.

Every key missing from ``settings.JOBS`` takes its default independently.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

BUILTIN_HANDLERS: dict[str, str] = {
    "command": "django_jobs.handlers.CommandHandler",
    "shell": "django_jobs.handlers.ShellHandler",
    "url": "django_jobs.handlers.UrlHandler",
    "event": "django_jobs.handlers.EventHandler",
}

# The longest queue name: the ``queue`` columns of the job tables hold this many characters.
QUEUE_NAME_LENGTH = 100

DEFAULTS: dict[str, Any] = {
    "DEFAULT_BACKEND": "default",
    "BACKENDS": {"default": {"ENGINE": "database"}},
    "QUEUES": ["default"],
    "RETRY_BACKOFF_STRATEGY": "none",
    "RETRY_BACKOFF_BASE": 5,
    "RETRY_BACKOFF_MULTIPLIER": 2.0,
    "RETRY_BACKOFF_MAX": 300,
    "RETRY_BACKOFF_JITTER": True,
    "DEFAULT_MAX_RETRIES": 0,
    "DEFAULT_TIMEOUT": None,
    "LEASE_TIMEOUT": 60,
    # Seconds an aborted job may run on after its worker learns of the abort, before
    # ``JobAborted`` is raised inside it.
    "ABORT_GRACE": 10,
    "DEAD_LETTER_QUEUE": None,
    "IDEMPOTENCY_TTL": 86400,
    "IDEMPOTENCY_CACHE": "default",
    "SIGNING_KEY": None,
    "SIGNING_KEY_FALLBACKS": [],
    "VERIFY_SIGNATURE": True,
    "HANDLERS": {},
    "QUEUE_HANDLERS": {},
    "ALLOWED_SHELL_COMMANDS": [],
    # Management commands the command handler may run; empty (the default) permits none.
    "ALLOWED_COMMANDS": [],
    # Event names the event handler may send (job_event); empty (the default) permits none.
    "ALLOWED_EVENTS": [],
    # The url handler refuses loopback/private/link-local targets unless this is True.
    "URL_ALLOW_PRIVATE_NETWORKS": False,
    "IMPORTS": [],
    "POLL_INTERVAL": 1.0,
    "METRICS_COLLECTOR": "django_jobs.metrics.InMemoryMetricsCollector",
    "SCHEDULE": {},
    # Rate and concurrency limits: "queue:<name>" or "handler:<key>" -> {"concurrency": 5,
    # "rate": "10/s"}, over the limits @job(concurrency=..., rate=...) declares.
    "LIMITS": {},
    # Finished attempts kept per job in the attempt history (0: keep none).
    "HISTORY_LIMIT": 25,
    # The most jobs a worker claims at a time where its backend can claim a batch (database,
    # Redis): about 50 ms of work by the recent jobs' durations. 1: one job at a time.
    "PREFETCH": 100,
    # A cap on one encoded message, checked before parsing.
    "MAX_MESSAGE_BYTES": 1024 * 1024,
}


# The values ``settings`` has read so far, its own cache, which Django empties on every change
# (``override_settings`` and assignments included): read straight, a setting costs no
# ``LazyObject`` attribute lookup. The worker reads settings on every job.
_read: dict[str, Any] = object.__getattribute__(settings, "__dict__")


def user_settings() -> dict[str, Any]:
    """``settings.JOBS`` itself (``{}`` when unset); anything but a dict is ImproperlyConfigured."""
    user = _read.get("JOBS")
    if user is None:
        user = getattr(settings, "JOBS", None)
    if user is None:
        return {}
    if not isinstance(user, dict):
        raise ImproperlyConfigured(f"settings.JOBS must be a dict, not a {type(user).__name__}")
    return user


def get(key: str) -> Any:
    """Return ``JOBS[key]`` or its default, as the settings say now (``override_settings``
    included)."""
    user = user_settings()
    if key in user:
        return user[key]
    return DEFAULTS[key]


def names_problem(value: Any, *, ordered: bool = False, longest: int | None = None) -> str | None:
    """Why ``value`` is not a list of non-empty strings (of at most ``longest`` characters), or
    ``None`` when it is.

    A bare ``str`` is refused above all: iterated, it would be read one character at a time
    (queue ``d``, a one-character allowlist entry). Sets are accepted unless order matters.
    """
    kinds: tuple[type, ...] = (list, tuple) if ordered else (list, tuple, set, frozenset)
    if not isinstance(value, kinds):
        return f"must be a list of strings, not {describe(value)}"
    for item in cast(Iterable[Any], value):
        if not isinstance(item, str) or not item:
            return f"must be a list of non-empty strings; it holds {describe(item)}"
        if "\x00" in item:  # PostgreSQL cannot store it; Redis's flow records use it as a separator
            return f"must not hold a NUL character; it holds {describe(item)}"
        if longest is not None and len(item) > longest:
            return f"must hold names of at most {longest} characters; it holds one of {len(item)}"
    return None


def names(key: str, *, ordered: bool = False, longest: int | None = None) -> list[str]:
    """``JOBS[key]`` as a list of strings, or ImproperlyConfigured (never characters of a str)."""
    value = get(key)
    problem = names_problem(value, ordered=ordered, longest=longest)
    if problem:
        raise ImproperlyConfigured(f"JOBS[{key!r}] {problem}")
    return list(value)


def describe(value: Any) -> str:
    """A short ``repr`` and the type, for error messages (never use it on secrets)."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    from .envelope import a_type  # the envelope module reads settings through this one

    return f"{text} ({a_type(value)})"


def handlers() -> dict[str, str | None]:
    """Built-in handlers merged with ``JOBS["HANDLERS"]`` (a ``None`` value removes one)."""
    extra = get("HANDLERS") or {}
    if not isinstance(extra, dict):
        raise ImproperlyConfigured(
            f"JOBS['HANDLERS'] must be a dict of handler key -> dotted path, not {describe(extra)}"
        )
    merged: dict[str, str | None] = dict(BUILTIN_HANDLERS)
    merged.update(extra)
    return merged


def queues() -> list[str]:
    """``JOBS["QUEUES"]`` (``["default"]`` when empty); a str is ImproperlyConfigured, never queue ``d``."""
    if not get("QUEUES"):
        return ["default"]
    return names("QUEUES", ordered=True, longest=QUEUE_NAME_LENGTH)


def default_queue() -> str:
    return queues()[0]
