"""One exception hierarchy for django-jobs."""

from __future__ import annotations

from datetime import datetime


class JobsError(Exception):
    """Base class of every django-jobs error."""


class LeaseLost(JobsError):
    """The lease was reaped or settled by someone else: the owner token is stale."""

    # Found by a settle tried again after a backend error: the try before may have been made,
    # its answer lost (a cut connection), and the lease gone with it.
    after_failed_try = False


# Logged with a lease found lost by a settle tried again after a backend error.
MAYBE_SETTLED = "; a try before, whose answer was lost, may have settled it"


class InvalidPayload(JobsError, ValueError):
    """A message or payload that cannot be encoded or decoded (not JSON, too large, bad shape)."""


class InvalidArguments(InvalidPayload, TypeError):
    """The arguments of a ``@job`` dispatch or a ``@task`` enqueue cannot travel as JSON; the
    message names the argument. A ``TypeError`` too, as Django documents for a task's arguments."""


class BadSignature(JobsError):
    """A message whose HMAC signature is missing or does not verify."""


class HandlerNotAllowed(JobsError):
    """The message names a handler that is unknown or not allowed on its queue."""


class JobTimeout(JobsError):
    """The attempt ran longer than its timeout."""


class JobAborted(JobsError):
    """Raised inside a job that was asked to abort and did not stop within ``ABORT_GRACE``."""

    @staticmethod
    def describe(requested_by: str) -> str:
        """The ``last_error`` of an aborted job: ``admin:boss`` -> ``Aborted by boss (admin)``,
        ``command`` -> ``Aborted by command``."""
        kind, _, name = requested_by.partition(":")
        return f"Aborted by {name} ({kind})" if name else f"Aborted by {requested_by}"


class WorkerInterrupted(KeyboardInterrupt):
    """Raised inside a job when its worker is stopped at once (a second ``SIGINT``): the run is
    handed back to its queue without counting it. A ``KeyboardInterrupt``, as a Ctrl-C is, and
    not a ``JobsError``: a job's ``except Exception`` does not swallow it."""


class AbortRequested(JobsError):
    """A backend refused to requeue a job (a retry, a deferral, a hand-back) because it was asked
    to abort: the lease is still held, and the worker settles the job ``cancelled`` instead."""

    def __init__(self, requested_by: str) -> None:
        super().__init__(f"job was asked to abort by {requested_by}")
        self.requested_by = requested_by


class AbortNotSupported(JobsError):
    """The backend cannot abort a job by its id (it holds no row of a queued message)."""


class DependenciesNotSupported(JobsError):
    """A job with parents (``depends_on``, ``chain``, ``group(...).then``) was dispatched to a
    backend that cannot hold a job until its parents finish."""


class ParentFailed(JobsError):
    """A parent of the job failed for good, so the job never ran (``run_if_parent_fails`` off)."""

    @staticmethod
    def describe(parent_id: str) -> str:
        """The ``last_error`` of a job settled because ``parent_id`` failed."""
        return f"ParentFailed: parent {parent_id} failed"


class ParentCancelled(JobsError):
    """A parent of the job was cancelled, so the job never ran (``run_if_parent_fails`` off)."""

    @staticmethod
    def describe(parent_id: str) -> str:
        """The ``last_error`` of a job settled because ``parent_id`` was cancelled."""
        return f"ParentCancelled: parent {parent_id} was cancelled"


class LimitsNotSupported(JobsError):
    """A job under a rate or concurrency limit reached a backend that cannot enforce limits:
    refused at dispatch, and failed unrun by a worker that finds it (never run unlimited)."""


class UnknownJob(JobsError, LookupError):
    """No database or backend holds a job with this id."""


class UnknownQueue(JobsError, ValueError):
    """A job was dispatched to a queue that is not listed in ``JOBS["QUEUES"]``."""


class DispatchCancelled(JobsError):
    """A ``job_dispatching`` receiver cancelled the dispatch: nothing was sent.

    ``reason`` is what the receiver gave to ``request.cancel(reason)``; ``handler`` the job's
    handler key.
    """

    def __init__(self, reason: str, handler: str = "") -> None:
        super().__init__(reason, handler)
        self.reason, self.handler = reason, handler

    def __str__(self) -> str:
        return f"dispatch of {self.handler or 'a job'} was cancelled: {self.reason or 'no reason given'}"


class BackendUnavailable(JobsError, ConnectionError):
    """A backend's server could not be reached (its client's error is chained)."""


class WorkerLost(JobsError):
    """The lease expired while the job was running: its worker crashed or stalled."""

    @staticmethod
    def describe(expired_at: datetime) -> str:
        """The ``last_error`` of a reaped job."""
        return f"WorkerLost: lease expired at {expired_at.isoformat()} (worker crashed or stalled)"


def summary(exc: BaseException) -> str:
    """``ExceptionClass: message`` on one line (white space folded), for one-line reports."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())
