"""The sync backend: every job runs inline, once, at dispatch (for tests and development).

It goes through the real delivery pipeline (signature check, handler allowlist, idempotency,
timeout) so behaviour matches production; there is no queue, so no retry and no delay. A
permanent failure is recorded as a failed ``Job`` row, like every backend's.

A job with parents runs at once too: its parents ran before it, in their own dispatch. When one
of them failed or was cancelled (as this process saw it; a parent it did not run counts as
completed), the job is recorded failed or cancelled without running, unless
``run_if_parent_fails``.

``OPTIONS={"RAISE": True}`` (for tests) makes the dispatch raise when the job did not succeed:
the job's own exception, a rejection's refusal (``HandlerNotAllowed``, ``BadSignature``, ...),
or a :class:`~django_jobs.exceptions.JobsError` saying its idempotency key or single-instance
lock was held.
"""

from __future__ import annotations

import secrets
from functools import cached_property
from typing import TYPE_CHECKING

from django.utils import timezone

from ..envelope import Envelope
from ..exceptions import JobsError
from .base import Lease, QueueBackend

if TYPE_CHECKING:
    from ..pipeline import DeliveryPipeline, WorkerResult


# How many outcomes of the jobs it ran a sync backend remembers, for their children.
REMEMBERED = 1000


class SyncBackend(QueueBackend):
    supports_delay = False
    supports_retry = False
    persistent = False
    supports_dependencies = True

    @cached_property
    def outcomes(self) -> dict[str, str]:
        """How the last jobs it ran ended (id -> ``completed``/``failed``/``cancelled``)."""
        return {}

    @cached_property
    def last_results(self) -> list[WorkerResult]:
        """The results of the last 100 jobs it ran, oldest first (for tests)."""
        return []

    @cached_property
    def pipeline(self) -> DeliveryPipeline:
        """Built once: it autodiscovers the ``@job`` modules."""
        from ..pipeline import DeliveryPipeline  # the pipeline imports the backends package

        return DeliveryPipeline(self)

    def enqueue(self, envelope: Envelope) -> str:
        if envelope.parents and self._settled_by_parents(envelope):
            return envelope.id
        return self.redispatch(envelope)

    def redispatch(self, envelope: Envelope) -> str:
        """Run it at once, whatever its parents did."""
        lease = Lease(
            token=envelope.id,
            owner_token=secrets.token_hex(8),
            expires_at=timezone.now(),
            queue=envelope.queue,
            envelope=envelope,
        )
        result = self.pipeline.process(lease)
        self._remember(envelope.id, result)
        return envelope.id

    def _remember(self, job_id: str, result: WorkerResult) -> None:
        from ..pipeline import Outcome  # the pipeline imports the backends package

        self.last_results.append(result)
        del self.last_results[:-100]
        # How it ended, as its dependents see it; a delivery that neither ran nor ended (its lock
        # was busy) is not remembered, and counts as completed like a job never seen.
        ended = {
            Outcome.ACKED: "completed",
            Outcome.SKIPPED_IDEMPOTENT: "completed",
            Outcome.CANCELLED: "cancelled",
            Outcome.DEAD_LETTERED: "failed",
            Outcome.REJECTED: "failed",
        }
        if result.status in ended:
            self.outcomes[job_id] = ended[result.status]
        for old in list(self.outcomes)[:-REMEMBERED]:
            del self.outcomes[old]
        if self.options.get("RAISE"):
            _raise_for(result)

    def _settled_by_parents(self, env: Envelope) -> bool:
        """Record ``env`` failed or cancelled without running it when a parent's outcome says
        so; ``False`` when it is to run."""
        from ..audit import record_cancelled, record_failure
        from ..flows import edges_verdict, record_settled
        from ..pipeline import Outcome, WorkerResult

        edges = [(parent, self.outcomes.get(parent, "completed")) for parent in env.parents]
        verdict = edges_verdict(edges, bool(env.options.get("run_if_parent_fails")))
        if verdict.state not in ("failed", "cancelled"):
            return False
        record = record_cancelled if verdict.state == "cancelled" else record_failure
        record(env, verdict.reason, self.name, env.attempts, env.queue)
        record_settled(env.id, env.queue, env.handler, env.attempts + 1, verdict, self.history_alias)
        status = Outcome.CANCELLED if verdict.state == "cancelled" else Outcome.DEAD_LETTERED
        self._remember(env.id, WorkerResult(status, env.id, env.attempts, verdict.reason, env.queue, env.handler))
        return True

    def fetch(self, queue: str) -> Lease | None:
        return None

    def ack(self, lease: Lease, *, count_run: bool = True) -> None:
        pass

    def nack(self, lease: Lease, delay: float, *, error: str = "", count_run: bool = True) -> None:
        pass

    def dead_letter(self, lease: Lease, error: str, *, count_run: bool = True) -> None:
        pass  # nothing is queued: the failed Job row abandon() records is the whole record

    def extend(self, lease: Lease, seconds: float) -> None:
        pass

    def reap_expired(self, queue: str | None = None) -> int:
        return 0

    def size(self, queue: str) -> int:
        return 0


def _raise_for(result: WorkerResult) -> None:
    """Raise what a delivery that did not succeed raised, or a ``JobsError`` saying why it did
    not run; return for a success or a skip (its idempotency key had already succeeded)."""
    from ..pipeline import Outcome, deferral  # the pipeline imports the backends package

    if result.exception is not None:
        raise result.exception
    if result.status in (Outcome.ACKED, Outcome.SKIPPED_IDEMPOTENT):
        return
    if result.status is Outcome.REQUEUED:
        why = deferral(result.hold)
    else:
        why = result.error or str(result.status)
    raise JobsError(f"job {result.job_id} ({result.handler}) on queue {result.queue!r} was not run: {why}")
