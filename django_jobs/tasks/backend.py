"""``JobsTaskBackend``: the ``TASKS`` backend that enqueues ``@task`` calls as django-jobs jobs
and reads their results back."""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import router
from django.utils import timezone

from .. import conf
from ..backends import backend_config, engine_class, get_backend
from ..backends.base import QueueBackend
from ..exceptions import InvalidArguments
from .compat import (
    BaseTaskBackend,
    InvalidTask,
    TaskResultDoesNotExist,
    TaskResultStatus,
    normalize_json,
    task_enqueued,
)
from .handler import task_of
from .payload import TaskPayload
from .results import Record, new_result, record_waits, result_of
from .task import JobsTask


class JobsTaskBackend(BaseTaskBackend):  # type: ignore[misc]
    """A ``TASKS`` backend that enqueues on a django-jobs backend (``OPTIONS["backend"]``, a
    ``JOBS["BACKENDS"]`` name; default ``JOBS["DEFAULT_BACKEND"]``).

    Building it does no I/O (Django builds it when a module defining a ``@task`` is imported):
    the ``supports_*`` flags depend on the engine of that backend and are read when asked.
    """

    task_class = JobsTask
    # A coroutine function runs to completion in the worker (django_jobs.coroutines).
    supports_async_task = True

    @property
    def jobs_backend_name(self) -> str:
        """The ``JOBS["BACKENDS"]`` name tasks are enqueued on."""
        name: str = self.options.get("backend") or conf.get("DEFAULT_BACKEND")
        return name

    @property
    def jobs_backend(self) -> QueueBackend:
        return get_backend(self.jobs_backend_name)

    def _engine(self) -> type[QueueBackend]:
        return engine_class(backend_config(self.jobs_backend_name).get("ENGINE", "database"))

    @property
    def supports_defer(self) -> bool:
        """``run_after``: every engine that can hold a job back (all but sync)."""
        return self._engine().supports_delay

    @property
    def supports_priority(self) -> bool:
        """Engines that fetch by priority; and sync, which runs each task at once (as Django's
        ``ImmediateBackend``), so no task ever waits behind a lower one."""
        engine = self._engine()
        return engine.supports_priority or _runs_inline(engine)

    @property
    def supports_get_result(self) -> bool:
        """Where a result can be read by id from any process: the database engine (the job's
        own row), engines that can look a message up by id (Redis) and sync (a task has run and
        been recorded by the time its enqueue returns, or its transaction commits). Brokers
        that cannot find a waiting message by id (beanstalkd, Service Bus) cannot."""
        from ..backends.database import DatabaseBackend

        engine = self._engine()
        return issubclass(engine, DatabaseBackend) or _has_live_state(engine) or _runs_inline(engine)

    # -- validation --

    def validate_task(self, task: Any) -> None:
        """Django's rules, and the queue must be one of ``JOBS["QUEUES"]``."""
        super().validate_task(task)
        if task.queue_name not in conf.queues():
            raise InvalidTask(f"Queue '{task.queue_name}' is not one of JOBS['QUEUES'] ({', '.join(conf.queues())}).")

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        """``django_jobs`` is installed; ``OPTIONS["backend"]`` names a usable ``JOBS`` backend;
        ``QUEUES`` are ``JOBS`` queues."""
        messages = list(super().check(**kwargs))
        where = f"settings.TASKS[{self.alias!r}]"
        if not apps.is_installed("django_jobs"):
            hint = "Add 'django_jobs' to INSTALLED_APPS: its models keep the jobs, their results and history"
            messages.append(
                _check_error(f"{where} uses django-jobs, which is not an installed app", "T004", where, hint)
            )
        unknown = sorted(set(self.options) - {"backend"})
        if unknown:
            messages.append(_check_error(f"{where}['OPTIONS'] has unknown keys: {', '.join(unknown)}", "T001", where))
        name = self.jobs_backend_name
        try:
            self._engine()
        except (ImproperlyConfigured, ImportError) as exc:
            hint = "OPTIONS['backend'] must name one of JOBS['BACKENDS'] (default: JOBS['DEFAULT_BACKEND'])"
            messages.append(_check_error(f"{where} enqueues on JOBS backend {name!r}: {exc}", "T002", where, hint))
        try:
            known = set(conf.queues())
        except ImproperlyConfigured:
            return messages  # django-jobs' own checks report a malformed JOBS["QUEUES"]
        for queue in sorted(self.queues - known):
            messages.append(
                _check_error(f"{where}['QUEUES'] names {queue!r}, which is not in JOBS['QUEUES']", "T003", where)
            )
        return messages

    # -- enqueue --

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        """Dispatch ``task(*args, **kwargs)`` as a job; the result is ``READY``, its id the job's."""
        self.validate_task(task)
        if not isinstance(task, JobsTask):
            raise InvalidTask(f"{task.module_path}: define it with @task(backend={self.alias!r}) to enqueue it here")
        try:
            args, kwargs = normalize_json(list(args)), normalize_json(dict(kwargs))
        except (TypeError, ValueError) as exc:
            named = task.argument_problem({"args": list(args), "kwargs": dict(kwargs)})
            raise InvalidArguments(
                f"{named}. {exc}"
                if named
                else f"{task.module_path}: a task's arguments must be JSON values (str, int, float, bool, None, "
                f"lists and dicts with str keys): {exc}"
            ) from exc
        payload = TaskPayload(args, kwargs, self.alias, timezone.now(), task.run_after, task.job_options())
        job_id = task.job_builder(payload.to_json()).dispatch(self.jobs_backend_name)
        result = new_result(task, job_id, TaskResultStatus.READY, payload)
        task_enqueued.send(type(self), task_result=result)
        return result

    # -- results --

    def get_result(self, result_id: str) -> Any:
        """The task's result as recorded now, from any process; ``TaskResultDoesNotExist`` for
        an id that is not a task's job of this backend."""
        if not self.supports_get_result:
            raise NotImplementedError(
                f"JOBS backend {self.jobs_backend_name!r} cannot look a job up by id, so its tasks' "
                "results cannot be retrieved (see docs/tasks.md)"
            )
        jobs = self.jobs_backend
        for _ in record_waits(_has_live_state(type(jobs))):
            live = jobs.peek(result_id)
            if live is not None:
                task = task_of(live.envelope.handler)
                if task is None:
                    break  # another job's id
                return self.task_result(task, Record(live.envelope, live.state, live.envelope.attempts))
            found = self.recorded_result(result_id)
            if found is not None:
                return found
        raise TaskResultDoesNotExist(result_id)

    def recorded_result(self, job_id: str, *, final: bool = False) -> Any | None:
        """The result of ``job_id`` from its ``Job`` row (the database engine's job, or any
        engine's record of a finished one) and its history; ``None`` when there is none, or it
        is not a task. ``final``: the caller knows the job has finished (its worker)."""
        from ..models import Job

        jobs = self.jobs_backend
        db = jobs.history_alias or router.db_for_write(Job)
        row = Job.objects.using(db).filter(pk=job_id, backend=jobs.name).first()
        task = task_of(row.handler) if row is not None else None
        if row is None or task is None:
            return None
        return self.task_result(task, Record.of_row(row), final=final)

    def task_result(self, task: Any, record: Record, *, final: bool = False, current_worker: str = "") -> Any:
        """The ``TaskResult`` of ``record``, with its attempt history. ``current_worker``: the
        attempt in progress runs in this process (``host:pid``), which starts it now."""
        return result_of(task, record, self.jobs_backend.history_alias, final=final, current_worker=current_worker)


def _check_error(msg: str, id: str, obj: str, hint: str | None = None) -> checks.CheckMessage:
    return checks.Error(msg, hint=hint, obj=obj, id=f"django_jobs.{id}")


def _runs_inline(engine: type[QueueBackend]) -> bool:
    from ..backends.sync import SyncBackend

    return issubclass(engine, SyncBackend)


def _has_live_state(engine: type[QueueBackend]) -> bool:
    """The engine holds its waiting and running jobs outside the database, and can peek at them."""
    return engine.peek is not QueueBackend.peek
