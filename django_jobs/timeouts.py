"""Per-attempt time limits, and the end of an aborted attempt.

Soft limit: ``SIGALRM`` raises :class:`JobTimeout` inside the job (main thread only); it stops
Python code and interruptible calls such as ``time.sleep``. Hard limit: a job stuck where no
signal reaches it (a C call, masked signals) is settled as failed by the heartbeat thread,
which then ends the process; the ``jobs_work`` supervisor starts a fresh one.

An abort uses the same alarm: once asked (from the heartbeat thread), the alarm goes off within
the grace and raises :class:`JobAborted` instead; past that, the heartbeat ends the process.

While a coroutine job runs, the alarm raises nothing in this thread: its error goes to
:attr:`TimeLimit.divert`, which throws it into the coroutine (:mod:`django_jobs.coroutines`).

The alarm costs an attempt nothing it does not need. Only the main thread may install a signal
handler, and installing one is a large part of a short job's cost, so the handler is installed
for a whole worker loop (:func:`install_alarm_handler`, whose heartbeat can pass an abort on at any
time) or, outside one, by an attempt that has a timeout, for its run. An attempt without a
timeout only marks itself as the one the alarm interrupts; the timer itself is set only when a
timeout or an abort needs it.
"""

from __future__ import annotations

import signal
import threading
from _signal import getsignal as _handler_of  # type: ignore[import-not-found]  # no enum lookup
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, Self

from .exceptions import JobAborted, JobTimeout

# Seconds past the soft limit before the hard limit acts.
HARD_TIMEOUT_GRACE = 2.0
_CAN_SET_TIMERS = hasattr(signal, "setitimer")

# An attempt's state, as an abort sees it.
_BEFORE, _RUNNING, _ENDED = 0, 1, 2
# The attempts' starts and ends (main thread) against aborts (the heartbeat thread).
_lock = threading.Lock()
# The attempt the alarm interrupts (main thread only); ``None`` between attempts.
_current: TimeLimit | None = None
# How many worker loops have the handler installed (install_alarm_handler).
_scopes = 0
# ``TimeLimit._previous`` of a block that installed no handler of its own.
_KEPT: Any = object()


def _can_alarm() -> bool:
    return _CAN_SET_TIMERS and threading.get_ident() == threading.main_thread().ident


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    limit = _current
    if limit is not None:  # else the attempt ended as the alarm went off: nothing to interrupt
        limit.expired()


def attempt_running() -> bool:
    """Main thread: is an attempt running in a block the alarm can interrupt (any attempt of a
    worker loop)? A signal handler that sees one may raise into it."""
    limit = _current
    return limit is not None and limit._state == _RUNNING


def install_alarm_handler() -> Callable[[], None]:
    """Install the alarm's handler for a whole worker loop (``QueueWorker.run``), so that its
    attempts need not install one each and an abort can interrupt any of them; returns what
    puts the previous handler back. Outside the main thread it does nothing."""
    global _scopes
    if not _can_alarm():
        return lambda: None
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    _scopes += 1

    def restore() -> None:
        global _scopes
        _scopes -= 1
        if previous is not None:  # None: not installed from Python, and cannot be put back
            signal.signal(signal.SIGALRM, previous)

    return restore


class TimeLimit:
    """``with TimeLimit(seconds):`` raises :class:`JobTimeout` in the block after ``seconds``
    (no limit when ``None``), or :class:`JobAborted` once :meth:`abort` was called. Outside the
    main thread (or without ``setitimer``) it does nothing; an abort then only reaches the job
    through its context, and the heartbeat's hard limit."""

    __slots__ = ("_grace", "_interrupts", "_previous", "_state", "aborted_by", "divert", "seconds")

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds if seconds and seconds > 0 else None
        # Who asked to abort the attempt, set only before it ended (:meth:`abort`).
        self.aborted_by: str | None = None
        # Where the alarm's error goes instead of being raised here (a coroutine job, while it runs).
        self.divert: Callable[[BaseException], None] | None = None
        self._grace = 0.0
        self._state = _BEFORE
        self._interrupts = False  # the alarm can interrupt this block: its handler is installed
        self._previous: Any = _KEPT  # the handler this block replaced (a timeout outside a loop)

    def __enter__(self) -> Self:
        global _current
        if (self.seconds is None and not _scopes) or not _can_alarm():
            self._state = _RUNNING  # no alarm can interrupt it: an abort reaches its context only
            return self
        if not _scopes:  # a timeout outside a worker loop: the handler is installed for this run
            self._previous = signal.signal(signal.SIGALRM, _on_alarm)
        with _lock:
            self._state, self._interrupts, _current = _RUNNING, True, self
            delay = self.seconds
            if self.aborted_by is not None:  # asked before the block began
                delay = min(delay or self._grace, self._grace)
            if delay is not None:
                signal.setitimer(signal.ITIMER_REAL, max(delay, 0.001))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        global _current
        with _lock:
            self._state = _ENDED
            if self._interrupts:
                _current = None
                if self.seconds is not None or self.aborted_by is not None:  # a timer may be set
                    signal.setitimer(signal.ITIMER_REAL, 0)
        if self._previous is not _KEPT:
            if self._previous is not None:  # None: not installed from Python, and cannot be put back
                signal.signal(signal.SIGALRM, self._previous)
        elif self._interrupts and _handler_of(signal.SIGALRM) is not _on_alarm:
            signal.signal(signal.SIGALRM, _on_alarm)  # the job replaced the loop's handler: back for the next

    def end(self) -> None:
        """The attempt will not run (it was aborted before it started): a later abort is moot."""
        with _lock:
            self._state = _ENDED

    def abort(self, requested_by: str, grace: float, then: Callable[[], None] | None = None) -> bool:
        """Any thread: raise :class:`JobAborted` in the block within ``grace`` seconds (at once
        when ``grace`` is 0), unless it ends first. A timeout due earlier fires as an abort.

        Returns ``False``, and does nothing, once the block has ended: the attempt ended on its
        own. Otherwise ``then`` is called before the block can end (under the lock it takes)."""
        with _lock:
            if self._state == _ENDED:
                return False
            self.aborted_by, self._grace = requested_by, grace
            if self._state == _RUNNING and self._interrupts:
                left, _ = signal.getitimer(signal.ITIMER_REAL)
                if left == 0 or left > grace:
                    signal.setitimer(signal.ITIMER_REAL, max(grace, 0.001))
            if then is not None:
                then()
            return True

    def expired(self) -> None:
        """The alarm went off in the block: raise what ends it, or hand it to :attr:`divert`."""
        if self.aborted_by is not None:
            error: BaseException = JobAborted(
                f"{JobAborted.describe(self.aborted_by)}: still running after the abort grace"
            )
        else:
            error = JobTimeout(f"attempt exceeded its {self.seconds or 0:g}s timeout")
        if self.divert is not None:
            self.divert(error)
            return
        raise error
