"""An in-memory Azure Service Bus namespace: fakes of the SDK's client objects, and nothing else.

The servicebus backend under test is the real ``django_jobs.backends.servicebus``; only the
``ServiceBusClient`` and ``ServiceBusAdministrationClient`` it looks up at call time are swapped
for the classes below (``tests/integration/test_servicebus.py`` checks their signatures against
the installed SDK). Outgoing messages and batches are the SDK's own ``ServiceBusMessage`` and
``ServiceBusMessageBatch``, so message building and batch size limits are real.

Modelled as Azure behaves (and as the SDK source reports it):

- peek-lock: a received message is locked for the entity's lock duration and only the
  receiver holding the lock token can settle it; ``renew_message_lock`` restarts the lock;
- lock expiry on a settable :class:`FakeClock`: an expired lock unlocks the message and adds
  one to its ``delivery_count`` (0 on the first delivery: the SDK reports the AMQP header's
  count of earlier failed deliveries), as ``abandon_message`` does;
- MaxDeliveryCount: the delivery that takes the count to ``max_delivery_count`` goes to the
  dead-letter sub-queue with reason ``MaxDeliveryCountExceeded``, as Azure does;
- scheduled messages (``scheduled_enqueue_time_utc``): invisible until due, counted as
  scheduled by the runtime properties;
- settling a message whose lock was lost raises ``MessageLockLostError``, a settled one
  ``MessageAlreadySettled``, a closed handler ``ValueError`` (the SDK's exception classes);
- faults: ``namespace.fail(operation, exc)`` makes the next call of an operation raise.

Not modelled: sessions, partitions, time-to-live, duplicate detection, transactions, prefetch.

The lock duration follows ``LEASE_TIMEOUT`` unless a test sets ``namespace.lock_duration``: the
namespace stands for queues provisioned with LockDuration = LEASE_TIMEOUT, as the docs advise.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Self

import pytest

try:
    import azure.servicebus as sb
    from azure.servicebus import exceptions as sb_errors
except ImportError:  # the servicebus extra is missing: the fixture does nothing, the cases skip
    sb = sb_errors = None  # type: ignore[assignment]

SDK_INSTALLED = sb is not None
LIVE_ENV = "JOBS_TEST_SERVICEBUS_CONNECTION_STRING"
PEEK_LOCK = "peeklock"  # ServiceBusReceiveMode.PEEK_LOCK's value
DEAD_LETTER = "deadletter"  # ServiceBusSubQueue.DEAD_LETTER's value
STANDARD_TIER_BATCH_BYTES = 256 * 1024


class FakeClock:
    """The broker's time: real time plus an offset that tests push forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> datetime:
        return datetime.now(UTC) + timedelta(seconds=self.offset)


@dataclass
class Stored:
    """A message as the broker holds it."""

    sequence_number: int
    body: bytes
    message_id: str | None
    correlation_id: str | None
    content_type: str | None
    enqueued_at: datetime
    scheduled_at: datetime | None = None
    delivery_count: int = 0
    lock_token: uuid.UUID | None = None
    locked_until: datetime | None = None
    dead_letter_reason: str | None = None
    dead_letter_description: str | None = None


@dataclass
class Store:
    """One entity (a queue), or its dead-letter sub-queue (``dead_letter`` is then ``None``)."""

    name: str
    dead_letter: Store | None = None
    messages: list[Stored] = field(default_factory=list)

    def find(self, sequence_number: int) -> Stored | None:
        return next((m for m in self.messages if m.sequence_number == sequence_number), None)


class FakeNamespace:
    """Every entity of one namespace, behind one condition (receivers wait on it)."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.cond = threading.Condition()
        self.reset()

    def reset(self) -> None:
        with self.cond:
            self.entities: dict[str, Store] = {}
            self.sequence = 0
            self.clock.offset = 0.0
            self.lock_duration: float | None = None  # None: LEASE_TIMEOUT
            self.max_delivery_count = 10  # Azure's default MaxDeliveryCount
            self.faults: dict[str, list[BaseException]] = {}
            self.log: list[tuple[str, str]] = []  # (operation, entity) of the calls that took effect, in order
            self.clients: list[FakeServiceBusClient] = []
            self.admin_clients: list[FakeServiceBusAdministrationClient] = []

    # -- test controls --

    def advance(self, seconds: float) -> None:
        """Move the broker's clock: locks expire, scheduled messages come due."""
        with self.cond:
            self.clock.offset += seconds
            self.cond.notify_all()

    def fail(self, operation: str, exc: BaseException, times: int = 1) -> None:
        """The next ``times`` calls of ``operation`` (send, receive, complete, abandon,
        dead_letter, renew, runtime_properties) raise ``exc`` and change nothing."""
        self.faults.setdefault(operation, []).extend([exc] * times)

    def expire_lock(self, message: FakeServiceBusReceivedMessage) -> None:
        """The lock of this delivery runs out now, as if its worker had stopped renewing it."""
        with self.cond:
            stored = self.entity(message._entity).find(message.sequence_number)
            if stored is not None and stored.lock_token == message._lock_token:
                stored.locked_until = self.clock.now()
            self.cond.notify_all()

    def entity(self, name: str) -> Store:
        """The queue named ``name`` (queues exist: the backend needs them provisioned)."""
        store = self.entities.get(name)
        if store is None:
            store = self.entities[name] = Store(name, dead_letter=Store(f"{name}/$DeadLetterQueue"))
        return store

    def store(self, name: str, sub_queue: str | None) -> Store:
        entity = self.entity(name)
        if sub_queue is None:
            return entity
        assert str(getattr(sub_queue, "value", sub_queue)) == DEAD_LETTER, sub_queue
        assert entity.dead_letter is not None
        return entity.dead_letter

    def messages(self, name: str) -> list[Stored]:
        """Messages of a queue not yet settled, ready, scheduled or locked."""
        with self.cond:
            self._tick(self.entity(name))
            return list(self.entity(name).messages)

    def dead_letters(self, name: str) -> list[Stored]:
        with self.cond:
            self._tick(self.entity(name))
            dead = self.entity(name).dead_letter
            assert dead is not None
            return list(dead.messages)

    # -- broker behaviour (callers hold self.cond) --

    def lock_seconds(self) -> float:
        if self.lock_duration is not None:
            return self.lock_duration
        from django_jobs import conf

        return float(conf.get("LEASE_TIMEOUT"))

    def _fault(self, operation: str) -> None:
        queued = self.faults.get(operation)
        if queued:
            raise queued.pop(0)

    def _tick(self, store: Store) -> None:
        """Expired locks unlock their message and count a delivery."""
        now = self.clock.now()
        for stored in list(store.messages):
            if stored.locked_until is not None and stored.locked_until <= now:
                self._unlock_counted(store, stored)

    def _unlock_counted(self, store: Store, stored: Stored) -> None:
        stored.lock_token = stored.locked_until = None
        stored.delivery_count += 1
        if store.dead_letter is not None and stored.delivery_count >= self.max_delivery_count:
            self._dead_letter(
                store,
                stored,
                "MaxDeliveryCountExceeded",
                f"Message could not be consumed after {self.max_delivery_count} delivery attempts.",
            )
        self.cond.notify_all()

    def _dead_letter(self, store: Store, stored: Stored, reason: str | None, description: str | None) -> None:
        assert store.dead_letter is not None, "a dead-letter sub-queue has no dead-letter queue of its own"
        store.messages.remove(stored)
        stored.lock_token = stored.locked_until = None
        stored.dead_letter_reason, stored.dead_letter_description = reason, description
        store.dead_letter.messages.append(stored)

    def _send(self, store: Store, message: Any) -> None:
        body = message.body
        self.sequence += 1
        store.messages.append(
            Stored(
                sequence_number=self.sequence,
                body=body if isinstance(body, bytes) else b"".join(body),
                message_id=message.message_id,
                correlation_id=message.correlation_id,
                content_type=message.content_type,
                enqueued_at=self.clock.now(),
                scheduled_at=message.scheduled_enqueue_time_utc,
            )
        )

    def _receive(
        self, receiver: FakeServiceBusReceiver, count: int, wait: float
    ) -> list[FakeServiceBusReceivedMessage]:
        deadline = time.monotonic() + wait
        with self.cond:
            self._fault("receive")
            self.log.append(("receive", receiver._entity))
            while True:
                store = self.store(receiver._entity, receiver._sub_queue)
                self._tick(store)
                now = self.clock.now()
                ready = [
                    m
                    for m in store.messages
                    if m.lock_token is None and (m.scheduled_at is None or m.scheduled_at <= now)
                ][:count]
                if ready:
                    until = now + timedelta(seconds=self.lock_seconds())
                    for stored in ready:
                        stored.lock_token, stored.locked_until = uuid.uuid4(), until
                    return [FakeServiceBusReceivedMessage(receiver, stored) for stored in ready]
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                # Also wake up on time alone: scheduled messages come due, locks expire.
                self.cond.wait(min(left, 0.02))

    def _settle(
        self, receiver: FakeServiceBusReceiver, message: FakeServiceBusReceivedMessage, operation: str
    ) -> tuple[Store, Stored]:
        """The stored message still locked by this delivery, or the SDK's errors."""
        receiver._check_live()
        if message._settled:
            raise sb_errors.MessageAlreadySettled(action=operation)
        store = self.store(receiver._entity, receiver._sub_queue)
        self._fault(operation)
        self._tick(store)
        stored = store.find(message.sequence_number)
        if stored is None or stored.lock_token != message._lock_token:
            raise sb_errors.MessageLockLostError()
        self.log.append((operation, receiver._entity))
        return store, stored


NAMESPACE = FakeNamespace()


class FakeServiceBusReceivedMessage:
    """What ``receive_messages`` returns: a snapshot of one delivery (lock token, count)."""

    def __init__(self, receiver: FakeServiceBusReceiver, stored: Stored) -> None:
        self._receiver = receiver
        self._entity = receiver._entity
        self._body = stored.body
        self._lock_token = stored.lock_token
        self._expiry = stored.locked_until
        self._settled = False
        self._delivery_count = stored.delivery_count
        self._sequence_number = stored.sequence_number
        self._message_id = stored.message_id
        self._correlation_id = stored.correlation_id
        self._content_type = stored.content_type
        self._enqueued_time_utc = stored.enqueued_at
        self._dead_letter_reason = stored.dead_letter_reason
        self._dead_letter_description = stored.dead_letter_description

    @property
    def body(self) -> Any:
        return iter([self._body])  # a data body, as the SDK returns it: an iterator of sections

    @property
    def delivery_count(self) -> int | None:
        return self._delivery_count

    @property
    def lock_token(self) -> uuid.UUID | None:
        return None if self._settled else self._lock_token

    @property
    def locked_until_utc(self) -> datetime | None:
        return None if self._settled else self._expiry

    @property
    def sequence_number(self) -> int | None:
        return self._sequence_number

    @property
    def message_id(self) -> str | None:
        return self._message_id

    @property
    def correlation_id(self) -> str | None:
        return self._correlation_id

    @property
    def content_type(self) -> str | None:
        return self._content_type

    @property
    def enqueued_time_utc(self) -> datetime | None:
        return self._enqueued_time_utc

    @property
    def dead_letter_reason(self) -> str | None:
        return self._dead_letter_reason

    @property
    def dead_letter_error_description(self) -> str | None:
        return self._dead_letter_description


class _Handler:
    def __init__(self, client: FakeServiceBusClient, entity: str) -> None:
        self._client, self._entity, self._closed = client, entity, False
        client._handlers.append(self)

    @property
    def _ns(self) -> FakeNamespace:
        return self._client._namespace

    def _check_live(self) -> None:
        if self._closed:
            raise ValueError(
                "The handler has already been shutdown. Please use ServiceBusClient to create a new instance."
            )

    def close(self) -> None:
        self._closed = True


class FakeServiceBusSender(_Handler):
    def __enter__(self) -> Self:
        self._check_live()
        return self

    def __exit__(self, *args: object) -> None:
        self.close()

    def send_messages(self, message: Any, *, timeout: float | None = None, **kwargs: Any) -> None:
        self._check_live()
        if isinstance(message, sb.ServiceBusMessageBatch):
            messages = list(message._messages)  # the SDK's batch keeps what was added, in order
        elif isinstance(message, list):
            messages = message
        else:
            messages = [message]
        with self._ns.cond:
            self._ns._fault("send")
            store = self._ns.entity(self._entity)
            for one in messages:  # one batch: all or nothing
                self._ns._send(store, one)
            self._ns.log.append(("send", self._entity))
            self._ns.cond.notify_all()

    def create_message_batch(self, max_size_in_bytes: int | None = None) -> Any:
        self._check_live()
        return sb.ServiceBusMessageBatch(max_size_in_bytes=max_size_in_bytes or STANDARD_TIER_BATCH_BYTES)


class FakeServiceBusReceiver(_Handler):
    def __init__(self, client: FakeServiceBusClient, entity: str, sub_queue: Any, receive_mode: Any) -> None:
        super().__init__(client, entity)
        self._sub_queue = None if sub_queue is None else str(getattr(sub_queue, "value", sub_queue))
        assert str(getattr(receive_mode, "value", receive_mode)) == PEEK_LOCK, "the backend settles: peek-lock only"

    def __enter__(self) -> Self:
        self._check_live()
        return self

    def __exit__(self, *args: object) -> None:
        self.close()

    def receive_messages(self, max_message_count: int | None = 1, max_wait_time: float | None = None) -> list[Any]:
        self._check_live()
        if max_wait_time is not None and max_wait_time <= 0:
            raise ValueError("The max_wait_time must be greater than 0.")
        if max_message_count is not None and max_message_count <= 0:
            raise ValueError("The max_message_count must be greater than 0")
        return self._ns._receive(self, max_message_count or 1, 60.0 if max_wait_time is None else max_wait_time)

    def complete_message(self, message: Any) -> None:
        with self._ns.cond:
            store, stored = self._ns._settle(self, message, "complete")
            store.messages.remove(stored)
            message._settled = True

    def abandon_message(self, message: Any) -> None:
        with self._ns.cond:
            store, stored = self._ns._settle(self, message, "abandon")
            self._ns._unlock_counted(store, stored)
            message._settled = True

    def dead_letter_message(
        self, message: Any, reason: str | None = None, error_description: str | None = None
    ) -> None:
        with self._ns.cond:
            store, stored = self._ns._settle(self, message, "dead_letter")
            self._ns._dead_letter(store, stored, reason, error_description)
            message._settled = True

    def renew_message_lock(self, message: Any, *, timeout: float | None = None, **kwargs: Any) -> datetime:
        with self._ns.cond:
            _, stored = self._ns._settle(self, message, "renew")
            stored.locked_until = message._expiry = self._ns.clock.now() + timedelta(seconds=self._ns.lock_seconds())
            return stored.locked_until


class FakeServiceBusClient:
    """Bound to :data:`NAMESPACE`; tracks its handlers and closes them, like the SDK's."""

    def __init__(
        self,
        fully_qualified_namespace: str,
        credential: Any,
        *,
        retry_total: int = 3,
        retry_backoff_factor: float = 0.8,
        retry_backoff_max: float = 120,
        retry_mode: str = "exponential",
        **kwargs: Any,
    ) -> None:
        self.fully_qualified_namespace = fully_qualified_namespace
        self.credential = credential
        self.closed = False
        self._namespace = NAMESPACE
        self._handlers: list[_Handler] = []
        NAMESPACE.clients.append(self)

    @classmethod
    def from_connection_string(
        cls,
        conn_str: str,
        *,
        retry_total: int = 3,
        retry_backoff_factor: float = 0.8,
        retry_backoff_max: float = 120,
        retry_mode: str = "exponential",
        **kwargs: Any,
    ) -> FakeServiceBusClient:
        return cls(conn_str, credential=None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *args: object) -> None:
        self.close()

    def close(self) -> None:
        for handler in self._handlers:
            handler.close()
        self._handlers.clear()
        self.closed = True

    def get_queue_sender(
        self,
        queue_name: str,
        *,
        client_identifier: str | None = None,
        socket_timeout: float | None = None,
        **kwargs: Any,
    ) -> FakeServiceBusSender:
        return FakeServiceBusSender(self, queue_name)

    def get_queue_receiver(
        self,
        queue_name: str,
        *,
        client_identifier: str | None = None,
        socket_timeout: float | None = None,
        session_id: str | None = None,
        sub_queue: Any = None,
        receive_mode: Any = PEEK_LOCK,
        max_wait_time: float | None = None,
        auto_lock_renewer: Any = None,
        prefetch_count: int = 0,
        **kwargs: Any,
    ) -> FakeServiceBusReceiver:
        assert session_id is None and auto_lock_renewer is None and prefetch_count == 0
        return FakeServiceBusReceiver(self, queue_name, sub_queue, receive_mode)


class FakeQueueRuntimeProperties:
    def __init__(self, name: str, active: int, scheduled: int, dead_letter: int) -> None:
        self._name, self._active, self._scheduled, self._dead_letter = name, active, scheduled, dead_letter

    @property
    def name(self) -> str:
        return self._name

    @property
    def active_message_count(self) -> int | None:
        return self._active

    @property
    def scheduled_message_count(self) -> int | None:
        return self._scheduled

    @property
    def dead_letter_message_count(self) -> int | None:
        return self._dead_letter

    @property
    def total_message_count(self) -> int | None:
        return self._active + self._scheduled + self._dead_letter


class FakeServiceBusAdministrationClient:
    def __init__(
        self, fully_qualified_namespace: str, credential: Any, *, api_version: Any = None, **kwargs: Any
    ) -> None:
        self.fully_qualified_namespace = fully_qualified_namespace
        self.closed = False
        NAMESPACE.admin_clients.append(self)

    @classmethod
    def from_connection_string(
        cls, conn_str: str, *, api_version: Any = None, **kwargs: Any
    ) -> FakeServiceBusAdministrationClient:
        return cls(conn_str, credential=None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_details: object) -> None:
        self.close()

    def close(self) -> None:
        self.closed = True

    def get_queue_runtime_properties(self, queue_name: str, **kwargs: Any) -> FakeQueueRuntimeProperties:
        ns = NAMESPACE
        with ns.cond:
            ns._fault("runtime_properties")
            store = ns.entity(queue_name)
            ns._tick(store)
            now = ns.clock.now()
            scheduled = sum(1 for m in store.messages if m.scheduled_at is not None and m.scheduled_at > now)
            assert store.dead_letter is not None
            return FakeQueueRuntimeProperties(
                queue_name, len(store.messages) - scheduled, scheduled, len(store.dead_letter.messages)
            )


# Which fake stands for which SDK class (the drift guard in test_servicebus.py walks this).
FAKES: dict[str, tuple[type, str]] = {
    "ServiceBusClient": (FakeServiceBusClient, "azure.servicebus.ServiceBusClient"),
    "ServiceBusSender": (FakeServiceBusSender, "azure.servicebus.ServiceBusSender"),
    "ServiceBusReceiver": (FakeServiceBusReceiver, "azure.servicebus.ServiceBusReceiver"),
    "ServiceBusReceivedMessage": (FakeServiceBusReceivedMessage, "azure.servicebus.ServiceBusReceivedMessage"),
    "ServiceBusAdministrationClient": (
        FakeServiceBusAdministrationClient,
        "azure.servicebus.management.ServiceBusAdministrationClient",
    ),
    "QueueRuntimeProperties": (FakeQueueRuntimeProperties, "azure.servicebus.management.QueueRuntimeProperties"),
}


def expire_lock(backend: Any, lease: Any) -> None:
    """``BackendCase.expire``: the lease's lock runs out now (its worker stopped heartbeating)."""
    NAMESPACE.expire_lock(lease.raw.message)


# -- the fixture (a plugin of tests/conftest.py's pytest_plugins: autouse for the whole suite) --


@pytest.fixture(autouse=True)
def servicebus_fake(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNamespace | None]:
    """Every test: the ``servicebus`` backend of the test settings talks to a fresh in-memory
    namespace, so nothing (``jobs_stats``, ``jobs_purge``, the conformance suite) ever reaches
    for the network. The ``servicebus-live`` conformance case points it at a real namespace
    instead (see :func:`_live_namespace`)."""
    if not SDK_INSTALLED:
        yield None
        return
    from django_jobs.backends import servicebus as module

    if _is_live_case(request):
        with _live_namespace(module.ServiceBusBackend):
            yield None
        return
    NAMESPACE.reset()
    monkeypatch.setattr(module, "ServiceBusClient", FakeServiceBusClient)
    monkeypatch.setattr(module, "ServiceBusAdministrationClient", FakeServiceBusAdministrationClient)
    try:
        yield NAMESPACE
    finally:
        _close_backend(module.ServiceBusBackend)


def _is_live_case(request: pytest.FixtureRequest) -> bool:
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    if "backend_case" not in params:
        return False
    from tests.backend_params import SERVICEBUS_LIVE

    return params["backend_case"] is SERVICEBUS_LIVE


def _close_backend(backend_class: type) -> None:
    """A stashed message or an open receiver must not outlive its test (or its namespace)."""
    from django.core.exceptions import ImproperlyConfigured

    from django_jobs.backends import get_backend

    try:
        backend = get_backend("servicebus")
    except (ImproperlyConfigured, ImportError):
        return  # the settings have no such backend, or a test hid the SDK (its monkeypatch is undone later)
    if isinstance(backend, backend_class):
        backend.close()


@contextmanager
def _live_namespace(backend_class: type) -> Iterator[None]:
    """The conformance suite against a real namespace (the ``servicebus-live`` case).

    Run it with::

        JOBS_TEST_SERVICEBUS_CONNECTION_STRING='Endpoint=sb://<ns>.servicebus.windows.net/;SharedAccessKeyName=...;SharedAccessKey=...' \\
            .venv/bin/python -m pytest tests/integration/test_conformance.py -k servicebus-live

    The connection string needs Manage rights when the queues do not exist yet: queues
    ``<PREFIX>default``, ``<PREFIX>other`` and ``<PREFIX>emails`` (``PREFIX`` from
    ``JOBS_TEST_SERVICEBUS_PREFIX``, default ``djt-``) are created with LockDuration 60 s
    (= the test LEASE_TIMEOUT) and MaxDeliveryCount 10. Each test starts with them emptied
    (ready, scheduled and dead-lettered messages). Without the variable the case is skipped,
    under CI too: no namespace exists on the CI machines.
    """
    import os

    from django.conf import settings
    from django.test import override_settings

    conn = os.environ.get(LIVE_ENV)
    if not conn:
        pytest.skip(f"{LIVE_ENV} is not set: no Service Bus namespace to test against")
    prefix = os.environ.get("JOBS_TEST_SERVICEBUS_PREFIX", "djt-")
    entities = [f"{prefix}{queue}" for queue in settings.JOBS["QUEUES"]]
    _prepare_live_queues(conn, entities)
    options = {"CONNECTION_STRING": conn, "PREFIX": prefix, "RECEIVE_WAIT": 2.0}
    backends = {**settings.JOBS["BACKENDS"], "servicebus": {"ENGINE": "servicebus", "OPTIONS": options}}
    with override_settings(JOBS={**settings.JOBS, "BACKENDS": backends}):
        try:
            yield
        finally:
            _close_backend(backend_class)


def _prepare_live_queues(conn: str, entities: list[str]) -> None:
    from azure.core.exceptions import ResourceNotFoundError
    from azure.servicebus import ServiceBusClient, ServiceBusMessageState, ServiceBusReceiveMode, ServiceBusSubQueue
    from azure.servicebus.management import ServiceBusAdministrationClient

    with ServiceBusAdministrationClient.from_connection_string(conn) as admin:
        for name in entities:
            try:
                admin.get_queue(name)
            except ResourceNotFoundError:
                admin.create_queue(name, lock_duration=timedelta(seconds=60), max_delivery_count=10)
    with ServiceBusClient.from_connection_string(conn) as client:
        for name in entities:
            with client.get_queue_sender(name) as sender, client.get_queue_receiver(name) as browser:
                scheduled = [
                    m.sequence_number
                    for m in browser.peek_messages(max_message_count=250)
                    if m.state == ServiceBusMessageState.SCHEDULED
                ]
                if scheduled:
                    sender.cancel_scheduled_messages(scheduled)
            for sub_queue in (None, ServiceBusSubQueue.DEAD_LETTER):
                with client.get_queue_receiver(
                    name, sub_queue=sub_queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE
                ) as receiver:
                    while receiver.receive_messages(max_message_count=250, max_wait_time=2):
                        pass
