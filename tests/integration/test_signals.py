"""The job signals, from dispatch to the worker and the reaper, on real backends.

``job_dispatching`` is sent by ``JobBuilder.build()`` (every way of dispatching goes through it);
the worker-side signals are sent by the delivery pipeline, and ``job_reaped`` by the reapers.
Worker-side tests run on the database backend over SQLite and PostgreSQL, and on Redis.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.dispatch import Signal, receiver
from django.test import override_settings
from django.utils import timezone

from django_jobs import Jobs, api, signing
from django_jobs.api import DispatchRequest
from django_jobs.backends.base import QueueBackend
from django_jobs.envelope import Envelope
from django_jobs.exceptions import DispatchCancelled, JobsError
from django_jobs.metrics import get_collector
from django_jobs.models import Job, JobStatus
from django_jobs.pipeline import JobContext
from django_jobs.reaper import Reaper
from django_jobs.signals import (
    job_dead_lettered,
    job_dispatching,
    job_failed,
    job_reaped,
    job_rejected,
    job_started,
    job_succeeded,
)
from django_jobs.worker import QueueWorker
from tests.api_support import GiveUpHandler, jobs_settings
from tests.backend_params import BACKEND_PARAMS, BackendCase, ready_case, require_hook
from tests.testapp.jobs import noop, scripted
from tests.testapp.models import SideEffect

# -- helpers -----------------------------------------------------------------------------------------


@contextmanager
def heard(signal: Signal, sender: Any = None, answer: Any = None) -> Iterator[list[dict[str, Any]]]:
    """Every sending of ``signal`` (from ``sender``, or any) while in the block, as its keyword
    arguments plus ``sender``; the receiver returns ``answer``."""
    calls: list[dict[str, Any]] = []

    def record(**kwargs: Any) -> Any:
        calls.append(kwargs)
        return answer

    signal.connect(record, sender=sender, weak=False)
    try:
        yield calls
    finally:
        signal.disconnect(record, sender=sender)


@contextmanager
def raising(signal: Signal) -> Iterator[None]:
    def broken(**kwargs: Any) -> None:
        raise RuntimeError("a broken receiver")

    signal.connect(broken, weak=False)
    try:
        yield
    finally:
        signal.disconnect(broken)


def signal_errors(name: str) -> float:
    return get_collector().get("jobs_signal_errors", signal=name)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


# -- job_dispatching -----------------------------------------------------------------------------------

dispatch_db = pytest.mark.django_db


@dispatch_db
def test_every_way_of_dispatching_sends_job_dispatching_once_per_job():
    with heard(job_dispatching) as calls:
        define_id = Jobs.define("command", "clearsessions").queue("other").dispatch()
        job_id = scripted.dispatch(action="ok")
        bulk_ids = Jobs.bulk([noop.builder(), Jobs.define("url", "https://example.com")])
    assert [(c["sender"], c["request"].handler) for c in calls] == [
        ("command", "command"),
        (scripted, scripted.key),
        (noop, noop.key),
        ("url", "url"),
    ]
    command, job_call = calls[0]["request"], calls[1]["request"]
    assert (command.payload, command.queue, command.priority, command.delay, command.timeout) == (
        "clearsessions",
        "other",
        0,
        None,
        None,
    )
    assert job_call.payload == {"args": [], "kwargs": {"action": "ok"}}
    assert isinstance(job_call, DispatchRequest) and not job_call.cancelled
    assert Job.objects.filter(pk__in=[define_id, job_id, *bulk_ids]).count() == 4


@dispatch_db
def test_a_receiver_for_one_job_function_hears_only_that_one():
    heard_requests: list[DispatchRequest] = []

    @receiver(job_dispatching, sender=scripted)
    def only_scripted(sender: Any, request: DispatchRequest, **kwargs: Any) -> None:
        heard_requests.append(request)

    try:
        noop.dispatch()
        Jobs.define(scripted.key, {"args": [], "kwargs": {}}).dispatch()  # by key: the sender is the str
        scripted.using(priority=2).dispatch(action="ok")
    finally:
        job_dispatching.disconnect(only_scripted, sender=scripted)
    assert [(r.handler, r.priority) for r in heard_requests] == [(scripted.key, 2)]


@dispatch_db
def test_a_receiver_for_a_handler_key_hears_jobs_defined_with_that_key():
    with heard(job_dispatching, sender="command") as calls:
        Jobs.define("url", "https://example.com").dispatch()
        Jobs.define("command", "clearsessions").dispatch()
    assert [c["request"].payload for c in calls] == ["clearsessions"]


@dispatch_db
def test_receivers_change_priority_delay_and_timeout_of_what_is_sent():
    def adjust(sender: Any, request: DispatchRequest, **kwargs: Any) -> None:
        request.priority += 10
        request.delay = 120
        request.timeout = 7.5

    job_dispatching.connect(adjust, sender=scripted, weak=False)
    try:
        before = timezone.now()
        job_id = scripted.using(priority=1, delay=5, timeout=60).dispatch(action="ok")
        untouched = noop.using(priority=1, delay=5, timeout=60).dispatch()
    finally:
        job_dispatching.disconnect(adjust, sender=scripted)
    job = Job.objects.get(pk=job_id)
    assert (job.priority, job.timeout) == (11, 7.5)
    assert before + timedelta(seconds=120) <= job.available_at <= timezone.now() + timedelta(seconds=120)
    other = Job.objects.get(pk=untouched)
    assert (other.priority, other.timeout) == (1, 60)
    assert other.available_at <= timezone.now() + timedelta(seconds=5)


@dispatch_db
def test_a_receiver_sees_the_delay_left_and_can_make_a_scheduled_job_due_at_once():
    seen: list[float | None] = []

    def now_please(sender: Any, request: DispatchRequest, **kwargs: Any) -> None:
        seen.append(request.delay)
        request.delay = None

    job_dispatching.connect(now_please, weak=False)
    try:
        job_id = scripted.using(scheduled_at=timezone.now() + timedelta(hours=1)).dispatch(action="ok")
    finally:
        job_dispatching.disconnect(now_please)
    [delay] = seen
    assert delay is not None and 3500 < delay <= 3600
    assert Job.objects.get(pk=job_id).available_at <= timezone.now()


@dispatch_db
@pytest.mark.parametrize(
    "field, value, error",
    [
        ("priority", "high", TypeError),
        ("priority", 2.5, TypeError),
        ("timeout", -1, ValueError),
        ("timeout", float("nan"), ValueError),
        ("delay", 10 * 365 * 24 * 3600, ValueError),
        ("delay", "soon", TypeError),
    ],
)
def test_a_bad_value_set_by_a_receiver_makes_the_dispatch_raise_and_sends_nothing(field, value, error):
    def spoil(sender: Any, request: DispatchRequest, **kwargs: Any) -> None:
        setattr(request, field, value)

    job_dispatching.connect(spoil, weak=False)
    try:
        with pytest.raises(error, match=f"a job_dispatching receiver set a bad value: {field}"):
            scripted.dispatch(action="ok")
        with pytest.raises(error):
            Jobs.bulk([noop.builder()])
    finally:
        job_dispatching.disconnect(spoil)
    assert Job.objects.count() == 0


@dispatch_db
def test_a_cancelled_dispatch_raises_with_the_reason_and_sends_nothing():
    def maintenance(sender: Any, request: DispatchRequest, **kwargs: Any) -> None:
        request.cancel("maintenance until 04:00")

    job_dispatching.connect(maintenance, weak=False)
    try:
        with pytest.raises(DispatchCancelled) as cancelled:
            scripted.dispatch(action="ok")
        with pytest.raises(DispatchCancelled, match="dispatch of command was cancelled: maintenance until 04:00"):
            Jobs.define("command", "clearsessions").dispatch()
    finally:
        job_dispatching.disconnect(maintenance)
    assert isinstance(cancelled.value, JobsError)
    assert (cancelled.value.reason, cancelled.value.handler) == ("maintenance until 04:00", scripted.key)
    assert str(cancelled.value) == f"dispatch of {scripted.key} was cancelled: maintenance until 04:00"
    assert Job.objects.count() == 0


@dispatch_db
def test_bulk_leaves_cancelled_jobs_out_and_returns_the_ids_it_sent():
    def no_odd_numbers(sender: Any, request: DispatchRequest, **kwargs: Any) -> None:
        if request.payload["kwargs"]["key"].endswith(("1", "3")):
            request.cancel("odd")

    builders = [scripted.builder(action="ok", key=f"k{n}") for n in range(5)]
    job_dispatching.connect(no_odd_numbers, sender=scripted, weak=False)
    try:
        ids = Jobs.bulk(builders)
        assert Jobs.bulk([scripted.builder(action="ok", key="k1")]) == []
    finally:
        job_dispatching.disconnect(no_odd_numbers, sender=scripted)
    assert len(ids) == 3
    sent = Job.objects.filter(pk__in=ids).order_by("created_at")
    assert [j.payload["kwargs"]["key"] for j in sent] == ["k0", "k2", "k4"]
    assert Job.objects.count() == 3


@dispatch_db
def test_a_receiver_that_raises_is_logged_and_counted_and_the_dispatch_goes_on(caplog):
    with raising(job_dispatching), caplog.at_level(logging.ERROR, logger="django_jobs.signals"):
        job_id = scripted.dispatch(action="ok")
    assert Job.objects.filter(pk=job_id).exists()
    assert signal_errors("job_dispatching") == 1
    [logged] = [r for r in caplog.records if r.name == "django_jobs.signals"]
    assert logged.getMessage().startswith("a job_dispatching receiver") and "a broken receiver" in caplog.text


@dispatch_db
def test_without_receivers_no_request_is_made(monkeypatch):
    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a DispatchRequest was built with no receiver connected")

    monkeypatch.setattr(api, "DispatchRequest", never)
    assert not job_dispatching.receivers
    job_id = scripted.dispatch(action="ok")
    assert Job.objects.filter(pk=job_id).exists()
    with heard(job_dispatching, sender=noop), pytest.raises(AssertionError, match="was built"):
        noop.dispatch()  # the same path, with a receiver: the request is built


# -- worker-side signals, per backend ----------------------------------------------------------------

WORKER_CASES = [p for p in BACKEND_PARAMS if p.id in ("database-sqlite", "database-postgres", "redis")]


@pytest.fixture(params=WORKER_CASES)
def case(request: pytest.FixtureRequest) -> BackendCase:
    return ready_case(request)


@pytest.fixture
def queue_backend(case: BackendCase) -> QueueBackend:
    return Jobs.backend(case.name)


def send(case: BackendCase, action: str = "ok", key: str | None = None, **options: Any) -> Envelope:
    """A scripted job, built as dispatch() builds it and enqueued at once (dispatch() on a broker
    waits for the test's transaction to commit, which never happens)."""
    options.setdefault("backoff", {"strategy": "none"})
    env = scripted.using(**options).builder(action=action, key=key, db=case.side_effect_db).build()
    Jobs.backend(case.name).enqueue(env)
    return env


def runs(case: BackendCase, key: str) -> int:
    return SideEffect.objects.using(case.side_effect_db).filter(key=key).count()


def status_of(case: BackendCase, backend: QueueBackend, job_id: str) -> str | None:
    """The stored status, where the backend keeps a row (None on Redis while it holds the job)."""
    if case.record is None:
        return None
    row = case.record(backend, job_id)
    return None if row is None else row.status


def test_started_and_succeeded_carry_the_envelope_attempt_result_and_seconds(case, queue_backend):
    status_when_succeeded: list[str | None] = []

    @receiver(job_succeeded, sender=scripted)
    def settled_first(sender: Any, envelope: Envelope, **kwargs: Any) -> None:
        status_when_succeeded.append(status_of(case, queue_backend, envelope.id))

    try:
        with (
            heard(job_started, sender=scripted) as started,
            heard(job_succeeded, sender=scripted) as succeeded,
            heard(job_started, sender=noop) as other_sender,
        ):
            env = send(case, action="ok")
            result = QueueWorker(queue_backend).process_once()
    finally:
        job_succeeded.disconnect(settled_first, sender=scripted)
    assert result.status == "acked"
    [begin] = started
    assert (begin["sender"], begin["envelope"].id, begin["attempt"]) == (scripted, env.id, 1)
    assert isinstance(begin["context"], JobContext) and begin["context"].job_id == env.id
    [end] = succeeded
    assert (end["envelope"].id, end["attempt"], end["result"]) == (env.id, 1, "ok")
    assert isinstance(end["seconds"], float) and end["seconds"] >= 0
    assert other_sender == []
    if case.record is not None:  # sent after the settle: the row is already completed
        assert status_when_succeeded == [JobStatus.COMPLETED]


def test_job_failed_says_whether_a_retry_follows_then_the_job_is_dead_lettered(case, queue_backend):
    key = unique("fails")
    with heard(job_failed, sender=scripted) as failed, heard(job_dead_lettered) as dead:
        env = send(case, action="raise", key=key, max_retries=1)
        worker = QueueWorker(queue_backend)
        statuses = [worker.process_once().status, worker.process_once().status]
    assert statuses == ["requeued", "dead-lettered"]
    assert [(f["attempt"], f["will_retry"]) for f in failed] == [(1, True), (2, False)]
    assert all(isinstance(f["exception"], RuntimeError) and f["envelope"].id == env.id for f in failed)
    [gone] = dead
    assert (gone["sender"], gone["envelope"].id, gone["attempts"]) == (scripted, env.id, 2)
    assert "RuntimeError: scripted failure" in gone["error"]
    assert runs(case, key) == 2


def test_a_receiver_returning_false_vetoes_the_retry(case, queue_backend):
    key = unique("veto")
    with heard(job_failed, sender=scripted, answer=False) as failed, heard(job_dead_lettered) as dead:
        env = send(case, action="raise", key=key, max_retries=3)
        result = QueueWorker(queue_backend).process_once()
    assert [f["will_retry"] for f in failed] == [True]  # the policy said yes; the receiver said no
    assert (result.status, result.attempt) == ("dead-lettered", 1)
    assert [d["envelope"].id for d in dead] == [env.id]
    assert status_of(case, queue_backend, env.id) in (None, JobStatus.FAILED)
    assert QueueWorker(queue_backend).process_once().status == "empty"
    assert runs(case, key) == 1


def test_a_receiver_returning_true_forces_a_retry_the_policy_refused_within_max_retries(case, queue_backend):
    key = unique("force")
    # retry_on=[ValueError]: the RuntimeError it raises is not to be retried.
    with heard(job_failed, sender=scripted, answer=True) as failed:
        send(case, action="raise", key=key, max_retries=1, retry_on=[ValueError])
        worker = QueueWorker(queue_backend)
        statuses = [worker.process_once().status, worker.process_once().status, worker.process_once().status]
    assert [f["will_retry"] for f in failed] == [False, False]
    assert statuses == ["requeued", "dead-lettered", "empty"]  # forced once; then no retries were left
    assert runs(case, key) == 2


@pytest.mark.usefixtures("clean_state")
def test_a_receiver_returning_true_overrules_a_handlers_can_retry(case, queue_backend):
    """GiveUpHandler fails every run; its can_retry() agrees to a retry after run 1 only."""
    forced: list[int] = []

    def insist(sender: Any, attempt: int, will_retry: bool, **kwargs: Any) -> bool | None:
        if isinstance(sender, GiveUpHandler) and not will_retry:
            forced.append(attempt)
            return True
        return None

    job_failed.connect(insist, weak=False)
    try:
        with jobs_settings(HANDLERS={"giveup": "tests.api_support.GiveUpHandler"}):
            queue_backend.enqueue(Jobs.define("giveup").max_retries(2).backoff(strategy="none").build())
            worker = QueueWorker(queue_backend)
            statuses = [worker.process_once().status for _ in range(4)]
    finally:
        job_failed.disconnect(insist)
    assert statuses == ["requeued", "requeued", "dead-lettered", "empty"]
    assert forced == [2, 3]  # can_retry said no after run 2; after run 3 no retry was left to force
    assert [call for call in GiveUpHandler.calls if call[0] == "run"] == [("run", 1), ("run", 2), ("run", 3)]


@pytest.mark.parametrize("case", [WORKER_CASES[0]], indirect=True)
def test_only_true_and_false_vote_not_values_equal_to_them(case, queue_backend):
    key = unique("zero")
    with heard(job_failed, sender=scripted, answer=0):  # e.g. a count an observing receiver returns
        send(case, action="raise", key=key, max_retries=1)
        assert QueueWorker(queue_backend).process_once().status == "requeued"


def test_without_a_vote_the_policy_decides(case, queue_backend):
    key = unique("policy")
    with heard(job_failed, sender=scripted) as failed:  # a receiver answering None takes no side
        send(case, action="raise", key=key, max_retries=1, retry_on=[ValueError])
        assert QueueWorker(queue_backend).process_once().status == "dead-lettered"
    assert [f["will_retry"] for f in failed] == [False]


def test_a_permanent_error_is_never_retried_whatever_a_receiver_says(case, queue_backend):
    # A @job payload of the wrong shape: InvalidPayload, which no retry can fix.
    env = Jobs.define(scripted.key, "not a dict").max_retries(3).build()
    queue_backend.enqueue(env)
    with heard(job_failed, sender=scripted, answer=True) as failed:
        result = QueueWorker(queue_backend).process_once()
    assert result.status == "dead-lettered" and "InvalidPayload" in (result.error or "")
    assert [f["will_retry"] for f in failed] == [False]


def forged(case: BackendCase, key: str) -> Envelope:
    """What a writer without the signing key can put on the queue: a message signed with
    another key (the worker must refuse to run it)."""
    env = Envelope(
        id=uuid.uuid4().hex,
        handler=scripted.key,
        payload={"args": [], "kwargs": {"action": "ok", "key": key, "db": case.side_effect_db}},
        queue="default",
    )
    with override_settings(JOBS={**settings.JOBS, "SIGNING_KEY": "an attacker's key, not the workers'"}):
        env.signature = signing.sign(env)
    return env


def test_a_forged_message_is_rejected_with_job_rejected_and_never_started(case, queue_backend):
    key = unique("forged")
    env = forged(case, key)
    queue_backend.enqueue(env)
    with heard(job_rejected) as rejected, heard(job_started) as started:
        result = QueueWorker(queue_backend).process_once()
    assert result.status == "rejected"
    [refused] = rejected
    assert refused["sender"] is queue_backend
    assert (refused["message_id"], refused["queue"]) == (result.job_id, "default")
    assert refused["reason"].startswith("rejected: BadSignature")
    assert started == [] and runs(case, key) == 0


@pytest.mark.parametrize("max_retries, failed", [(1, False), (0, True)])
def test_an_expired_lease_recovered_by_the_reaper_sends_job_reaped(case, queue_backend, max_retries, failed):
    env = send(case, action="ok", max_retries=max_retries)
    lease = queue_backend.fetch("default")
    assert lease is not None
    require_hook(case, "expire")(queue_backend, lease)  # as if its worker died a lease ago
    with heard(job_reaped) as reaped:
        assert Reaper(queue_backend).reap_once() == 1
    [lost] = reaped
    assert lost["sender"] is queue_backend
    assert (lost["job_id"], lost["queue"], lost["attempt"], lost["failed"]) == (env.id, "default", 1, failed)


def test_receivers_that_raise_are_logged_and_counted_and_the_worker_settles_normally(case, queue_backend, caplog):
    ok_key, fail_key = unique("ok"), unique("fail")
    with (
        raising(job_started),
        raising(job_succeeded),
        raising(job_failed),
        caplog.at_level(logging.ERROR, logger="django_jobs.signals"),
    ):
        ok = send(case, action="ok", key=ok_key)
        worker = QueueWorker(queue_backend)
        first = worker.process_once()
        failing = send(case, action="raise", key=fail_key, max_retries=1)
        second = worker.process_once()
    assert (first.status, first.job_id) == ("acked", ok.id)
    assert (second.status, second.job_id) == ("requeued", failing.id)  # the retry decision stands
    assert status_of(case, queue_backend, ok.id) in (None, JobStatus.COMPLETED)
    assert status_of(case, queue_backend, failing.id) in (None, JobStatus.PENDING)
    assert [signal_errors(name) for name in ("job_started", "job_succeeded", "job_failed")] == [2, 1, 1]
    logged = [r.getMessage() for r in caplog.records if r.name == "django_jobs.signals"]
    assert sorted(message.split(" (")[0] for message in logged) == [
        "a job_failed receiver",
        "a job_started receiver",
        "a job_started receiver",
        "a job_succeeded receiver",
    ]
    assert runs(case, ok_key) == runs(case, fail_key) == 1
