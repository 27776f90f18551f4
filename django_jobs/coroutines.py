"""Running a job that is a coroutine: what a handler returns, when it is awaitable, is run to its
end before the attempt ends (an ``async def`` job, a handler whose ``handle`` is async, a
``@task`` coroutine, or an awaitable a sync function returned).

It runs with asgiref's ``async_to_sync``, on an event loop of its own (in a thread of its own),
while the worker's thread serves its thread-sensitive ``sync_to_async`` calls: Django's async
ORM runs there, on the worker's database connection, as a sync job's queries do. The coroutine
sees the attempt's context variables (:func:`~django_jobs.current_job`).

The attempt's alarm (:mod:`django_jobs.timeouts`) is not raised in the worker's thread while the
coroutine runs: ``JobTimeout`` or ``JobAborted`` is thrown into the coroutine at the ``await`` it
waits at (at its next ``await`` when it is busy), and ends it as it ends a sync job. Code that
never awaits, or a sync call that never returns, is ended by the hard limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Generator
from typing import Any, Generic, TypeVar

from asgiref.sync import async_to_sync, iscoroutinefunction

from .timeouts import TimeLimit

T = TypeVar("T")


def is_async(func: object) -> bool:
    """Whether calling ``func`` returns a coroutine: an ``async def`` function (a method or
    ``functools.partial`` of one too) or an object whose ``__call__`` is one."""
    return iscoroutinefunction(func) or (callable(func) and iscoroutinefunction(type(func).__call__))


def run(awaitable: Awaitable[T], limit: TimeLimit) -> T:
    """Run ``awaitable`` to its end and return its result (or raise its error); an alarm of
    ``limit`` meanwhile is thrown into it. In a thread whose event loop is running it cannot
    run (``RuntimeError``): call the worker from a thread without one (``sync_to_async``)."""
    running = _Running(awaitable)
    limit.divert = running.interrupt
    try:
        return async_to_sync(running.main, force_new_loop=True)()
    finally:
        limit.divert = None
        if not running.started and inspect.iscoroutine(awaitable):
            awaitable.close()  # never started: no "never awaited" warning


class _Running(Generic[T]):
    """One awaitable on its way to its end, and the error an alarm throws into it."""

    def __init__(self, awaitable: Awaitable[T]) -> None:
        self.awaitable = awaitable
        self.started = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task[Any] | None = None
        self.pending: BaseException | None = None  # thrown in at its next await

    async def main(self) -> T:
        self.loop, self.task = asyncio.get_running_loop(), asyncio.current_task()
        if self.pending is not None:  # the alarm went off before the loop began: it never starts
            raise self.pending
        self.started = True
        return await self

    def interrupt(self, error: BaseException) -> None:
        """The worker's thread, in the alarm's handler: throw ``error`` into the coroutine."""
        self.pending = error
        loop = self.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: the coroutine ended
                loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        """The loop's thread: cancel the wait the coroutine is in; :meth:`__await__` throws the
        pending error in instead of the cancellation."""
        if self.pending is not None and self.task is not None and not self.task.done():
            self.task.cancel()

    def __await__(self) -> Generator[Any, Any, T]:
        """Step the awaitable as ``yield from`` would, but throw in the pending error where the
        task's cancellation (by :meth:`_wake`) arrives."""
        steps = self.awaitable.__await__()
        sent: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = steps.send(sent) if error is None else steps.throw(error)
            except StopIteration as done:
                result: T = done.value
                return result
            sent, error = None, None
            try:
                sent = yield step
            except GeneratorExit:
                steps.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - passed on into the awaitable
                error = self._instead(exc)

    def _instead(self, error: BaseException) -> BaseException:
        """What to throw into the awaitable for ``error``: the pending error for the
        cancellation :meth:`_wake` asked for, else ``error`` itself."""
        pending = self.pending
        if pending is None or not isinstance(error, asyncio.CancelledError) or self.task is None:
            return error
        self.pending = None
        self.task.uncancel()  # the task was not cancelled: its awaitable was interrupted
        return pending
