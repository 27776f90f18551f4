"""The per-attempt alarm (``django_jobs.timeouts``): a timeout raises ``JobTimeout`` in the block;
an abort, asked from any thread, raises ``JobAborted`` within its grace. The alarm's handler is
installed only where it is needed: by a block with a timeout, or once for a worker loop."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import pytest

from django_jobs.exceptions import JobAborted, JobTimeout
from django_jobs.timeouts import TimeLimit, install_alarm_handler

LONG = 30  # a sleep the alarm must interrupt; the test fails by timing out, not by passing


@pytest.fixture
def worker_loop() -> Iterator[None]:
    """The alarm's handler installed as ``QueueWorker.run`` installs it for its loop."""
    restore = install_alarm_handler()
    yield
    restore()


def test_a_timeout_raises_job_timeout_in_the_block():
    with pytest.raises(JobTimeout, match="exceeded its 0.01s timeout"), TimeLimit(0.01):
        time.sleep(LONG)


@pytest.mark.usefixtures("worker_loop")
def test_an_abort_from_another_thread_raises_job_aborted_within_the_grace():
    limit = TimeLimit(None)
    # A grace long enough for the thread's start to return first on a loaded machine: the alarm
    # raises where the block is, and inside Thread.start() it broke the thread's own lock.
    with pytest.raises(JobAborted, match="Aborted by boss \\(admin\\)"), limit:
        threading.Thread(target=limit.abort, args=("admin:boss", 0.5)).start()
        time.sleep(LONG)


def test_an_abort_asked_before_the_block_fires_once_it_starts():
    limit = TimeLimit(LONG)
    assert limit.abort("ops", 0.01)
    with pytest.raises(JobAborted, match="Aborted by ops"), limit:
        time.sleep(LONG)


def test_an_earlier_timeout_stands_and_fires_as_the_abort():
    limit = TimeLimit(0.01)
    with pytest.raises(JobAborted), limit:
        limit.abort("ops", LONG)
        time.sleep(LONG)


def test_an_abort_after_the_block_is_refused_arms_nothing_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGALRM)
    limit, then = TimeLimit(0.5), []
    with limit:
        pass

    assert limit.abort("ops", 0.01, lambda: then.append("called")) is False
    assert (limit.aborted_by, then) == (None, [])  # the attempt ended on its own
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before


def test_an_abort_of_an_attempt_that_will_not_start_is_refused():
    limit = TimeLimit(None)
    limit.end()

    assert limit.abort("ops", 0.01) is False


def test_without_a_timeout_outside_a_worker_loop_the_block_installs_no_handler_and_sets_no_timer():
    before = signal.getsignal(signal.SIGALRM)
    limit, then = TimeLimit(None), []
    with limit:
        assert signal.getsignal(signal.SIGALRM) is before
        assert limit.abort("ops", 0.01, lambda: then.append("called"))  # told through its context only
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert (limit.aborted_by, then) == ("ops", ["called"])


@pytest.mark.usefixtures("worker_loop")
def test_in_a_worker_loop_a_block_without_timeout_sets_no_timer_until_an_abort():
    limit = TimeLimit(None)
    with limit:
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        limit.abort("ops", LONG)
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_worker_loop_puts_back_a_handler_a_job_replaced_and_its_own_at_the_end():
    before = signal.getsignal(signal.SIGALRM)
    restore = install_alarm_handler()
    try:
        installed = signal.getsignal(signal.SIGALRM)
        with TimeLimit(None):
            signal.signal(signal.SIGALRM, signal.SIG_IGN)  # the job's own use of the alarm
        assert signal.getsignal(signal.SIGALRM) is installed
        with pytest.raises(JobTimeout), TimeLimit(0.01):
            time.sleep(LONG)
    finally:
        restore()
    assert signal.getsignal(signal.SIGALRM) is before


def test_outside_the_main_thread_nothing_is_installed_and_an_abort_reaches_the_context_only():
    seen: list[object] = []

    def attempt() -> None:
        limit = TimeLimit(0.01)
        with limit:
            time.sleep(0.05)  # no alarm here: not interrupted
            seen.append(limit.abort("ops", 0.0))
        seen.append(limit.aborted_by)

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join(LONG)
    assert seen == [True, "ops"]
