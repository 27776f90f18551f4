"""Django's task API, from wherever this Django has it.

Django 6 ships it as ``django.tasks``; on Django 5.2 the ``django-tasks`` backport
(``pip install 'django-reliable-jobs[tasks]'``) provides the same classes as ``django_tasks``.
Django ships no type information, so its task classes are typed ``Any`` here.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

from django.core.exceptions import ImproperlyConfigured


def _tasks_package() -> str:
    """``django.tasks`` (Django 6), else the ``django_tasks`` backport (Django 5.2)."""
    for name in ("django.tasks", "django_tasks"):
        try:
            import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the package is there but broken: say so
                raise
            continue
        return name
    raise ImproperlyConfigured(
        "django_jobs.tasks needs django.tasks (Django 6) or, on Django 5.2, its backport: "
        "pip install 'django-reliable-jobs[tasks]'"
    )


_PACKAGE = _tasks_package()
_base: Any = import_module(f"{_PACKAGE}.base")
_exceptions: Any = import_module(f"{_PACKAGE}.exceptions")
_signals: Any = import_module(f"{_PACKAGE}.signals")

task_backends: Any = import_module(_PACKAGE).task_backends
Task: Any = _base.Task
TaskContext: Any = _base.TaskContext
TaskError: Any = _base.TaskError
TaskResult: Any = _base.TaskResult
TaskResultStatus: Any = _base.TaskResultStatus
BaseTaskBackend: Any = import_module(f"{_PACKAGE}.backends.base").BaseTaskBackend
# Django calls it InvalidTask, the backport InvalidTaskError.
InvalidTask: Any = getattr(_exceptions, "InvalidTask", None) or _exceptions.InvalidTaskError
TaskResultDoesNotExist: Any = _exceptions.TaskResultDoesNotExist
task_enqueued: Any = _signals.task_enqueued
task_started: Any = _signals.task_started
task_finished: Any = _signals.task_finished
normalize_json: Callable[[Any], Any] = import_module(
    "django.utils.json" if _PACKAGE == "django.tasks" else "django_tasks.utils"
).normalize_json
