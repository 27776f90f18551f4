"""The Azure Service Bus backend (azure-servicebus): one queue entity per queue, in peek-lock mode.

A lease is a peek-lock: the heartbeat renews the message's lock, and only the receiver that holds
the lock can settle the message, so the lock also fences. A worker that dies leaves its lock to
expire; Service Bus then delivers the message again with ``delivery_count`` one higher, and
``fetch`` counts those lost runs, as the beanstalkd backend does with ``reserves``. Failures are
dead-lettered to the entity's native dead-letter sub-queue and recorded as failed ``Job`` rows.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from .. import conf
from ..envelope import Envelope
from ..exceptions import InvalidPayload, LeaseLost
from ..reaper import LOST_RUN_BATCH, settle_lost_runs
from . import require
from .base import Lease, RequeueByCopy, decode_lease_body

require("azure.servicebus", "servicebus")

# Looked up at call time (module attributes), so the tests can swap in an in-memory namespace.
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusSubQueue
from azure.servicebus.exceptions import (
    MessageAlreadySettled,
    MessageLockLostError,
    MessageNotFoundError,
    MessageSizeExceededError,
    ServiceBusCommunicationError,
    ServiceBusConnectionError,
)
from azure.servicebus.management import ServiceBusAdministrationClient

logger = logging.getLogger("django_jobs.servicebus")

# The lock is gone (expired, or the message was settled through another delivery): fenced off.
LOCK_LOST = (MessageLockLostError, MessageAlreadySettled, MessageNotFoundError)
# Dead-letter reason and description are message properties: keep them well under the broker's
# header limits (the full error is kept in the failed Job row).
MAX_REASON_CHARS = 256
MAX_DESCRIPTION_CHARS = 4096
PURGE_BATCH = 100


@dataclass
class _Link:
    """A sender or a receiver of one queue. SDK handlers are not thread-safe: the lock serialises
    the worker's thread and its heartbeat thread."""

    handle: Any
    lock: threading.Lock
    stash: Any = None  # receivers: a message received by wait_for_work, handed out by the next fetch


@dataclass(frozen=True, slots=True)
class _Held:
    """``Lease.raw``: the received message and the receiver whose lock it holds."""

    receiver: Any
    message: Any


class ServiceBusBackend(RequeueByCopy):
    """Options: ``CONNECTION_STRING``, or ``FULLY_QUALIFIED_NAMESPACE`` (``<name>.servicebus.windows.net``,
    authenticated by azure-identity's ``DefaultAzureCredential``); ``PREFIX`` (entity name prefix,
    default ``""``); ``RECEIVE_WAIT`` (seconds an empty fetch waits for a message, default 0.5);
    ``MAX_DELIVERY_COUNT`` (the queues' MaxDeliveryCount, default 10: only read by the system check).

    The queue entities (``PREFIX + queue``) must exist, without sessions.
    """

    unavailable_errors = (ServiceBusConnectionError, ServiceBusCommunicationError, OSError)

    supports_priority = False
    native_lease = True
    native_dead_letter = True

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        super().__init__(name, options)
        self.prefix = options.get("PREFIX", "")
        self.receive_wait = float(options.get("RECEIVE_WAIT", 0.5))
        self._lock = threading.RLock()
        self._handles = ExitStack()
        self._client: Any = None
        self._admin: Any = None
        self._credential: Any = None
        self._receivers: dict[str, _Link] = {}  # peek-lock receivers
        self._senders: dict[str, _Link] = {}
        self._warned: set[str] = set()

    def entity(self, queue: str) -> str:
        return f"{self.prefix}{queue}"

    # -- connection: one client per backend instance (per process), handlers cached per queue --

    def where(self) -> str:
        endpoint = str(self.options.get("FULLY_QUALIFIED_NAMESPACE") or "")
        for part in str(self.options.get("CONNECTION_STRING") or "").split(";"):
            if part.startswith("Endpoint="):
                endpoint = part.removeprefix("Endpoint=")
        return f"backend {self.name!r} (Service Bus at {endpoint or '?'})"

    def _endpoint(self) -> tuple[str, bool]:
        """``(CONNECTION_STRING, True)`` or ``(FULLY_QUALIFIED_NAMESPACE, False)``."""
        if self.options.get("CONNECTION_STRING"):
            return self.options["CONNECTION_STRING"], True
        if self.options.get("FULLY_QUALIFIED_NAMESPACE"):
            return self.options["FULLY_QUALIFIED_NAMESPACE"], False
        raise ImproperlyConfigured(
            f"servicebus backend {self.name!r} needs OPTIONS['CONNECTION_STRING'] or "
            "OPTIONS['FULLY_QUALIFIED_NAMESPACE']"
        )

    def _azure_credential(self) -> Any:
        if self._credential is None:
            try:
                from azure.identity import DefaultAzureCredential
            except ImportError as exc:
                raise ImproperlyConfigured(
                    f"servicebus backend {self.name!r}: OPTIONS['FULLY_QUALIFIED_NAMESPACE'] authenticates with "
                    "azure-identity's DefaultAzureCredential: pip install azure-identity "
                    "(or set OPTIONS['CONNECTION_STRING'] instead)"
                ) from exc
            self._credential = DefaultAzureCredential()
        return self._credential

    def _connection(self) -> Any:
        with self._lock:
            if self._client is None:
                endpoint, is_connection_string = self._endpoint()
                client = (
                    ServiceBusClient.from_connection_string(endpoint)
                    if is_connection_string
                    else ServiceBusClient(endpoint, self._azure_credential())
                )
                self._client = self._handles.enter_context(client)
            return self._client

    def _admin_client(self) -> Any:
        with self._lock:
            if self._admin is None:
                endpoint, is_connection_string = self._endpoint()
                self._admin = (
                    ServiceBusAdministrationClient.from_connection_string(endpoint)
                    if is_connection_string
                    else ServiceBusAdministrationClient(endpoint, self._azure_credential())
                )
            return self._admin

    def _link(self, links: dict[str, _Link], queue: str, get: Callable[[Any, str], Any]) -> _Link:
        link = links.get(queue)
        if link is None:
            with self._lock:
                link = links.get(queue)
                if link is None:
                    handle = self._handles.enter_context(get(self._connection(), self.entity(queue)))
                    link = links[queue] = _Link(handle, threading.Lock())
        return link

    def _receiver(self, queue: str) -> _Link:
        # Entering a receiver opens its link: a message can be settled only by an open
        # receiver, the one that received it.
        return self._link(
            self._receivers, queue, lambda client, name: client.get_queue_receiver(name, prefetch_count=0)
        )

    def _sender(self, queue: str) -> _Link:
        return self._link(self._senders, queue, lambda client, name: client.get_queue_sender(name))

    def close(self) -> None:
        with self._lock:
            for queue, link in list(self._receivers.items()):
                if link.stash is not None:
                    self._put_back(queue, link)
            handles, self._handles = self._handles, ExitStack()
            others = [c for c in (self._admin, self._credential) if c is not None]
            self._client = self._admin = self._credential = None
            self._receivers.clear()
            self._senders.clear()
        # Closing the receivers releases messages the SDK had buffered but not handed out, so
        # their delivery count does not grow. Leases still held lapse when their locks expire.
        for close in [handles.close, *(c.close for c in others)]:
            try:
                close()
            except Exception:
                logger.warning("servicebus backend %r: error while closing", self.name, exc_info=True)

    def _put_back(self, queue: str, link: _Link) -> None:
        """A message received by wait_for_work that no fetch took: requeue it without counting a
        run. Left to its lock's expiry, it would come back counted as a lost run it never was."""
        message, link.stash = link.stash, None
        lease = self._lease(queue, link, message)
        if lease.envelope is None:
            return  # undecodable: the worker rejects it on its next delivery anyway
        try:
            self.nack(lease, 0, count_run=False)
        except Exception:
            logger.warning(
                "servicebus backend %r: could not put back message %s", self.name, lease.token, exc_info=True
            )

    # -- protocol --

    def _send(self, queue: str, envelopes: list[Envelope]) -> None:
        """One round trip per batch: a batch is accepted or refused as a whole."""
        link = self._sender(queue)
        now = timezone.now()
        with link.lock:
            batch = link.handle.create_message_batch()
            for envelope in envelopes:
                message = _message(envelope, now)
                try:
                    batch.add_message(message)
                except MessageSizeExceededError:
                    if not len(batch):
                        raise  # too large on its own
                    link.handle.send_messages(batch)
                    batch = link.handle.create_message_batch()
                    batch.add_message(message)
            link.handle.send_messages(batch)

    def enqueue(self, envelope: Envelope) -> str:
        self._send(envelope.queue, [envelope])
        return envelope.id

    def enqueue_many(self, envelopes: list[Envelope]) -> list[str]:
        by_queue: dict[str, list[Envelope]] = {}
        for envelope in envelopes:
            by_queue.setdefault(envelope.queue, []).append(envelope)
        for queue, batch in by_queue.items():
            self._send(queue, batch)
        return [e.id for e in envelopes]

    def fetch(self, queue: str) -> Lease | None:
        link = self._receiver(queue)
        for _ in range(LOST_RUN_BATCH):
            with link.lock:
                message, link.stash = link.stash, None
                if message is None:
                    received = link.handle.receive_messages(max_message_count=1, max_wait_time=self.receive_wait)
                    message = received[0] if received else None
            if message is None:
                return None
            lease = self._lease(queue, link, message)
            lost = message.delivery_count or 0
            # Lost runs are failed runs: a job with retries left waits for its backoff, one
            # without is failed, as the reaper does for backends without native leases.
            if not settle_lost_runs(self, lease, lost, f"its Service Bus lock expired {lost} time(s)"):
                return lease
        return None

    def _lease(self, queue: str, link: _Link, message: Any) -> Lease:
        expires = message.locked_until_utc or timezone.now() + timedelta(seconds=conf.get("LEASE_TIMEOUT"))
        lease = Lease(
            token=str(message.message_id or message.sequence_number),
            owner_token=str(message.lock_token),  # a new lock token per delivery
            expires_at=expires,
            queue=queue,
            raw=_Held(link.handle, message),
        )
        body = _body(message)
        if body is None:
            lease.error = InvalidPayload(f"message {lease.token!r} has no data body")
        else:
            lease.envelope, lease.error = decode_lease_body(body)
        if lease.envelope is not None:
            lease.token = lease.envelope.id
            # The first delivery has delivery_count 0 (the AMQP header counts earlier failed
            # deliveries); each lock that expired without a settle was a run that was lost.
            lease.envelope.attempts += message.delivery_count or 0
        self._check_lock(queue, expires)
        return lease

    def _check_lock(self, queue: str, expires: datetime) -> None:
        """The heartbeat renews the lock every LEASE_TIMEOUT / 3 seconds; a shorter lock is lost
        under a long job. The queue's LockDuration is the operator's to set: say so once."""
        interval = float(conf.get("LEASE_TIMEOUT")) / 3
        left = (expires - timezone.now()).total_seconds()
        if left < interval and queue not in self._warned:
            self._warned.add(queue)
            logger.warning(
                "servicebus backend %r: a message of %r arrived with %.0fs of lock left, less than the heartbeat "
                "interval (LEASE_TIMEOUT / 3 = %.0fs): set the entity's LockDuration to LEASE_TIMEOUT (at most "
                "5 minutes) or lower LEASE_TIMEOUT, or long jobs will lose their lock",
                self.name,
                self.entity(queue),
                left,
                interval,
            )

    def _settle(self, lease: Lease, action: str, **kwargs: Any) -> Any:
        held: _Held = lease.raw
        link = self._receivers.get(lease.queue)
        if link is None or link.handle is not held.receiver:
            # close() ran since the fetch: the lock now lapses, and Service Bus delivers the
            # message again when it expires.
            raise LeaseLost(f"job {lease.token}: the receiver holding its lock was closed")
        with link.lock:
            try:
                return getattr(link.handle, action)(held.message, **kwargs)
            except LOCK_LOST as exc:
                raise LeaseLost(f"job {lease.token} is no longer locked by this worker ({type(exc).__name__})") from exc

    def ack(self, lease: Lease, *, count_run: bool = True) -> None:
        self._settle(lease, "complete_message")

    def put_copy(self, queue: str, envelope: Envelope, delay: float) -> None:
        # A message's body cannot change: nack sends a copy scheduled at now + delay.
        self._send(queue, [replace(envelope, available_at=timezone.now() + timedelta(seconds=delay))])

    def dead_letter(self, lease: Lease, error: str, *, count_run: bool = True) -> None:
        reason = error.partition("\n")[0]
        self._settle(
            lease,
            "dead_letter_message",
            reason=reason[:MAX_REASON_CHARS],
            error_description=error[:MAX_DESCRIPTION_CHARS],
        )

    def extend(self, lease: Lease, seconds: float) -> None:
        """Renew the lock: it now expires the entity's LockDuration from now (Service Bus has no
        per-message lock length; ``seconds`` cannot change it)."""
        lease.expires_at = self._settle(lease, "renew_message_lock")

    def reap_expired(self, queue: str | None = None) -> int:
        return 0  # Service Bus unlocks a message whose lock expired by itself

    def wait_for_work(self, queues: list[str], timeout: float) -> bool:
        """One queue: block in ``receive_messages`` and keep the message for the next fetch.

        Service Bus long-polls: an idle worker keeps one receive open instead of polling every
        ``POLL_INTERVAL`` (each receive is a billed operation), and a new message is handed out
        as soon as it arrives. A receive cannot wait on several entities, so with several queues
        this returns ``False`` and the worker sleeps. The kept message is locked until the fetch
        that follows at once; ``close()`` puts back one that no fetch took, uncounted.
        """
        if len(queues) != 1 or timeout <= 0:
            return False
        link = self._receiver(queues[0])
        with link.lock:
            if link.stash is None:
                received = link.handle.receive_messages(max_message_count=1, max_wait_time=timeout)
                link.stash = received[0] if received else None
        return True

    def size(self, queue: str) -> int:
        counts = self.stats(queue)
        return counts["pending"] + counts["delayed"]  # active messages include the locked ones

    def stats(self, queue: str) -> dict[str, int]:
        props = self._admin_client().get_queue_runtime_properties(self.entity(queue))
        return {
            # Service Bus counts locked messages as active: they cannot be told apart here.
            "pending": props.active_message_count or 0,
            "delayed": props.scheduled_message_count or 0,
            "in_progress": 0,
            "failed": props.dead_letter_message_count or 0,
        }

    def purge_failed(self, queue: str, older_than: timedelta | None = None) -> int:
        """Complete dead-lettered messages. Service Bus keeps no dead-letter time: ``older_than``
        compares the time the message was enqueued (for a retried job: its last attempt's copy)."""
        cutoff = timezone.now() - older_than if older_than else None
        purged, kept = 0, []
        receiver = self._connection().get_queue_receiver(self.entity(queue), sub_queue=ServiceBusSubQueue.DEAD_LETTER)
        with receiver:
            while batch := receiver.receive_messages(max_message_count=PURGE_BATCH, max_wait_time=self.receive_wait):
                for message in batch:
                    if cutoff is None or (message.enqueued_time_utc is not None and message.enqueued_time_utc < cutoff):
                        receiver.complete_message(message)
                        purged += 1
                    else:
                        kept.append(message)
            for message in kept:  # unlock at once rather than at lock expiry
                try:
                    receiver.abandon_message(message)
                except LOCK_LOST:
                    pass
        return purged


def _message(envelope: Envelope, now: datetime) -> Any:
    due = envelope.available_at if envelope.available_at is not None and envelope.available_at > now else None
    return ServiceBusMessage(
        envelope.to_bytes(),
        # Unique per copy: with duplicate detection on, a requeued copy reusing the job id
        # would be dropped as a duplicate, and the job lost.
        message_id=uuid.uuid4().hex,
        correlation_id=envelope.id,
        content_type="application/json",
        scheduled_enqueue_time_utc=due,
    )


def _body(message: Any) -> bytes | str | None:
    """A data body (one or more sections) as bytes; ``None`` for value and sequence bodies."""
    body = message.body
    if isinstance(body, (bytes, str)):
        return body
    try:
        return b"".join(body)
    except TypeError:
        return None
