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
(``pip install 'django-reliable-jobs[tasks]'``) provides the same classes as ``django_tasks``.
Django ships no type information, so its task classes are typed ``Any`` here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timedelta
from importlib import import_module
from typing import TYPE_CHECKING, Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import router
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from . import conf, registry
from .api import BackoffOptions, JobBuilder
from .backends import backend_config, engine_class, get_backend
from .backends.base import QueueBackend
from .envelope import Envelope
from .exceptions import InvalidPayload
from .retry import check_delay
from .signals import job_dead_lettered, job_succeeded

if TYPE_CHECKING:
    from .models import Job, JobAttempt
    from .pipeline import JobContext


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
_tasks: Any = import_module(_PACKAGE)
_base: Any = import_module(f"{_PACKAGE}.base")
_exceptions: Any = import_module(f"{_PACKAGE}.exceptions")
_signals: Any = import_module(f"{_PACKAGE}.signals")

Task: Any = _base.Task
TaskContext: Any = _base.TaskContext
TaskError: Any = _base.TaskError
TaskResult: Any = _base.TaskResult
TaskResultStatus: Any = _base.TaskResultStatus
BaseTaskBackend: Any = import_module(f"{_PACKAGE}.backends.base").BaseTaskBackend
# Django calls it InvalidTask, the backport InvalidTaskError.
InvalidTask: Any = getattr(_exceptions, "InvalidTask", None) or _exceptions.InvalidTaskError
TaskResultDoesNotExist: Any = _exceptions.TaskResultDoesNotExist
normalize_json: Callable[[Any], Any] = import_module(
    "django.utils.json" if _PACKAGE == "django.tasks" else "django_tasks.utils"
).normalize_json

# A finished job whose last attempt is not in the attempt history yet is still being recorded
# by its worker (the settle comes first, the history right after): it is reported as running
# for at most this long, then as finished even if its history was never written.
HISTORY_GRACE = timedelta(seconds=10)
# A job on a backend with live state of its own (Redis) is, for a moment between its final
# settle there and its record in the database, in neither: a lookup that finds nothing looks
# again for this long before it answers that the result does not exist.
RECORD_WAIT = 1.0
RECORD_POLL = 0.02

_STATUS = {
    "pending": TaskResultStatus.READY,  # waiting for its first run, or for a retry
    "in_progress": TaskResultStatus.RUNNING,
    "completed": TaskResultStatus.SUCCESSFUL,
    "failed": TaskResultStatus.FAILED,
}


# -- the task class ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class JobsTask(Task):  # type: ignore[misc]
    """Django's ``Task`` with django-jobs' options: ``@task(max_retries=3, timeout=30,
    idempotency_key=..., backoff={...})`` and ``task.using(...)`` take them. ``None`` leaves an
    option to the ``JOBS`` defaults."""

    max_retries: int | None = None  # retries after the first run (total runs: max_retries + 1)
    timeout: float | None = None  # seconds one attempt may run
    idempotency_key: str | None = None  # once a run with this key succeeded, later ones are skipped
    backoff: BackoffOptions | None = field(default=None, hash=False)  # this task's retry policy

    def __post_init__(self) -> None:
        # A slotted dataclass is a new class: zero-argument super() does not work in it.
        Task.__post_init__(self)
        try:
            if self.timeout is not None:
                check_delay(self.timeout, "timeout")  # seconds, as a job's (0: no limit)
            self.job_builder({})  # the job options are refused now, not at enqueue
        except (TypeError, ValueError) as exc:
            raise InvalidTask(f"{self.module_path}: {exc}") from exc
        _register(self)

    def using(
        self,
        *,
        max_retries: int | None = None,
        timeout: float | None = None,
        idempotency_key: str | None = None,
        backoff: BackoffOptions | None = None,
        **changes: Any,
    ) -> JobsTask:
        """A copy with other defaults: Django's (``priority``, ``queue_name``, ``run_after``,
        ``backend``) and django-jobs' (``max_retries``, ``timeout``, ``idempotency_key``,
        ``backoff``)."""
        task = Task.using(self, **changes)
        ours = {"max_retries": max_retries, "timeout": timeout, "idempotency_key": idempotency_key, "backoff": backoff}
        ours = {name: value for name, value in ours.items() if value is not None}
        new: JobsTask = replace(task, **ours) if ours else task
        return new

    def job_builder(self, payload: object) -> JobBuilder:
        """The job this task sends with ``payload``: its queue, priority and options, with its
        result kept."""
        builder = (
            JobBuilder(self.module_path, payload)
            .named(self.module_path)
            .queue(self.queue_name)
            # Django's priorities (-100..100, higher first) are django-jobs' own, unchanged.
            .priority(self.priority)
            .keep_result()
        )
        if self.max_retries is not None:
            builder.max_retries(self.max_retries)
        if self.timeout is not None:
            builder.timeout(self.timeout)
        if self.idempotency_key is not None:
            builder.idempotency_key(self.idempotency_key)
        if self.backoff is not None:
            builder.backoff(**self.backoff)
        if self.run_after is not None:
            builder.scheduled_at(_aware(self.run_after))
        return builder


def _aware(moment: datetime) -> datetime:
    """``run_after`` may be naive when ``USE_TZ`` is off: it is then in the current time zone."""
    return timezone.make_aware(moment) if timezone.is_naive(moment) else moment


def _register(task: Any) -> None:
    """The worker runs ``task`` by its dotted path. A ``using()`` copy runs the same function,
    so the first definition stays registered (a reloaded module's new function replaces it)."""
    current = registry.registered().get(task.module_path)
    if not isinstance(current, TaskHandler) or current.task.func is not task.func:
        registry.register(task.module_path, TaskHandler(task))


# -- the payload --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TaskPayload:
    """What a task's job carries: the call, the ``TASKS`` alias it was enqueued on, and when."""

    args: list[Any]
    kwargs: dict[str, Any]
    backend: str
    enqueued_at: datetime | None
    run_after: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"args": self.args, "kwargs": self.kwargs, "backend": self.backend}
        if self.enqueued_at is not None:
            data["enqueued_at"] = self.enqueued_at.isoformat()
        if self.run_after is not None:
            data["run_after"] = self.run_after.isoformat()
        return data

    @classmethod
    def of(cls, payload: object) -> TaskPayload:
        """Read a job's payload; :class:`InvalidPayload` when it is not a task's."""
        if not isinstance(payload, dict):
            raise InvalidPayload("a task's payload must be an object")
        args, kwargs, backend = payload.get("args"), payload.get("kwargs"), payload.get("backend")
        if not isinstance(args, list) or not isinstance(kwargs, dict) or not isinstance(backend, str):
            raise InvalidPayload("a task's payload needs 'args' (a list), 'kwargs' (an object) and 'backend' (a str)")
        return cls(args, kwargs, backend, _moment(payload.get("enqueued_at")), _moment(payload.get("run_after")))

    def task_backend(self) -> JobsTaskBackend:
        """The ``TASKS`` backend the task was enqueued on."""
        backend = _tasks.task_backends[self.backend]
        if not isinstance(backend, JobsTaskBackend):
            raise InvalidPayload(f"TASKS[{self.backend!r}] is not a JobsTaskBackend")
        return backend


def _moment(value: object) -> datetime | None:
    return parse_datetime(value) if isinstance(value, str) else None


# -- the handler the worker runs ----------------------------------------------------------------


class TaskHandler:
    """Runs one ``@task`` function in a django-jobs worker, with Django's task signals:
    ``task_started`` before each attempt and ``task_finished`` once the task has succeeded or
    failed for good (an attempt that will be retried leaves the task ``READY``, not finished)."""

    def __init__(self, task: Any) -> None:
        self.task = task
        # Sent by the pipeline after the attempt is settled and recorded, so the result read
        # back then is final.
        job_succeeded.connect(self._finished, sender=self, weak=False)
        job_dead_lettered.connect(self._finished, sender=self, weak=False)

    def handle(self, context: JobContext) -> Any:
        """Call the task function (with a ``TaskContext`` first when it takes one) and return
        its value, normalised to JSON as Django does, for the job to keep."""
        from . import history

        payload = TaskPayload.of(context.payload)
        backend = payload.task_backend()
        record = Record(context.envelope, "in_progress", context.envelope.attempts, claimed_at=timezone.now())
        result = backend.task_result(self.task, record, current_worker=history.worker_id())
        _signals.task_started.send(type(backend), task_result=result)
        if self.task.takes_context:
            value = self.task.call(TaskContext(task_result=result), *result.args, **result.kwargs)
        else:
            value = self.task.call(*result.args, **result.kwargs)
        try:
            return normalize_json(value)
        except (TypeError, ValueError) as exc:
            raise InvalidPayload(f"the task's return value cannot be kept as JSON: {exc}") from exc

    def _finished(self, sender: TaskHandler, envelope: Envelope, **kwargs: Any) -> None:
        try:
            backend = TaskPayload.of(envelope.payload).task_backend()
        except (InvalidPayload, ImproperlyConfigured):
            return  # not a task's payload: the job was refused before the task could run
        result = backend.recorded_result(envelope.id, final=True)
        if result is not None:
            _signals.task_finished.send(type(backend), task_result=result)


# -- what storage knows about a task's job ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Record:
    """One job as storage (or the worker running it) knows it."""

    envelope: Envelope  # its message: handler, payload, queue, priority, options
    state: str  # a JobStatus value
    attempts: int  # runs counted so far, the one in progress excluded
    finished_at: datetime | None = None
    claimed_at: datetime | None = None  # when the attempt in progress started, where known
    result: Any = None  # what it returned, once completed

    @classmethod
    def of_row(cls, row: Job) -> Record:
        from .operations import envelope_of

        envelope = replace(envelope_of(row), attempts=row.attempts)
        claimed = row.updated_at if row.status == "in_progress" else None  # the claim sets it
        return cls(envelope, row.status, row.attempts, row.finished_at, claimed, row.result)


@dataclass(frozen=True, slots=True)
class AttemptLog:
    """The attempt history of a job's current round of attempts, by attempt number."""

    by_number: dict[int, JobAttempt]

    @classmethod
    def read(cls, job_id: str, using: str | None) -> AttemptLog:
        from .models import JobAttempt

        db = using or router.db_for_write(JobAttempt)  # where the worker writes it: no replica lag
        rows = list(JobAttempt.objects.using(db).filter(job_id=job_id).order_by("id"))
        # An admin retry starts the numbering again at 1 and keeps the earlier attempts: the
        # current round starts at the newest attempt 1 (or the oldest kept, once trimmed).
        start = max((i for i, row in enumerate(rows) if row.attempt == 1), default=0)
        return cls({row.attempt: row for row in rows[start:]})

    def worker_ids(self, attempts: int) -> list[str]:
        """One per attempt 1..``attempts``: ``host:pid``, or ``""`` when not known (a lost run,
        or an attempt no longer or not yet in the history)."""
        return [row.worker_id if (row := self.by_number.get(n)) else "" for n in range(1, attempts + 1)]

    def errors(self, attempts: int) -> list[Any]:
        """One ``TaskError`` per failed (or lost) attempt among 1..``attempts``."""
        rows = [self.by_number[n] for n in range(1, attempts + 1) if n in self.by_number]
        return [
            TaskError(exception_class_path=row.error_class or "builtins.Exception", traceback=row.error)
            for row in rows
            if row.outcome != "completed"
        ]

    def starts(self, attempts: int) -> list[datetime]:
        """When attempts 1..``attempts`` started, where known (lost runs are not)."""
        rows = (self.by_number.get(n) for n in range(1, attempts + 1))
        return [row.started_at for row in rows if row is not None and row.started_at is not None]


# -- the backend --------------------------------------------------------------------------------


class JobsTaskBackend(BaseTaskBackend):  # type: ignore[misc]
    """A ``TASKS`` backend that enqueues on a django-jobs backend (``OPTIONS["backend"]``, a
    ``JOBS["BACKENDS"]`` name; default ``JOBS["DEFAULT_BACKEND"]``).

    Building it does no I/O (Django builds it when a module defining a ``@task`` is imported):
    the ``supports_*`` flags depend on the engine of that backend and are read when asked.
    """

    task_class = JobsTask
    # A coroutine function runs to completion in the worker (asgiref's async_to_sync).
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
        from .backends.database import DatabaseBackend

        engine = self._engine()
        return issubclass(engine, DatabaseBackend) or _has_live_state(engine) or _runs_inline(engine)

    # -- validation --

    def validate_task(self, task: Any) -> None:
        """Django's rules, and the queue must be one of ``JOBS["QUEUES"]``."""
        super().validate_task(task)
        if task.queue_name not in conf.queues():
            raise InvalidTask(f"Queue '{task.queue_name}' is not one of JOBS['QUEUES'] ({', '.join(conf.queues())}).")

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        """``OPTIONS["backend"]`` names a usable ``JOBS`` backend; ``QUEUES`` are ``JOBS`` queues."""
        messages = list(super().check(**kwargs))
        where = f"settings.TASKS[{self.alias!r}]"
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
            raise InvalidPayload(
                f"{task.module_path}: a task's arguments must be JSON values (str, int, float, bool, None, "
                f"lists and dicts with str keys): {exc}"
            ) from exc
        payload = TaskPayload(args, kwargs, self.alias, timezone.now(), task.run_after)
        job_id = task.job_builder(payload.to_json()).dispatch(self.jobs_backend_name)
        result = _new_result(task, job_id, TaskResultStatus.READY, payload)
        _signals.task_enqueued.send(type(self), task_result=result)
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
        for _ in _record_waits(_has_live_state(type(jobs))):
            live = jobs.peek(result_id)
            if live is not None:
                task = _task_of(live.envelope.handler)
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
        from .models import Job

        jobs = self.jobs_backend
        db = jobs.history_alias or router.db_for_write(Job)
        row = Job.objects.using(db).filter(pk=job_id, backend=jobs.name).first()
        task = _task_of(row.handler) if row is not None else None
        if row is None or task is None:
            return None
        return self.task_result(task, Record.of_row(row), final=final)

    def task_result(self, task: Any, record: Record, *, final: bool = False, current_worker: str = "") -> Any:
        """The ``TaskResult`` of ``record``, with its attempt history. ``current_worker``: the
        attempt in progress runs in this process (``host:pid``), which starts it now."""
        log = AttemptLog.read(record.envelope.id, self.jobs_backend.history_alias)
        state, recorded = record.state, record.attempts
        if state in ("completed", "failed") and not (final or _recorded(record, log)):
            state, recorded = "in_progress", record.attempts - 1  # its worker is still recording it
        running = state == "in_progress"
        status = _STATUS[state]
        starts = log.starts(recorded)
        attempt_start = record.claimed_at if running else None
        payload = TaskPayload.of(record.envelope.payload)
        result = _new_result(
            _recorded_task(task, record.envelope, payload),
            record.envelope.id,
            status,
            payload,
            started_at=starts[0] if starts else attempt_start,
            last_attempted_at=attempt_start or (starts[-1] if starts else None),
            finished_at=record.finished_at
            if status in (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED)
            else None,
            errors=log.errors(recorded),
            worker_ids=log.worker_ids(recorded) + ([current_worker] if running else []),
        )
        if status == TaskResultStatus.SUCCESSFUL:
            object.__setattr__(result, "_return_value", record.result)
        return result


def _check_error(msg: str, id: str, obj: str, hint: str | None = None) -> checks.CheckMessage:
    return checks.Error(msg, hint=hint, obj=obj, id=f"django_jobs.{id}")


def _runs_inline(engine: type[QueueBackend]) -> bool:
    from .backends.sync import SyncBackend

    return issubclass(engine, SyncBackend)


def _has_live_state(engine: type[QueueBackend]) -> bool:
    """The engine holds its waiting and running jobs outside the database, and can peek at them."""
    return engine.peek is not QueueBackend.peek


def _record_waits(patient: bool) -> Iterator[float]:
    """Yields once, or (``patient``) until ``RECORD_WAIT`` seconds passed, pausing between."""
    start = time.monotonic()
    yield 0.0
    while patient and time.monotonic() - start < RECORD_WAIT:
        time.sleep(RECORD_POLL)
        yield time.monotonic() - start


def _recorded(record: Record, log: AttemptLog) -> bool:
    """Has the worker recorded the last attempt of this finished job in the history yet?"""
    return (
        record.attempts == 0  # it never ran (its idempotency key had succeeded before)
        or record.attempts in log.by_number
        or int(conf.get("HISTORY_LIMIT")) <= 0
        or (record.finished_at is not None and timezone.now() - record.finished_at > HISTORY_GRACE)
    )


def _task_of(handler: str) -> Any | None:
    """The task registered under ``handler`` (importing the ``tasks`` modules once if needed),
    or ``None`` when it is some other job's handler."""
    found = registry.registered().get(handler)
    if found is None:
        registry.autodiscover()
        found = registry.registered().get(handler)
    return found.task if isinstance(found, TaskHandler) else None


def _recorded_task(task: Any, envelope: Envelope, payload: TaskPayload) -> Any:
    """``task`` as this job was sent: its queue, priority, backend and options. Not validated
    again (settings may have changed since), so it is built field by field."""
    changes = {
        "queue_name": envelope.queue,
        "priority": envelope.priority,
        "backend": payload.backend,
        "run_after": payload.run_after,
        "max_retries": envelope.max_retries,
        "timeout": envelope.timeout,
        "idempotency_key": envelope.idempotency_key,
        "backoff": envelope.options.get("backoff"),
    }
    copy = object.__new__(type(task))
    for f in fields(task):
        object.__setattr__(copy, f.name, changes.get(f.name, getattr(task, f.name)))
    return copy


def _new_result(
    task: Any,
    job_id: str,
    status: Any,
    payload: TaskPayload,
    *,
    started_at: datetime | None = None,
    last_attempted_at: datetime | None = None,
    finished_at: datetime | None = None,
    errors: list[Any] | None = None,
    worker_ids: list[str] | None = None,
) -> Any:
    return TaskResult(
        task=task,
        id=job_id,
        status=status,
        enqueued_at=payload.enqueued_at,
        started_at=started_at,
        last_attempted_at=last_attempted_at,
        finished_at=finished_at,
        args=payload.args,
        kwargs=payload.kwargs,
        backend=payload.backend,
        errors=errors or [],
        worker_ids=worker_ids or [],
    )
