"""django-jobs: background jobs for Django that never lose work."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["JobBuilder", "Jobs", "QueueWorker", "RetryPolicy", "chain", "current_job", "group", "job"]

if TYPE_CHECKING:
    from .api import JobBuilder, Jobs, job
    from .current import current_job
    from .flows import chain, group
    from .retry import RetryPolicy
    from .worker import QueueWorker


def __getattr__(name: str) -> Any:
    # Lazy, so "import django_jobs" works before Django's app registry is ready.
    if name in ("Jobs", "job", "JobBuilder"):
        from . import api

        return getattr(api, name)
    if name in ("chain", "group"):
        from . import flows

        return getattr(flows, name)
    if name == "current_job":
        from .current import current_job

        return current_job
    if name == "RetryPolicy":
        from .retry import RetryPolicy

        return RetryPolicy
    if name == "QueueWorker":
        from .worker import QueueWorker

        return QueueWorker
    raise AttributeError(f"module 'django_jobs' has no attribute {name!r}")
