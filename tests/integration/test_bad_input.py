"""Bad input: tampered rows, garbage payloads, unknown handlers, non-JSON payloads at dispatch.

Each gets a clear error or a rejected/failed outcome, is counted, is never executed, and the
worker keeps going. Rows are tampered with after dispatch, as someone with write access to the
table (or a bug elsewhere) could.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from django.db import connections, transaction

from django_jobs import Jobs, signing
from django_jobs.exceptions import BackendUnavailable, InvalidPayload
from django_jobs.models import Job
from django_jobs.worker import QueueWorker
from tests.api_support import (
    alias,
    counter,
    jobs_settings,
    row,
    runs,
)
from tests.testapp.jobs import calls, remember, scripted

pytestmark = [pytest.mark.django_db(databases=["default", "postgres"]), pytest.mark.usefixtures("clean_state")]


def raw_update(backend: str, job_id: str, column: str, value: object) -> None:
    """``UPDATE django_jobs_job SET <column> = %s`` behind the ORM's back."""
    with connections[alias(backend)].cursor() as cursor:
        cursor.execute(f"UPDATE django_jobs_job SET {column} = %s WHERE id = %s", [value, job_id])
        assert cursor.rowcount == 1


@contextmanager
def sqlite_check_constraints_off():
    """Let SQLite store what its JSONField CHECK (json_valid) would refuse: a corrupt file or a
    writer that bypasses the constraint can still leave such bytes in the column."""
    with connections["default"].cursor() as cursor:
        cursor.execute("PRAGMA ignore_check_constraints = ON")
        try:
            yield cursor
        finally:
            cursor.execute("PRAGMA ignore_check_constraints = OFF")


def good_job_still_runs(backend: str, worker: QueueWorker) -> None:
    """After a bad message the same worker goes on to run the next good one."""
    good = scripted.using(backend=backend).dispatch(action="ok", key="good")
    result = worker.process_once()
    assert (result.status, result.job_id) == ("acked", good)
    assert runs("good") == 1


def assert_rejected(backend: str, result, job_id: str, counter_name: str, queue: str = "default") -> None:
    assert result.status == "rejected"
    assert result.job_id == job_id
    assert result.error.startswith("rejected:")
    job = row(backend, job_id)
    # Not a run: attempts unchanged; failed for good, with the reason kept for the admin.
    assert (job.status, job.attempts) == ("failed", 0)
    assert job.last_error.startswith("rejected:")
    assert job.owner_token is None and job.leased_until is None
    assert counter(counter_name, queue=queue) == 1
    assert counter("jobs_succeeded") == counter("jobs_failed") == 0
    assert runs("victim") == 0  # the handler never ran


# -- tampered rows: the signature catches every change to a signed field -------------------------------


def test_payload_tampered_through_the_orm_is_rejected(backend):
    job_id = scripted.using(backend=backend, max_retries=3).dispatch(action="ok", key="victim")
    Job.objects.using(alias(backend)).filter(pk=job_id).update(
        payload={"args": ["ok"], "kwargs": {"key": "victim", "db": "attacker"}}
    )
    worker = QueueWorker(backend)
    result = worker.process_once()
    assert_rejected(backend, result, job_id, "jobs_rejected_signature")
    assert "BadSignature" in result.error
    good_job_still_runs(backend, worker)


@pytest.mark.parametrize(
    "column, value",
    [
        ("signature", "0" * 64),
        ("signature", ""),  # unsigned
        ("payload", '{"args": ["ok"], "kwargs": {"key": "victim", "seconds": 1}}'),
        ("handler", "tests.testapp.jobs.noop"),  # a registered handler, but not the one signed
        ("max_retries", 50),  # more runs than the sender allowed
        ("priority", 100),
        ("timeout", 9999),
        ("name", "renamed"),
        ("idempotency_key", "someone-elses-key"),
        ("options", '{"retry_on": ["builtins.Exception"]}'),  # per-job behaviour travels signed too
    ],
)
def test_signed_column_tampered_with_raw_sql_is_rejected(backend, column, value):
    job_id = scripted.using(backend=backend).dispatch(action="ok", key="victim")
    raw_update(backend, job_id, column, value)
    worker = QueueWorker(backend)
    result = worker.process_once()
    assert_rejected(backend, result, job_id, "jobs_rejected_signature")
    good_job_still_runs(backend, worker)


def test_row_moved_to_another_queue_is_rejected_there(backend):
    # The queue is inside the MAC: a job cannot be replayed onto another queue.
    job_id = scripted.using(backend=backend).dispatch(action="ok", key="victim")
    raw_update(backend, job_id, "queue", "other")
    worker = QueueWorker(backend, ["default", "other"])
    result = worker.process_once()
    assert result.queue == "other"
    assert_rejected(backend, result, job_id, "jobs_rejected_signature", queue="other")
    assert counter("jobs_rejected_signature", queue="default") == 0
    good_job_still_runs(backend, worker)


def test_bumped_attempts_dead_letters_without_running(backend):
    # attempts is not signed (it changes on every requeue); a row claiming its budget is spent
    # is settled as failed without running, never run "one more time".
    job_id = scripted.using(backend=backend, max_retries=1).dispatch(action="ok", key="victim")
    raw_update(backend, job_id, "attempts", 5)
    worker = QueueWorker(backend)
    result = worker.process_once()
    assert result.status == "dead-lettered"
    job = row(backend, job_id)
    assert (job.status, job.attempts) == ("failed", 5)
    assert runs("victim") == 0
    good_job_still_runs(backend, worker)


def test_row_resigned_with_a_wrong_key_is_rejected_unless_verification_is_off(backend):
    with jobs_settings(SIGNING_KEY="an-attacker-guessed-key"):
        forged = scripted.using(backend=backend).dispatch(action="ok", key="victim")
        forged_too = scripted.using(backend=backend).dispatch(action="ok", key="unverified")
    worker = QueueWorker(backend)
    assert_rejected(backend, worker.process_once(), forged, "jobs_rejected_signature")
    # VERIFY_SIGNATURE False (e.g. during a key migration) trusts the row as it is.
    with jobs_settings(VERIFY_SIGNATURE=False):
        result = QueueWorker(backend).process_once()
    assert (result.status, result.job_id) == ("acked", forged_too)
    assert runs("unverified") == 1


# -- undecodable rows ----------------------------------------------------------------------------------


def test_garbage_in_the_sqlite_payload_column_is_rejected():
    job_id = scripted.dispatch(action="ok", key="victim")
    with sqlite_check_constraints_off():
        raw_update("default", job_id, "payload", "{not json at all")
    worker = QueueWorker("default")
    result = worker.process_once()
    assert_rejected("default", result, job_id, "jobs_rejected_payload")
    assert "InvalidPayload" in result.error and "undecodable" in result.error
    good_job_still_runs("default", worker)


def test_sqlite_json_check_constraint_refuses_garbage():
    # Why the test above has to switch the CHECK off: normally the column refuses it.
    from django.db import IntegrityError, transaction

    job_id = scripted.dispatch(action="ok", key="victim")
    with pytest.raises(IntegrityError), transaction.atomic():
        raw_update("default", job_id, "payload", "{not json at all")


@pytest.mark.parametrize("garbage", ['{"args": [1e999], "kwargs": {}}', '{"args": ["\\ud800"], "kwargs": {}}'])
def test_json_valid_but_unsignable_sqlite_payload_is_rejected(garbage):
    job_id = scripted.dispatch(action="ok", key="victim")
    raw_update("default", job_id, "payload", garbage)  # passes the CHECK constraint
    worker = QueueWorker("default")
    result = worker.process_once()
    assert_rejected("default", result, job_id, "jobs_rejected_payload")
    good_job_still_runs("default", worker)


def test_options_column_of_the_wrong_type_is_rejected(backend):
    # Valid JSON, wrong shape (options must be an object): refused while decoding, before any
    # field of the row is trusted.
    job_id = scripted.using(backend=backend).dispatch(action="ok", key="victim")
    raw_update(backend, job_id, "options", "[1, 2, 3]")
    worker = QueueWorker(backend)
    result = worker.process_once()
    assert_rejected(backend, result, job_id, "jobs_rejected_payload")
    assert "options" in result.error
    good_job_still_runs(backend, worker)


# Past 64 times the cap a row is refused before parsing; between the cap and that bound it is
# parsed and measured as a dispatch measures it (decision 201): refused both ways here.
@pytest.mark.parametrize("pad", [5_000, 200_000], ids=["measured-again", "before-parsing"])
def test_oversized_row_is_rejected(backend, pad):
    job_id = scripted.using(backend=backend).dispatch(action="ok", key="victim")
    raw_update(backend, job_id, "payload", '{"args": ["ok"], "kwargs": {"key": "victim", "pad": "%s"}}' % ("x" * pad))
    with jobs_settings(MAX_MESSAGE_BYTES=2000):
        worker = QueueWorker(backend)
        result = worker.process_once()
        assert_rejected(backend, result, job_id, "jobs_rejected_payload")
        assert "cap" in result.error
        good_job_still_runs(backend, worker)


@pytest.mark.parametrize("pad", [[5e-324] * 300, [0] * 1200], ids=["tiny-floats", "small-ints"])
def test_a_row_dispatch_accepted_runs_though_its_stored_json_is_longer(backend, pad):
    """docs/settings.md: the payload's JSON must fit ``MAX_MESSAGE_BYTES`` at dispatch, and a
    worker rejects a row whose payload and options exceed it. PostgreSQL hands ``jsonb`` back as
    its own text, a space after every comma and numbers in full decimal (5e-324 is 328
    characters): these payloads fit at dispatch, came back 2 to 47 times longer, and were
    rejected unrun (red team). They run, with what they were given."""
    with jobs_settings(MAX_MESSAGE_BYTES=3000):
        job_id = scripted.using(backend=backend).dispatch(action="ok", key="fits", pad=pad)
        result = QueueWorker(backend).process_once()
    assert (result.status, result.job_id) == ("acked", job_id), result.error
    assert runs("fits") == 1


def test_job_payload_of_the_wrong_shape_fails_without_retry(backend):
    # Signed and valid JSON, but a @job payload must be {"args": [...], "kwargs": {...}}: the
    # function never runs, and InvalidPayload is permanent whatever max_retries says.
    job_id = Jobs.define(scripted.key, ["ok", "victim"]).max_retries(3).dispatch(backend=backend)
    worker = QueueWorker(backend)
    result = worker.process_once()
    assert result.status == "dead-lettered"
    job = row(backend, job_id)
    assert job.status == "failed" and job.last_error.startswith("InvalidPayload")
    assert runs("victim") == 0
    assert counter("jobs_failed_permanently", queue="default") == 1
    good_job_still_runs(backend, worker)


# -- unknown handlers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "handler",
    [
        "no.such.handler",
        "os.system",  # an importable path is still not a registered handler
        "tests.testapp.models.SideEffect",
    ],
)
def test_message_naming_an_unknown_handler_is_rejected(backend, handler):
    job_id = Jobs.define(handler, "rm -rf /").max_retries(3).dispatch(backend=backend)
    worker = QueueWorker(backend)
    result = worker.process_once()
    assert_rejected(backend, result, job_id, "jobs_rejected_handler")
    assert "HandlerNotAllowed" in result.error
    good_job_still_runs(backend, worker)


# -- non-JSON payloads at dispatch ---------------------------------------------------------------------

BAD_PAYLOADS = {
    "datetime": datetime(2026, 6, 1, tzinfo=UTC),
    "set": {1, 2},
    "nan": math.nan,
    "infinity": math.inf,
    "bytes": b"raw",
    "object": object(),
}


@pytest.mark.parametrize("kind", list(BAD_PAYLOADS))
def test_non_json_payload_is_refused_at_dispatch(backend, kind):
    value = BAD_PAYLOADS[kind]
    with pytest.raises(InvalidPayload, match="not JSON-serialisable"):
        Jobs.define("command", {"value": value}).dispatch(backend=backend)
    with pytest.raises(InvalidPayload):
        scripted.using(backend=backend).dispatch(action=value)
    with pytest.raises(InvalidPayload):
        Jobs.bulk([scripted.using().builder(action="ok"), scripted.using().builder(action=value)], backend=backend)
    # Nothing was inserted, not even the good half of the batch.
    assert Job.objects.using(alias(backend)).count() == 0


def test_lone_surrogate_is_refused_with_invalid_payload():
    with pytest.raises(InvalidPayload):
        scripted.dispatch(action="file-\udcff.txt")
    assert Job.objects.count() == 0


# -- options that a record of the job could not hold -------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("priority", 2**31, "priority must be between"),
        ("priority", -(2**31) - 1, "priority must be between"),
        ("max_retries", 2**31, "max_retries must be at most 2147483647"),
        ("name", "n" * 256, "name of 256 characters is too long: at most 255"),
        ("name", "a\x00b", "name contains U+0000"),
    ],
)
def test_an_option_no_record_could_hold_is_refused_at_dispatch(option, value, message):
    # On a broker the job would run, but its failure could not be recorded for the admin.
    with pytest.raises(ValueError, match=re.escape(message)):
        scripted.using(backend="redis", **{option: value}).dispatch(action="ok")


@pytest.mark.parametrize("value", [1.5, True, "2"])
def test_max_retries_that_is_not_an_int_is_refused(value):
    """``max_retries(1.5)`` and ``max_retries(True)`` were taken and stored as 1 (a red team)."""
    with pytest.raises(TypeError, match=f"max_retries must be an int, not {type(value).__name__}"):
        scripted.using(max_retries=value).dispatch(action="ok")
    with pytest.raises(TypeError, match="max_retries must be an int"):
        Jobs.define(scripted.key).max_retries(value)
    assert Job.objects.count() == 0


@pytest.mark.parametrize(
    ("handler", "error", "message"),
    [
        ("h" * 256, ValueError, "handler of 256 characters is too long: at most 255"),
        ("a\x00b", ValueError, "handler contains U+0000"),
        ("", TypeError, "handler must be a non-empty str"),
        (None, TypeError, "handler must be a non-empty str"),
    ],
)
def test_a_handler_key_no_record_could_hold_is_refused_at_define(handler, error, message):
    """PostgreSQL raised its own ``DataError`` at dispatch for these (a red team)."""
    with pytest.raises(error, match=re.escape(message)):
        Jobs.define(handler, {})


def test_a_broker_records_a_failure_whose_fields_no_column_holds(redis_up):
    """A message from before dispatch refused such values (signed, genuine) is still recorded."""
    from django_jobs import signing
    from django_jobs.audit import record_failure

    envelope = Jobs.define("tests.testapp.jobs.scripted", {"args": [], "kwargs": {}}).queue("default").build()
    envelope = replace(envelope, name="n\x00" + "x" * 300, priority=2**40)
    envelope = replace(envelope, signature=signing.sign(envelope))
    record_failure(envelope, "RuntimeError: boom", "redis", 1)

    job = Job.objects.get(pk=envelope.id)
    assert (job.status, job.name, job.priority) == ("failed", ("n\ufffd" + "x" * 300)[:255], 2**31 - 1)


@pytest.mark.postgres
def test_a_job_past_a_limit_of_postgresql_is_refused_as_invalid_not_unreachable(postgres_up, monkeypatch):
    """PostgreSQL raises its errors of class 54 (program limit exceeded: a ``jsonb`` value past
    256 MB, one nested deeper than ``max_stack_depth`` allows) as ``OperationalError``, the class
    of a lost connection: such a job is refused as a payload too large is, so that code that
    retries on ``BackendUnavailable`` does not send it again and again."""
    nested: object = 0
    for _ in range(800):  # past what 100 kB of stack parses (about 650)
        nested = [nested]
    with connections["postgres"].cursor() as cursor:
        cursor.execute("SET LOCAL max_stack_depth = '100kB'")  # the test's transaction: undone with it
    monkeypatch.setattr(signing, "MAX_DEPTH", 1000)  # past PostgreSQL's, here (ours is 200)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 5000))  # Python 3.11 signs it two frames a level
    try:
        with pytest.raises(InvalidPayload) as raised, transaction.atomic(using="postgres"):
            Jobs.define("command", {"deep": nested}).dispatch(backend="pg")
    finally:
        sys.setrecursionlimit(limit)
    assert not isinstance(raised.value, ConnectionError)
    assert str(raised.value).startswith("backend 'pg' (") and "refused the job: " in str(raised.value)
    assert "stack depth limit exceeded" in str(raised.value)
    assert raised.value.__cause__ is not None, "the driver's own error is chained"
    assert Job.objects.using("postgres").count() == 0


def _nested(depth: int) -> object:
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


def test_a_payload_nested_to_the_cap_is_verified_however_deep_the_worker_calls_it(backend):
    """Dispatch took arguments nested as deep as the caller's own stack left room for (988
    lists from a plain script), and a worker, deeper in its own calls, could not verify them:
    rejected unrun, ``failed`` with 0 attempts (a red team). Signed fields nest at most
    ``signing.MAX_DEPTH`` lists and dicts, checked at dispatch, which a worker verifies however
    deep its own calls are."""
    with pytest.raises(InvalidPayload, match="nested more than 200 deep"):
        remember.using(backend=backend).dispatch(_nested(199))  # inside its arguments list and payload dict
    assert Job.objects.using(alias(backend)).count() == 0
    job_id = remember.using(backend=backend).dispatch(_nested(198))
    worker = QueueWorker(backend, ["default"])
    calls.clear()

    def far_down(frames: int):  # Python 3.11 verifies the payload two frames a level
        return far_down(frames - 1) if frames else worker.process_once()

    result = far_down(sys.getrecursionlimit() - 600)

    assert (result.status, result.job_id) == ("acked", job_id)
    assert calls == [((_nested(198),), {})]


@contextmanager
def table_locked_elsewhere() -> Iterator[None]:
    """Another session holds the jobs table locked (an ``ALTER TABLE``, a long migration)."""
    import psycopg

    db = connections["postgres"].settings_dict
    with psycopg.connect(
        host=db["HOST"], port=db["PORT"], user=db["USER"], dbname=db["NAME"], password=db["PASSWORD"] or None
    ) as other:
        other.execute(f"LOCK TABLE {Job._meta.db_table} IN ACCESS EXCLUSIVE MODE")
        yield
        other.rollback()


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ("SET LOCAL lock_timeout = '50ms'", "did not store the job in time: "),
        ("SET LOCAL statement_timeout = '50ms'", "did not store the job in time: "),
        ("SET TRANSACTION READ ONLY", "is read-only here: "),
    ],
    ids=["lock_timeout", "statement_timeout", "read_only"],
)
def test_a_dispatch_postgresql_answered_but_did_not_store_says_so(postgres_up, setting, says):
    """A statement cancelled by a timeout, and a write to a read-only transaction or standby:
    PostgreSQL answered, so the message does not say it is unreachable. The job was not stored,
    and trying again later can store it: ``BackendUnavailable``, the driver's error chained
    (the read-only error used to go up raw, as Django's ``InternalError``)."""
    with connections["postgres"].cursor() as cursor:
        cursor.execute(setting)  # the test's transaction: undone with it
    locked = table_locked_elsewhere() if "timeout" in setting else nullcontext()
    with locked, pytest.raises(BackendUnavailable) as raised:
        scripted.using(backend="pg").dispatch()
    assert str(raised.value).startswith("backend 'pg' (") and says in str(raised.value), raised.value
    assert "unreachable" not in str(raised.value)
    assert raised.value.__cause__ is not None, "the driver's own error is chained"
