"""Django's task API on django-jobs: ``JobsTaskBackend`` runs ``@task`` functions as jobs.

::

    TASKS = {
        "default": {
            "BACKEND": "django_jobs.tasks.JobsTaskBackend",
            "QUEUES": [],
            "OPTIONS": {"backend": "default"},  # a JOBS["BACKENDS"] name (default: DEFAULT_BACKEND)
        }
    }

An enqueued task is a django-jobs job like any other (signed, leased, retried, dead-lettered,
shown in the admin): its handler is the task's dotted path, its payload the task's arguments
and when it was enqueued, and it keeps its result. A ``@task`` registers its handler when it is
defined; a worker finds it by importing every app's ``tasks`` module.

Django 6 ships the API as ``django.tasks``; on Django 5.2 the ``django-tasks`` backport
(``pip install 'django-reliable-jobs[tasks]'``) provides the same classes as ``django_tasks``
(:mod:`.compat` picks one).

- :mod:`.compat`: Django's task classes, signals and exceptions, from either package.
- :mod:`.task`: ``JobsTask``, Django's ``Task`` with django-jobs' job options.
- :mod:`.payload`: what a task's job carries.
- :mod:`.handler`: ``TaskHandler``, what a worker runs for a task, and its registration.
- :mod:`.results`: a task's job and attempt history read into a ``TaskResult``.
- :mod:`.backend`: ``JobsTaskBackend``, the ``TASKS`` backend.
"""

from .backend import JobsTaskBackend
from .compat import (
    BaseTaskBackend,
    InvalidTask,
    Task,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    normalize_json,
)
from .handler import TaskHandler
from .payload import TaskPayload
from .results import HISTORY_GRACE, RECORD_POLL, RECORD_WAIT, AttemptLog, Record
from .task import JobsTask

__all__ = [
    "HISTORY_GRACE",
    "RECORD_POLL",
    "RECORD_WAIT",
    "AttemptLog",
    "BaseTaskBackend",
    "InvalidTask",
    "JobsTask",
    "JobsTaskBackend",
    "Record",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskHandler",
    "TaskPayload",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "normalize_json",
]
