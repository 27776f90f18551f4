"""The per-attempt alarm (``django_jobs.timeouts.TimeLimit``): a timeout raises ``JobTimeout``
in the block; an abort, asked from any thread, raises ``JobAborted`` within its grace."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from django_jobs.exceptions import JobAborted, JobTimeout
from django_jobs.timeouts import TimeLimit

LONG = 30  # a sleep the alarm must interrupt; the test fails by timing out, not by passing


def test_a_timeout_raises_job_timeout_in_the_block():
    with pytest.raises(JobTimeout, match="exceeded its 0.01s timeout"), TimeLimit(0.01):
        time.sleep(LONG)


def test_an_abort_from_another_thread_raises_job_aborted_within_the_grace():
    limit = TimeLimit(None)
    with pytest.raises(JobAborted, match="Aborted by boss \\(admin\\)"), limit:
        threading.Thread(target=limit.abort, args=("admin:boss", 0.01)).start()
        time.sleep(LONG)


def test_an_abort_asked_before_the_block_fires_once_it_starts():
    limit = TimeLimit(LONG)
    limit.abort("ops", 0.01)
    with pytest.raises(JobAborted, match="Aborted by ops"), limit:
        time.sleep(LONG)


def test_an_earlier_timeout_stands_and_fires_as_the_abort():
    limit = TimeLimit(0.01)
    with pytest.raises(JobAborted), limit:
        limit.abort("ops", LONG)
        time.sleep(LONG)


def test_an_abort_after_the_block_arms_nothing_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGALRM)
    limit = TimeLimit(None)
    with limit:
        pass
    limit.abort("ops", 0.01)

    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before
