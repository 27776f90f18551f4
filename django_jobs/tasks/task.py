"""``JobsTask``: Django's ``Task`` with django-jobs' job options."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from django.utils import timezone

from ..api import BackoffOptions, JobBuilder, argument_problem
from ..retry import check_delay
from .compat import InvalidTask, Task
from .handler import register
from .payload import JOB_OPTIONS


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
        register(self)

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

    def job_options(self) -> dict[str, Any]:
        """The django-jobs options this task sets; the others are left to the ``JOBS`` defaults."""
        options = {name: getattr(self, name) for name in JOB_OPTIONS}
        return {name: value for name, value in options.items() if value is not None}

    def argument_problem(self, payload: Any) -> str | None:
        """Which argument of a refused call (``{"args", "kwargs"}``) cannot travel as JSON, named
        as for a ``@job`` call; ``None`` when no argument is at fault."""
        signature = inspect.signature(self.func)
        if self.takes_context:  # the worker passes the context first
            signature = signature.replace(parameters=list(signature.parameters.values())[1:])
        return argument_problem(self.module_path, signature, payload)

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
            .calls(self.argument_problem)
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
