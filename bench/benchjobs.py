"""The no-op units of work the benchmark dispatches and drains.

``noop_job`` is a django-jobs ``@job``; ``noop_task`` is a ``django.tasks``
``@task`` enqueued through django-tasks-db. Each is defined only when its
system is the one under test (BENCH_SYSTEM, see settings.py), so a
django-tasks-db run never imports django_jobs and the other way round.
"""

import os

SYSTEM = os.environ.get("BENCH_SYSTEM", "jobs")

if SYSTEM == "jobs":
    from django_jobs import job

    @job
    def noop_job() -> None:
        """Does nothing: the benchmark measures the queue, not the work."""


if SYSTEM == "tasksdb":
    from django.tasks import task

    @task
    def noop_task() -> None:
        """Does nothing: the benchmark measures the queue, not the work."""
