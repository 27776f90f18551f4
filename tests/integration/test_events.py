"""The built-in ``event`` handler: a job that sends ``job_event`` in the worker, for allowed names only."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from django_jobs import Jobs, checks
from django_jobs.handlers import EventHandler
from django_jobs.metrics import get_collector
from django_jobs.signals import job_event
from django_jobs.worker import QueueWorker
from tests.api_support import jobs_settings, row

pytestmark = pytest.mark.django_db(databases=["default", "postgres"])


@contextmanager
def events() -> Iterator[list[dict[str, Any]]]:
    """Every ``job_event`` sent while in the block: its keyword arguments and ``sender``."""
    heard: list[dict[str, Any]] = []

    def record(**kwargs: Any) -> None:
        heard.append(kwargs)

    job_event.connect(record, weak=False)
    try:
        yield heard
    finally:
        job_event.disconnect(record)


def run_one(backend: str) -> Any:
    result = QueueWorker(backend).process_once()
    assert result.status != "empty"
    return result


def test_an_allowed_event_is_sent_with_its_name_and_payload(backend):
    with jobs_settings(ALLOWED_EVENTS=["user.signup", "order.paid"]), events() as heard:
        job_id = Jobs.define("event", {"name": "user.signup", "payload": {"user_id": 7, "plan": "pro"}}).dispatch(
            backend=backend
        )
        result = run_one(backend)
    assert (result.status, result.job_id) == ("acked", job_id)
    [event] = heard
    assert event["sender"] is EventHandler
    assert (event["name"], event["payload"]) == ("user.signup", {"user_id": 7, "plan": "pro"})
    assert row(backend, job_id).status == "completed"


def test_a_receiver_filters_by_the_handler_class_and_the_event_name(backend):
    signups: list[Any] = []

    def on_signup(sender: type[EventHandler], name: str, payload: Any, **kwargs: Any) -> None:
        if name == "user.signup":
            signups.append(payload)

    job_event.connect(on_signup, sender=EventHandler, weak=False)
    try:
        with jobs_settings(ALLOWED_EVENTS=["user.signup", "order.paid"]):
            Jobs.define("event", {"name": "order.paid", "payload": 12}).dispatch(backend=backend)
            Jobs.define("event", {"name": "user.signup"}).dispatch(backend=backend)  # no payload: None
            assert [run_one(backend).status for _ in range(2)] == ["acked", "acked"]
    finally:
        job_event.disconnect(on_signup, sender=EventHandler)
    assert signups == [None]


@pytest.mark.parametrize(
    "allowed",
    [
        pytest.param(None, id="default-empty"),
        pytest.param(["user"], id="a-prefix-is-not-a-match"),
        pytest.param(["USER.SIGNUP"], id="case-matters"),
        pytest.param(["user.signup.extra"], id="a-longer-name-is-not-a-match"),
    ],
)
def test_a_name_not_in_allowed_events_fails_for_good_and_sends_nothing(backend, allowed):
    changes = {} if allowed is None else {"ALLOWED_EVENTS": allowed}
    with jobs_settings(**changes), events() as heard:
        job_id = Jobs.define("event", {"name": "user.signup", "payload": 1}).max_retries(3).dispatch(backend=backend)
        result = run_one(backend)
    assert result.status == "dead-lettered"  # permanent: never retried
    assert "HandlerNotAllowed: event 'user.signup' is not in JOBS['ALLOWED_EVENTS']" in result.error
    assert heard == []
    assert (row(backend, job_id).status, row(backend, job_id).attempts) == ("failed", 1)


def test_a_str_allowed_events_is_refused_not_read_letter_by_letter(backend):
    with jobs_settings(ALLOWED_EVENTS="user.signup"), events() as heard:
        Jobs.define("event", {"name": "u"}).dispatch(backend=backend)
        result = run_one(backend)
        errors = [e for e in checks.check_settings() if "ALLOWED_EVENTS" in e.msg]
    assert result.status == "dead-lettered" and "JOBS['ALLOWED_EVENTS'] must be a list" in result.error
    assert heard == []
    assert [(e.id, e.msg) for e in errors] == [
        ("django_jobs.E011", "ALLOWED_EVENTS must be a list of strings, not 'user.signup' (a str)")
    ]


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param("user.signup", id="a-bare-name"),
        pytest.param({"payload": {"id": 1}}, id="no-name"),
        pytest.param({"name": 7, "payload": {}}, id="name-not-a-str"),
        pytest.param({"name": "user.signup", "data": {}}, id="unknown-key"),
        pytest.param(["user.signup", {}], id="a-list"),
    ],
)
def test_a_payload_of_the_wrong_shape_fails_for_good(backend, payload):
    with jobs_settings(ALLOWED_EVENTS=["user.signup"]), events() as heard:
        Jobs.define("event", payload).max_retries(3).dispatch(backend=backend)
        result = run_one(backend)
    assert result.status == "dead-lettered"
    assert "InvalidPayload: event payload must be {'name': str, 'payload': any JSON}" in result.error
    assert heard == []


def test_a_receiver_that_raises_is_logged_and_counted_and_the_job_succeeds(backend, caplog):
    def broken(**kwargs: Any) -> None:
        raise RuntimeError("the audit log is down")

    job_event.connect(broken, weak=False)
    try:
        with jobs_settings(ALLOWED_EVENTS=["user.signup"]), caplog.at_level(logging.ERROR, "django_jobs.signals"):
            job_id = Jobs.define("event", {"name": "user.signup", "payload": 1}).dispatch(backend=backend)
            result = run_one(backend)
            counted = get_collector().get("jobs_signal_errors", signal="job_event")  # this settings' collector
    finally:
        job_event.disconnect(broken)
    assert (result.status, row(backend, job_id).status) == ("acked", "completed")
    assert counted == 1
    assert any(r.getMessage().startswith("a job_event receiver") for r in caplog.records)


def test_the_event_handler_can_be_removed(backend):
    with jobs_settings(ALLOWED_EVENTS=["user.signup"], HANDLERS={"event": None}), events() as heard:
        Jobs.define("event", {"name": "user.signup"}).dispatch(backend=backend)
        result = run_one(backend)
    assert result.status == "rejected" and "unknown handler 'event'" in result.error
    assert heard == []
