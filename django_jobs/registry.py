"""Which handlers a message may name: ``@job`` registrations and ``JOBS["HANDLERS"]`` only.

A message can never name an arbitrary import path: anything not registered here fails with
:class:`HandlerNotAllowed`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from functools import lru_cache
from importlib import import_module
from typing import TYPE_CHECKING, Protocol, cast

from django.apps import apps
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import autodiscover_modules, import_string

from . import conf
from .exceptions import HandlerNotAllowed

if TYPE_CHECKING:
    from .pipeline import JobContext


class Handler(Protocol):
    """What a worker runs: ``handle(context)``, whose return value is ignored (an awaitable is
    run to its end first: ``async def handle`` works). A handler may also define
    ``can_retry(attempt, error) -> bool``, which has the last word on retries."""

    def handle(self, context: JobContext) -> object: ...


_registered: dict[str, Handler] = {}


def register(key: str, handler: Handler) -> None:
    """Make ``handler`` runnable under ``key`` (``@job`` calls this with the dotted path)."""
    _registered[key] = handler


def registered() -> dict[str, Handler]:
    return dict(_registered)


@lru_cache(maxsize=256)
def _load(path: str) -> object:
    return import_string(path)


class _FunctionHandler:
    """Adapts a plain ``def handler(context)`` named in ``JOBS["HANDLERS"]``."""

    def __init__(self, func: Callable[[JobContext], object]) -> None:
        self.func = func

    def handle(self, context: JobContext) -> object:
        return self.func(context)


def resolve(key: str, queue: str) -> Handler:
    """The handler for ``key`` on ``queue``, or :class:`HandlerNotAllowed`."""
    allowed = queue_allowlist(queue)
    if allowed is not None and key not in allowed:
        raise HandlerNotAllowed(f"handler {key!r} is not allowed on queue {queue!r}")
    found = _registered.get(key)
    if found is not None:
        return found
    path = conf.handlers().get(key)
    if not path:
        raise HandlerNotAllowed(f"unknown handler {key!r}: register it with @job or JOBS['HANDLERS']")
    try:
        target = _load(path)
    except ImportError as exc:
        raise HandlerNotAllowed(f"handler {key!r} points to {path!r}, which cannot be imported: {exc}") from exc
    if inspect.isclass(target):
        try:
            return cast(Handler, target())
        except Exception as exc:
            raise HandlerNotAllowed(f"handler {key!r} ({path}) cannot be instantiated: {exc!r}") from exc
    # What a setting names is trusted to be a handler object or a handler(context) function.
    if hasattr(target, "handle"):
        return cast(Handler, target)
    return _FunctionHandler(cast("Callable[[JobContext], object]", target))


def queue_allowlist(queue: str) -> list[str] | None:
    """``JOBS["QUEUE_HANDLERS"][queue]``, or ``None`` when the queue has no allowlist.

    A malformed setting raises ``ImproperlyConfigured``: a str there would otherwise be a
    substring test (``"command" in "commands"``), quietly allowing handlers nobody listed.
    """
    per_queue = conf.get("QUEUE_HANDLERS") or {}
    if not isinstance(per_queue, dict):
        raise ImproperlyConfigured(
            f"JOBS['QUEUE_HANDLERS'] must be a dict of queue -> handler keys, not a {type(per_queue).__name__}"
        )
    allowed = per_queue.get(queue)
    if allowed is None:
        return None
    problem = conf.names_problem(allowed)
    if problem:
        raise ImproperlyConfigured(f"JOBS['QUEUE_HANDLERS'][{queue!r}] {problem}")
    return list(allowed)


def autodiscover() -> None:
    """Import every installed app's ``jobs`` module and ``JOBS["IMPORTS"]``, so ``@job``
    functions are registered before a worker's first fetch (as the admin autodiscovers).

    When ``settings.TASKS`` runs ``@task`` functions on django-jobs, every app's ``tasks``
    module is imported too: a ``@task`` registers its handler when it is defined."""
    if apps.ready:
        autodiscover_modules("jobs")
        if tasks_use_django_jobs():
            autodiscover_modules("tasks")
    for module in conf.names("IMPORTS"):
        import_module(module)


TASK_BACKEND = "django_jobs.tasks.JobsTaskBackend"


def tasks_use_django_jobs() -> bool:
    """Does a ``settings.TASKS`` backend run on django-jobs (``JobsTaskBackend`` or a subclass)?

    Only then are ``tasks`` modules imported: in another project they may belong to another
    task runner, with import-time effects of their own."""
    configured = getattr(settings, "TASKS", None)
    for params in configured.values() if isinstance(configured, dict) else ():
        path = params.get("BACKEND") if isinstance(params, dict) else None
        if path == TASK_BACKEND:
            return True
        if isinstance(path, str) and path.startswith("django.tasks."):
            continue  # Django's own backends (its default among them): not imported for nothing
        try:
            backend_class = import_string(path) if isinstance(path, str) else None
        except ImportError:
            continue  # Django names the broken path when that backend is used
        # Importing a subclass of JobsTaskBackend has imported django_jobs.tasks.
        jobs_tasks = sys.modules.get("django_jobs.tasks")
        if (
            jobs_tasks is not None
            and isinstance(backend_class, type)
            and issubclass(backend_class, jobs_tasks.JobsTaskBackend)
        ):
            return True
    return False
