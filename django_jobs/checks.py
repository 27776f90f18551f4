"""System checks: ``manage.py check`` reports bad JOBS settings before a worker starts."""

from __future__ import annotations

from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from . import conf
from .retry import STRATEGIES

NON_NEGATIVE = (
    "RETRY_BACKOFF_BASE", "RETRY_BACKOFF_MULTIPLIER", "RETRY_BACKOFF_MAX", "DEFAULT_MAX_RETRIES",
    "IDEMPOTENCY_TTL", "POLL_INTERVAL",
)


def _error(msg: str, id: str, hint: str | None = None) -> checks.CheckMessage:
    return checks.Error(msg, hint=hint, obj="settings.JOBS", id=f"django_jobs.{id}")


@checks.register(checks.Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    from .backends import backend_config, engine_class

    errors: list[checks.CheckMessage] = []
    backends = conf.get("BACKENDS") or {}
    if conf.get("DEFAULT_BACKEND") not in backends:
        errors.append(_error(f"DEFAULT_BACKEND {conf.get('DEFAULT_BACKEND')!r} is not in BACKENDS", "E001"))
    for name in backends:
        try:
            engine_class(backend_config(name).get("ENGINE", "database"))
        except ImproperlyConfigured as exc:
            errors.append(_error(f"backend {name!r}: {exc}", "E002"))
        except ImportError as exc:
            errors.append(_error(f"backend {name!r}: cannot import its ENGINE: {exc}", "E002"))
    if conf.get("RETRY_BACKOFF_STRATEGY") not in STRATEGIES:
        errors.append(_error(
            f"unknown RETRY_BACKOFF_STRATEGY {conf.get('RETRY_BACKOFF_STRATEGY')!r}", "E003",
            hint=f"use one of {', '.join(STRATEGIES)}",
        ))
    for key in NON_NEGATIVE:
        value = conf.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            errors.append(_error(f"{key} must be a non-negative number, not {value!r}", "E004"))
    lease = conf.get("LEASE_TIMEOUT")
    if not isinstance(lease, (int, float)) or isinstance(lease, bool) or lease <= 0:
        errors.append(_error(f"LEASE_TIMEOUT must be a positive number of seconds, not {lease!r}", "E004"))
    timeout = conf.get("DEFAULT_TIMEOUT")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        errors.append(_error(f"DEFAULT_TIMEOUT must be None or a positive number, not {timeout!r}", "E004"))
    from django.conf import settings

    if conf.get("IDEMPOTENCY_CACHE") not in settings.CACHES:
        errors.append(_error(f"IDEMPOTENCY_CACHE {conf.get('IDEMPOTENCY_CACHE')!r} is not in CACHES", "E007"))
    if not conf.get("QUEUES"):
        errors.append(_error("QUEUES must list at least one queue", "E005"))
    from . import registry

    registry.autodiscover()  # @job handlers register on import
    known = set(conf.handlers()) | set(registry.registered())
    for queue, allowed in (conf.get("QUEUE_HANDLERS") or {}).items():
        for key in allowed:
            if key not in known:
                errors.append(_error(
                    f"QUEUE_HANDLERS[{queue!r}] names unknown handler {key!r}", "E006",
                    hint="add it to JOBS['HANDLERS'] or register it with @job in an app's jobs module",
                ))
    return errors


@checks.register(checks.Tags.compatibility)
def check_servicebus_delivery_count(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Service Bus dead-letters a message on its own once its lock has expired MaxDeliveryCount
    times. A job whose worker dies on every run needs ``max_retries + 2`` deliveries before
    django-jobs fails it (the last one is failed without running, with a failed ``Job`` row), so
    the queues' MaxDeliveryCount must exceed ``DEFAULT_MAX_RETRIES + 1``. Reads settings only: the
    entity's real MaxDeliveryCount is for ``OPTIONS["MAX_DELIVERY_COUNT"]`` to say (Azure's
    default is 10)."""
    from .backends import ENGINES

    retries = conf.get("DEFAULT_MAX_RETRIES")
    if not isinstance(retries, int) or isinstance(retries, bool):
        return []  # reported by check_settings (E004)
    warnings: list[checks.CheckMessage] = []
    for name, config in (conf.get("BACKENDS") or {}).items():
        engine = (config or {}).get("ENGINE", "database")
        if ENGINES.get(engine, engine) != ENGINES["servicebus"]:
            continue
        count = ((config or {}).get("OPTIONS") or {}).get("MAX_DELIVERY_COUNT", 10)
        if isinstance(count, int) and not isinstance(count, bool) and count > retries + 1:
            continue
        warnings.append(checks.Warning(
            f"backend {name!r}: the queues' MaxDeliveryCount ({count!r}) must exceed DEFAULT_MAX_RETRIES + 1 "
            f"({retries + 1}): Service Bus would dead-letter a job whose worker keeps dying before its retries "
            "are spent, and no failed Job row would record it",
            hint="raise MaxDeliveryCount on the Service Bus queues and set OPTIONS['MAX_DELIVERY_COUNT'] to it, "
            "or lower DEFAULT_MAX_RETRIES",
            obj="settings.JOBS",
            id="django_jobs.W001",
        ))
    return warnings
