"""The handler a django-jobs worker runs for a ``@task``, and its entry in the registry."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from .. import registry
from ..envelope import Envelope
from ..exceptions import InvalidPayload
from ..signals import job_dead_lettered, job_succeeded
from .compat import TaskContext, normalize_json, task_backends, task_finished, task_started
from .payload import TaskPayload
from .results import Record

if TYPE_CHECKING:
    from ..pipeline import JobContext
    from .backend import JobsTaskBackend


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
        its value, normalised to JSON as Django does, for the job to keep. A coroutine task
        returns a coroutine that the pipeline runs (:mod:`django_jobs.coroutines`), as any
        job's."""
        from .. import history

        payload = TaskPayload.of(context.payload)
        backend = _task_backend(payload)
        record = Record(context.envelope, "in_progress", context.envelope.attempts, claimed_at=timezone.now())
        result = backend.task_result(self.task, record, current_worker=history.worker_id())
        task_started.send(type(backend), task_result=result)
        # The function itself, not Task.call(), which would run a coroutine on a loop of its own.
        if self.task.takes_context:
            value = self.task.func(TaskContext(task_result=result), *result.args, **result.kwargs)
        else:
            value = self.task.func(*result.args, **result.kwargs)
        if inspect.isawaitable(value):
            return _kept_when_done(value)
        return _kept(value)

    def _finished(
        self, sender: TaskHandler, envelope: Envelope, exception: BaseException | None = None, **kwargs: Any
    ) -> None:
        try:
            backend = _task_backend(TaskPayload.of(envelope.payload))
        except (InvalidPayload, ImproperlyConfigured):
            return  # not a task's payload: the job was refused before the task could run
        result = backend.recorded_result(envelope.id, final=True)
        if result is None:
            return
        if exception is None:
            task_finished.send(type(backend), task_result=result)
            return
        # Django's backends send it in the except block, and its receiver logs sys.exc_info():
        # the failure log line gets the exception and its traceback from there.
        traceback = exception.__traceback__
        try:
            raise exception
        except BaseException:  # noqa: BLE001 - it is the task's own, raised again to be handled here
            task_finished.send(type(backend), task_result=result)
        finally:
            exception.__traceback__ = traceback  # as the run left it


def _kept(value: Any) -> Any:
    """A task's return value, normalised to JSON as Django does."""
    try:
        return normalize_json(value)
    except (TypeError, ValueError) as exc:
        raise InvalidPayload(f"the task's return value cannot be kept as JSON: {exc}") from exc


async def _kept_when_done(awaitable: Awaitable[Any]) -> Any:
    """A coroutine task's return value, once the pipeline has run it."""
    return _kept(await awaitable)


def _task_backend(payload: TaskPayload) -> JobsTaskBackend:
    """The ``TASKS`` backend the task was enqueued on."""
    # The backend module imports this one (its task class registers a TaskHandler).
    from .backend import JobsTaskBackend

    backend = task_backends[payload.backend]
    if not isinstance(backend, JobsTaskBackend):
        raise InvalidPayload(f"TASKS[{payload.backend!r}] is not a JobsTaskBackend")
    return backend


def register(task: Any) -> None:
    """The worker runs ``task`` by its dotted path. A ``using()`` copy runs the same function,
    so the first definition stays registered (a reloaded module's new function replaces it)."""
    current = registry.registered().get(task.module_path)
    if not isinstance(current, TaskHandler) or current.task.func is not task.func:
        registry.register(task.module_path, TaskHandler(task))


def task_of(handler: str) -> Any | None:
    """The task registered under ``handler`` (importing the ``tasks`` modules once if needed),
    or ``None`` when it is some other job's handler."""
    found = registry.registered().get(handler)
    if found is None:
        registry.autodiscover()
        found = registry.registered().get(handler)
    return found.task if isinstance(found, TaskHandler) else None
