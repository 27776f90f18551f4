"""What a task's job carries: the call, the ``TASKS`` alias it was enqueued on, and when."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.utils.dateparse import parse_datetime

from ..exceptions import InvalidPayload

# The fields of a ``JobsTask`` that are django-jobs job options.
JOB_OPTIONS = ("max_retries", "timeout", "idempotency_key", "backoff")


@dataclass(frozen=True, slots=True)
class TaskPayload:
    """What a task's job carries: the call, the ``TASKS`` alias it was enqueued on, and when.
    ``options`` are the django-jobs options the enqueued task set (``max_retries``, ...): one it
    left to the ``JOBS`` defaults is absent, so the task reads back as it was enqueued."""

    args: list[Any]
    kwargs: dict[str, Any]
    backend: str
    enqueued_at: datetime | None
    run_after: datetime | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"args": self.args, "kwargs": self.kwargs, "backend": self.backend}
        if self.enqueued_at is not None:
            data["enqueued_at"] = self.enqueued_at.isoformat()
        if self.run_after is not None:
            data["run_after"] = self.run_after.isoformat()
        if self.options:
            data["options"] = self.options
        return data

    @classmethod
    def of(cls, payload: object) -> TaskPayload:
        """Read a job's payload; :class:`InvalidPayload` when it is not a task's."""
        if not isinstance(payload, dict):
            raise InvalidPayload("a task's payload must be an object")
        args, kwargs, backend = payload.get("args"), payload.get("kwargs"), payload.get("backend")
        if not isinstance(args, list) or not isinstance(kwargs, dict) or not isinstance(backend, str):
            raise InvalidPayload("a task's payload needs 'args' (a list), 'kwargs' (an object) and 'backend' (a str)")
        options = payload.get("options")
        return cls(
            args,
            kwargs,
            backend,
            _moment(payload.get("enqueued_at")),
            _moment(payload.get("run_after")),
            options if isinstance(options, dict) else {},
        )


def _moment(value: object) -> datetime | None:
    return parse_datetime(value) if isinstance(value, str) else None
