"""Signals sent around a job's life, in the Django idiom (``@receiver(job_failed)``).

``sender`` is the job's handler: the ``@job`` function itself (``@receiver(job_failed,
sender=send_invoice)``), or the handler object of a ``JOBS["HANDLERS"]`` key (for a class, the
instance made for the delivery). For ``job_dispatching`` it is the ``@job`` function, or the
handler key (a str) for ``Jobs.define(...)``; for ``job_dead_lettered`` of a job failed without
running, the handler key; for ``job_reaped`` and ``job_rejected`` the backend; for ``job_event``
the :class:`~django_jobs.handlers.EventHandler` class. docs/signals.md describes each one.

A receiver that raises is logged and counted (``jobs_signal_errors``); it never breaks a
dispatch or a worker.
"""

from __future__ import annotations

import logging
from typing import Any

from django.dispatch import Signal

from .metrics import get_collector

logger = logging.getLogger("django_jobs.signals")

#: Before a job is sent, from ``JobBuilder.build()``. ``request``
#: (:class:`~django_jobs.api.DispatchRequest`) may be changed: ``priority``, ``delay``,
#: ``timeout``, or ``cancel(reason)``. Not sent at all while no receiver is connected.
job_dispatching = Signal()
#: A worker is about to run an attempt: ``envelope``, ``attempt``, ``context``.
job_started = Signal()
#: An attempt succeeded and was settled: ``envelope``, ``attempt``, ``result``, ``seconds``.
job_succeeded = Signal()
#: An attempt failed: ``envelope``, ``attempt``, ``exception``, ``will_retry``. A receiver that
#: returns ``False`` vetoes the retry; one that returns ``True`` forces it while retries are left.
job_failed = Signal()
#: A job failed for good and was kept for audit: ``envelope``, ``error``, ``attempts``,
#: ``exception`` (what its last run raised; ``None`` when it failed without raising).
job_dead_lettered = Signal()
#: The reaper recovered a lost run: ``job_id``, ``queue``, ``attempt``, ``failed`` (no retries left).
job_reaped = Signal()
#: A message was refused without running: ``message_id``, ``queue``, ``reason``.
job_rejected = Signal()
#: The built-in ``event`` handler ran an allowed event: ``name``, ``payload``.
job_event = Signal()

_NAMES = {
    id(job_dispatching): "job_dispatching",
    id(job_started): "job_started",
    id(job_succeeded): "job_succeeded",
    id(job_failed): "job_failed",
    id(job_dead_lettered): "job_dead_lettered",
    id(job_reaped): "job_reaped",
    id(job_rejected): "job_rejected",
    id(job_event): "job_event",
}


def emit(signal: Signal, sender: Any, **kwargs: Any) -> list[Any]:
    """Send ``signal`` to every receiver; return their answers. A receiver's exception is
    logged and counted, and left out of the answers."""
    if not signal.receivers or not signal.has_listeners(sender):  # none connected: nothing to look up
        return []
    answers = []
    for receiver, answer in signal.send_robust(sender, **kwargs):
        if isinstance(answer, Exception):
            name = _NAMES.get(id(signal), "signal")
            get_collector().increment("jobs_signal_errors", signal=name)
            logger.error("a %s receiver (%r) raised", name, receiver, exc_info=answer)
        else:
            answers.append(answer)
    return answers
