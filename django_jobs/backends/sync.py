"""The sync backend: every job runs inline, once, at dispatch (for tests and development).

It goes through the real delivery pipeline (signature check, handler allowlist, idempotency,
timeout) so behaviour matches production; there is no queue, so no retry and no delay. A
permanent failure is recorded as a failed ``Job`` row, like every backend's.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from django.utils import timezone

from ..envelope import Envelope
from .base import Lease, QueueBackend

if TYPE_CHECKING:
    from ..pipeline import DeliveryPipeline, WorkerResult


class SyncBackend(QueueBackend):
    supports_delay = False
    supports_retry = False
    persistent = False

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        super().__init__(name, options)
        self.last_results: list[WorkerResult] = []
        self._pipeline: DeliveryPipeline | None = None

    def enqueue(self, envelope: Envelope) -> str:
        from ..pipeline import DeliveryPipeline  # the pipeline imports the backends package

        lease = Lease(
            token=envelope.id,
            owner_token=secrets.token_hex(8),
            expires_at=timezone.now(),
            queue=envelope.queue,
            envelope=envelope,
        )
        if self._pipeline is None:  # built once: it autodiscovers the @job modules
            self._pipeline = DeliveryPipeline(self)
        result = self._pipeline.process(lease)
        self.last_results = [*self.last_results[-99:], result]
        return envelope.id

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
