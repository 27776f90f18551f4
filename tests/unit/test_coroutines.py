"""Running a coroutine job (``django_jobs.coroutines``): to its end, on an event loop of its own,
with the attempt's context variables; its thread-sensitive sync calls on the calling thread; the
attempt's alarm thrown into it, at the ``await`` it waits at. And what ``@job`` says of an
``async def`` function, or refuses, when it decorates it."""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import pytest
from asgiref.sync import async_to_sync, iscoroutinefunction, sync_to_async

from django_jobs import coroutines, job
from django_jobs.exceptions import JobAborted, JobTimeout
from django_jobs.timeouts import TimeLimit, install_alarm_handler
from tests.testapp.jobs import scripted, scripted_async

LONG = 30  # a sleep the alarm must interrupt; the test fails by timing out, not by passing
attempt_var: ContextVar[str] = ContextVar("attempt_var", default="unset")


@pytest.fixture
def worker_loop() -> Iterator[None]:
    """The alarm's handler installed as ``QueueWorker.run`` installs it for its loop."""
    restore = install_alarm_handler()
    yield
    restore()


async def sleeper(seen: list[str]) -> str:
    """Sleeps; notes what interrupted it, then whether anything of it ran on."""
    try:
        await asyncio.sleep(LONG)
    except BaseException as exc:
        seen.append(type(exc).__name__)
        raise
    seen.append("woke")
    return "slept"


def test_a_coroutine_runs_to_its_end_with_the_callers_context_and_its_sync_calls_on_the_callers_thread():
    caller = threading.get_ident()

    async def body() -> tuple[str, bool, bool]:
        on_caller = await sync_to_async(lambda: threading.get_ident() == caller)()
        return attempt_var.get(), threading.get_ident() != caller, on_caller

    token = attempt_var.set("attempt 1")
    try:
        assert coroutines.run(body(), TimeLimit(None)) == ("attempt 1", True, True)
    finally:
        attempt_var.reset(token)


def test_a_timeout_is_thrown_into_the_coroutine_where_it_waits_and_nothing_of_it_runs_on():
    seen: list[str] = []
    limit = TimeLimit(0.5)  # past the loop's start, even on a loaded machine

    with pytest.raises(JobTimeout, match="exceeded its 0.5s timeout"), limit:
        coroutines.run(sleeper(seen), limit)

    assert seen == ["JobTimeout"]  # raised inside it, where it awaited; the coroutine is over
    assert limit.divert is None


def test_a_timeout_reaches_a_coroutine_waiting_on_a_sync_call_and_the_call_ends_first():
    seen: list[str] = []
    limit, release = TimeLimit(0.5), threading.Event()

    async def body() -> None:
        try:
            await sync_to_async(release.wait)(LONG)
        except BaseException as exc:
            seen.append(type(exc).__name__)
            release.set()  # the sync call in the caller's thread returns now
            raise

    with pytest.raises(JobTimeout), limit:
        coroutines.run(body(), limit)

    assert seen == ["JobTimeout"]


@pytest.mark.usefixtures("worker_loop")
def test_an_abort_from_another_thread_is_thrown_into_the_coroutine_after_the_grace():
    seen: list[str] = []
    limit = TimeLimit(None)

    with pytest.raises(JobAborted, match="Aborted by boss \\(admin\\)"), limit:
        threading.Timer(0.5, limit.abort, args=("admin:boss", 0.01)).start()
        coroutines.run(sleeper(seen), limit)

    assert seen == ["JobAborted"]


def test_a_coroutine_that_catches_the_timeout_ends_as_it_chooses():
    limit = TimeLimit(0.5)  # past the loop's start, even on a loaded machine: the timeout hits the sleep

    async def body() -> str:
        try:
            await asyncio.sleep(LONG)
        except JobTimeout:
            await asyncio.sleep(0)  # its task was not left cancelled: it can still await
            return "cleaned up"
        return "slept"

    with limit:
        assert coroutines.run(body(), limit) == "cleaned up"


def test_an_alarm_before_the_loop_begins_ends_the_run_and_the_coroutine_never_starts():
    seen: list[str] = []
    coroutine = sleeper(seen)
    running = coroutines._Running(coroutine)
    running.interrupt(JobTimeout("early"))  # the loop does not exist yet: kept for its start

    with pytest.raises(JobTimeout, match="early"):
        async_to_sync(running.main, force_new_loop=True)()

    assert not running.started and seen == []
    coroutine.close()


def test_in_a_thread_whose_loop_runs_it_refuses_and_closes_the_coroutine():
    seen: list[str] = []

    async def caller() -> None:
        coroutine = sleeper(seen)
        with pytest.raises(RuntimeError, match="event loop"):
            coroutines.run(coroutine, TimeLimit(None))
        assert inspect.getcoroutinestate(coroutine) == inspect.CORO_CLOSED

    asyncio.run(caller())
    assert seen == []


# -- @job on async def ---------------------------------------------------------------------------


class Callable:
    async def __call__(self) -> None: ...


async def coroutine_function(x: int) -> int:
    return x


def test_async_callables_are_told_from_sync_ones():
    assert coroutines.is_async(coroutine_function)
    assert coroutines.is_async(functools.partial(coroutine_function, 1))
    assert coroutines.is_async(Callable())
    assert not coroutines.is_async(scripted.func) and not coroutines.is_async(print)


def test_job_marks_an_async_def_function_as_a_coroutine_function():
    assert scripted_async.is_async and iscoroutinefunction(scripted_async)
    assert not scripted.is_async and not iscoroutinefunction(scripted)


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_job_refuses_a_generator_function_whose_body_would_never_run(kind: str):
    def generator() -> Iterator[int]:
        yield 1

    async def async_generator() -> Any:
        yield 1

    with pytest.raises(TypeError, match="generator function"):
        job(generator if kind == "def" else async_generator)
