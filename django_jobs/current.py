"""The job running in this thread, for code that is not handed its context: ``@job`` and
``@task`` functions, and whatever they call.

The worker's pipeline sets it around each run (a context variable: coroutines and
``asyncio.to_thread`` calls the job starts see it too); outside a run it is ``None``, as when a
``@job`` function is called directly.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .pipeline import JobContext

running_job: ContextVar[JobContext | None] = ContextVar("django_jobs_running_job", default=None)


def current_job() -> JobContext | None:
    """The :class:`~django_jobs.pipeline.JobContext` of the job this code runs in, or ``None``
    outside a job. A long job checks ``current_job().aborted`` to stop cleanly when it is
    aborted::

        @job
        def export(report_id: int) -> None:
            for chunk in chunks(report_id):
                if (running := current_job()) and running.aborted:
                    return  # ends cancelled
                write(chunk)
    """
    return running_job.get()
