"""The ``JOBS`` settings dict, read lazily so ``override_settings`` always works.

Every key missing from ``settings.JOBS`` takes its default independently.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

BUILTIN_HANDLERS: dict[str, str] = {
    "command": "django_jobs.handlers.CommandHandler",
    "shell": "django_jobs.handlers.ShellHandler",
    "url": "django_jobs.handlers.UrlHandler",
}

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
    "DEAD_LETTER_QUEUE": None,
    "IDEMPOTENCY_TTL": 86400,
    "IDEMPOTENCY_CACHE": "default",
    "SIGNING_KEY": None,
    "SIGNING_KEY_FALLBACKS": [],
    "VERIFY_SIGNATURE": True,
    "HANDLERS": {},
    "QUEUE_HANDLERS": {},
    "ALLOWED_SHELL_COMMANDS": [],
    # The url handler refuses loopback/private/link-local targets unless this is True.
    "URL_ALLOW_PRIVATE_NETWORKS": False,
    "IMPORTS": [],
    "POLL_INTERVAL": 1.0,
    "METRICS_COLLECTOR": "django_jobs.metrics.InMemoryMetricsCollector",
    "SCHEDULE": {},
    # Not in the public table: a cap on one encoded message, checked before parsing.
    "MAX_MESSAGE_BYTES": 1024 * 1024,
}


def get(key: str) -> Any:
    """Return ``JOBS[key]`` or its default; read at call time, never cached."""
    user = getattr(settings, "JOBS", None) or {}
    if key in user:
        return user[key]
    return DEFAULTS[key]


def handlers() -> dict[str, str | None]:
    """Built-in handlers merged with ``JOBS["HANDLERS"]`` (a ``None`` value removes one)."""
    merged: dict[str, str | None] = dict(BUILTIN_HANDLERS)
    merged.update(get("HANDLERS") or {})
    return merged


def queues() -> list[str]:
    return list(get("QUEUES") or ["default"])


def default_queue() -> str:
    return queues()[0]
