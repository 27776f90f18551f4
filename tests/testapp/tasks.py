"""``@task`` functions for the django.tasks tests, run by ``JobsTaskBackend`` (settings.TASKS).

Workers import this module by autodiscovery. Its signal receivers note every ``task_started`` and
``task_finished`` of these tasks as a ``SideEffect`` row (``started:<id>:<status>:<errors>``, with
the attempt count and the pid), in the database where the task's job is recorded, so a test sees
what a worker process sent.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from django.dispatch import receiver

try:
    from django.tasks import task
    from django.tasks.signals import task_finished, task_started
except ImportError:  # Django 5.2: the backport
    from django_tasks import task
    from django_tasks.signals import task_finished, task_started

from django_jobs import current_job

from .models import SideEffect


class FlakyError(Exception):
    pass


class DoomedError(Exception):
    pass


@task
def add(x: int, y: int = 0) -> int:
    return x + y


@task
def echo(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"args": list(args), "kwargs": kwargs}


@task(takes_context=True, max_retries=3, backoff={"strategy": "none"})
def flaky(context: Any, fail_times: int) -> int:
    """Fails its first ``fail_times`` attempts; returns the attempt that succeeded."""
    if context.attempt <= fail_times:
        raise FlakyError(f"attempt {context.attempt} failed")
    return int(context.attempt)


@task(max_retries=1, backoff={"strategy": "none"})
def doomed(message: str) -> None:
    raise DoomedError(message)


@task
def unkeepable() -> object:
    """Returns what JSON cannot hold."""
    return {1, 2}


@task
async def async_add(x: int, y: int) -> int:
    await asyncio.sleep(0)
    return x + y


@task
def record(key: str, db: str = "default") -> int:
    """One ``SideEffect`` row per run, in run order; returns the pid that ran it."""
    SideEffect.objects.using(db).create(key=key, pid=os.getpid())
    return os.getpid()


@task
def hold(key: str, db: str = "default", limit: float = 60.0) -> str:
    """Notes ``<key>:started``, then runs until a ``<key>:go`` row exists (at most ``limit`` s)."""
    SideEffect.objects.using(db).create(key=f"{key}:started", pid=os.getpid())
    deadline = time.monotonic() + limit
    while not SideEffect.objects.using(db).filter(key=f"{key}:go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key}: never released")
        time.sleep(0.05)
    return "released"


@task
def whoami() -> str:
    """The id of the job running it, as ``django_jobs.current_job()`` says."""
    context = current_job()
    assert context is not None
    return context.job_id


@task
async def async_whoami() -> str:
    """The same from a coroutine (the context variable reaches it)."""
    await asyncio.sleep(0)
    context = current_job()
    assert context is not None
    return context.job_id


@task(timeout=0.2, max_retries=0)
async def async_nap(key: str, db: str = "default") -> str:
    """Sleeps far past its timeout; notes ``<key>:<exception class>`` when interrupted, and
    ``<key>:woke`` if it ever wakes."""
    try:
        await asyncio.sleep(30)
    except BaseException as exc:
        await SideEffect.objects.using(db).acreate(key=f"{key}:{type(exc).__name__}")
        raise
    await SideEffect.objects.using(db).acreate(key=f"{key}:woke")
    return "woke"


def _note(kind: str, task_result: Any) -> None:
    if not task_result.task.module_path.startswith(f"{__name__}."):
        return
    db = task_result.task.get_backend().jobs_backend.history_alias or "default"
    key = f"{kind}:{task_result.id}:{task_result.status}:{len(task_result.errors)}"
    SideEffect.objects.using(db).create(key=key, attempt=task_result.attempts, pid=os.getpid())


@receiver(task_started)
def note_started(sender: Any, task_result: Any, **kwargs: Any) -> None:
    _note("started", task_result)


@receiver(task_finished)
def note_finished(sender: Any, task_result: Any, **kwargs: Any) -> None:
    _note("finished", task_result)
