"""Scripted test jobs: one ``action`` argument decides what a run does (as Oban's test worker)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Coroutine
from typing import Any

from django_jobs import current_job, job
from django_jobs.pipeline import JobContext

from .models import SideEffect


def _record(key: str | None, db: str) -> None:
    if key:
        SideEffect.objects.using(db).create(key=key, pid=os.getpid())


@job(queue="default")
def scripted(
    action: str = "ok",
    key: str | None = None,
    db: str = "default",
    seconds: float = 0,
    fail_times: int = 0,
    **payload: object,
) -> str:
    """ok | raise | flaky (raise until ``fail_times`` runs recorded) | exit | hang | hang_masked | sleep
    | fork (a child that unwinds out of the job with sys.exit) | bad_str (an error whose str() raises)
    | unstorable (an error whose message holds U+0000 and a lone surrogate) | return_unstorable (the same,
    returned)
    | interrupt (KeyboardInterrupt from the job's own code). ``payload`` is carried and ignored
    (tests that need a message of some size or shape)."""
    _record(key, db)
    if action == "raise":
        raise RuntimeError("scripted failure")
    if action == "flaky" and SideEffect.objects.using(db).filter(key=key).count() <= fail_times:
        raise RuntimeError("flaky failure")
    if action == "exit":
        os._exit(3)
    if action == "sleep":
        time.sleep(seconds)
    if action == "hang":
        time.sleep(3600)
    if action == "fork":
        child = os.fork()
        if child == 0:
            sys.exit(0)  # the child unwinds out of the job, into whatever called it
        os.waitpid(child, 0)
    if action == "bad_str":
        raise _Unprintable()
    if action == "unstorable":  # what PostgreSQL (NUL) and any UTF-8 encoder (a lone surrogate) refuse
        raise RuntimeError("nul \x00 and half \ud800 a pair")
    if action == "return_unstorable":
        return "nul \x00 and half \ud800 a pair"
    if action == "interrupt":
        raise KeyboardInterrupt
    if action == "hang_masked":
        # Like a C call that never returns to the interpreter: no signal can interrupt it.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM, signal.SIGINT})
        time.sleep(3600)
    return action


@job(queue="default")
async def scripted_async(action: str = "ok", key: str | None = None, db: str = "default", seconds: float = 0) -> str:
    """The ``async def`` twin of :func:`scripted`, recording its runs with the async ORM: ok |
    raise | sleep (``await asyncio.sleep``; what interrupts it is recorded under
    ``<key>:interrupted:<exception class>`` before it goes on) | block (``time.sleep`` in the
    coroutine: its loop never runs) | whoami (returns what ``current_job()`` says)."""
    if key:
        await SideEffect.objects.using(db).acreate(key=key, pid=os.getpid())
    if action == "raise":
        raise RuntimeError("scripted failure")
    if action == "sleep":
        try:
            await asyncio.sleep(seconds)
        except BaseException as exc:
            await SideEffect.objects.using(db).acreate(key=f"{key}:interrupted:{type(exc).__name__}")
            raise
    if action == "block":
        time.sleep(seconds)  # noqa: ASYNC251 - blocking the event loop is the point
    if action == "whoami":
        context = current_job()
        assert context is not None
        return f"{context.job_id}:{context.attempt}"
    return action


@job(queue="default")
def scripted_later(key: str, db: str = "default") -> Coroutine[Any, Any, str]:
    """A sync function that returns a coroutine (:func:`scripted_async`'s), as a function that
    forgot its ``async`` does: the worker runs it too."""
    return scripted_async(key=key, db=db)


@job
def timed(path: str, seconds: float = 0.0) -> None:
    """Runs ``seconds``, then appends ``start end pid`` (``time.time()``) to ``path`` in one
    write: with ``O_APPEND``, lines from many processes never interleave."""
    start = time.time()
    time.sleep(seconds)
    line = f"{start:.6f} {time.time():.6f} {os.getpid()}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def abortable(context: JobContext) -> str:
    """A ``JOBS["HANDLERS"]`` handler (``abortable``) that runs until it is aborted: see
    :func:`_until_aborted`; its payload holds ``mode``, ``key`` and ``db``."""
    payload = context.payload
    return _until_aborted(context, payload.get("mode", "cooperative"), payload.get("key"), payload.get("db", "default"))


@job(queue="default")
def abortable_job(mode: str = "cooperative", key: str | None = None, db: str = "default") -> str:
    """The ``@job`` twin of :func:`abortable`: it reads its context with ``current_job()``."""
    context = current_job()
    assert context is not None, "run by a worker"
    return _until_aborted(context, mode, key, db)


def _until_aborted(context: JobContext, mode: str, key: str | None, db: str) -> str:
    """Runs until the job is aborted, as ``mode`` says: ``cooperative`` checks
    ``context.aborted`` every 0.1 s and returns; ``sleep`` sleeps in a loop of short sleeps and
    never looks (only ``JobAborted`` interrupts it); ``masked`` blocks the signals, then sleeps in
    one call that never returns to the interpreter (only the end of its process stops it). It records a run under ``key`` in ``db`` when it starts."""
    _record(key, db)
    deadline = time.monotonic() + 120  # a safety net: the tests abort it long before
    if mode == "cooperative":
        while not context.aborted and time.monotonic() < deadline:
            time.sleep(0.1)
        return "stopped"
    if mode == "masked":  # one call that never returns to the interpreter, like a stuck C call
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM})
        time.sleep(3600)
    while time.monotonic() < deadline:
        time.sleep(0.2)
    return mode


@job(queue="default")
def whoami() -> dict[str, object]:
    """What ``current_job()`` says while it runs (kept as its result)."""
    context = current_job()
    assert context is not None
    return {"job_id": context.job_id, "attempt": context.attempt, "aborted": context.aborted}


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken too")


@job
def noop() -> None:
    """Does nothing (benchmarks and throughput tests)."""


@job(queue="default")
def modules_held(path: str) -> None:
    """Writes the names of the modules its process holds, one a line, to ``path``."""
    with open(path, "w") as file:
        file.write("\n".join(sorted(sys.modules)))


calls: list[tuple] = []


@job(queue="default")
def remember(*args: object, **kwargs: object) -> None:
    """Records its call in-process (for tests that run the worker in the same process)."""
    calls.append((args, kwargs))


@job(queue="default")
def flow_step(previous: list[str] | None, key: str, db: str = "default", action: str = "ok") -> list[str]:
    """A step of a chain or group (tests of dependencies): records a run under ``key`` and
    returns ``previous`` (a parent's result in a chain that passes results) plus ``key``;
    ``action="raise"`` fails instead."""
    _record(key, db)
    if action == "raise":
        raise RuntimeError(f"step {key} failed")
    return [*(previous or []), key]
