"""Configured backends by name: ``JOBS["BACKENDS"]``, built once per process."""

from __future__ import annotations

import logging
import threading
from importlib import import_module
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

from .. import conf
from .base import QueueBackend

ENGINES = {
    "database": "django_jobs.backends.database.DatabaseBackend",
    "redis": "django_jobs.backends.redis.RedisBackend",
    "beanstalk": "django_jobs.backends.beanstalk.BeanstalkBackend",
    "servicebus": "django_jobs.backends.servicebus.ServiceBusBackend",
    "sync": "django_jobs.backends.sync.SyncBackend",
}

_instances: dict[str, QueueBackend] = {}
_lock = threading.Lock()
logger = logging.getLogger("django_jobs.health")


def require(module: str, extra: str) -> Any:
    """Import an optional dependency, or say which extra installs it."""
    try:
        return import_module(module)
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"this backend needs {module!r}: pip install 'django-reliable-jobs[{extra}]'"
        ) from exc


def backend_config(name: str) -> dict[str, Any]:
    backends: dict[str, dict[str, Any]] = conf.get("BACKENDS") or {}
    if name not in backends:
        raise ImproperlyConfigured(f"no backend named {name!r} in JOBS['BACKENDS'] (known: {', '.join(backends)})")
    return backends[name]


def engine_class(engine: str) -> type[QueueBackend]:
    path = ENGINES.get(engine, engine)
    if "." not in path:
        raise ImproperlyConfigured(
            f"unknown backend ENGINE {engine!r}; use one of {', '.join(ENGINES)} or a dotted path"
        )
    backend_class = import_string(path)
    if not (isinstance(backend_class, type) and issubclass(backend_class, QueueBackend)):
        raise ImproperlyConfigured(
            f"backend ENGINE {engine!r} is not a subclass of django_jobs.backends.base.QueueBackend"
        )
    return backend_class


def get_backend(name: str | None = None) -> QueueBackend:
    """The backend instance configured as ``name`` (the default backend when ``None``)."""
    name = name or conf.get("DEFAULT_BACKEND")
    backend = _instances.get(name)
    if backend is None:
        with _lock:
            backend = _instances.get(name)
            if backend is None:
                config = backend_config(name)
                backend = engine_class(config.get("ENGINE", "database"))(name, dict(config.get("OPTIONS") or {}))
                _instances[name] = backend
    return backend


def persistence_warning(backend: QueueBackend) -> str | None:
    """``backend.persistence_warning()``, or ``None`` when its server cannot be asked (the
    warning must never stop what asks for it: a worker starting, ``manage.py check``)."""
    try:
        return backend.persistence_warning()
    except Exception:  # unreachable or refused: not known, so not warned about
        logger.debug("backend %r: could not ask whether it keeps its jobs on disk", backend.name, exc_info=True)
        return None


def reset(close: bool = True) -> None:
    """Forget built backends (before fork, or when JOBS changes).

    ``close=False`` keeps connections open: a settings change in a test must not close the
    Django connection its transaction runs on.
    """
    with _lock:
        if close:
            for backend in _instances.values():
                backend.close()
        _instances.clear()


def _on_setting_changed(setting: str, **kwargs: Any) -> None:
    if setting == "JOBS":
        reset(close=False)


setting_changed.connect(_on_setting_changed)
