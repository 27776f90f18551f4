"""What a dispatch sends to its backend's server: round trips and statements, never time.

On Redis one dispatch is one ``EVALSHA`` in one round trip (a pipeline would ask ``SCRIPT
EXISTS`` first), and a bulk one script call per 1,000 jobs of a queue, in one round trip; on a
Redis Cluster too (a queue is one slot: one primary gets them all). On the
database one dispatch is one INSERT, and a bulk of 2,500 one INSERT per 1,000 rows on PostgreSQL
(one ``executemany`` of the one-row INSERT elsewhere, which the driver batches).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import redis.connection
from django.db import connections
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_jobs import Jobs, rows
from django_jobs.backends import redis_connection
from django_jobs.backends.base import QueueBackend
from django_jobs.backends.redis import RedisBackend
from django_jobs.models import Job
from django_jobs.worker import QueueWorker
from tests.backend_params import BACKEND_PARAMS, PG_SERVER_SIDE_BINDING, BackendCase, backend_of, ready_case
from tests.testapp.jobs import scripted

DATABASES = [*(param for param in BACKEND_PARAMS if str(param.id).startswith("database-")), PG_SERVER_SIDE_BINDING]
REDIS = [param for param in BACKEND_PARAMS if param.id in ("redis", "redis-cluster")]
BULK = 2500


@pytest.fixture(params=DATABASES)
def database_backend(request: pytest.FixtureRequest) -> Iterator[tuple[BackendCase, QueueBackend]]:
    case = ready_case(request)
    with backend_of(case) as backend:
        yield case, backend


@pytest.fixture(params=REDIS)
def redis_backend_case(request: pytest.FixtureRequest) -> Iterator[tuple[BackendCase, RedisBackend]]:
    case = ready_case(request)
    with backend_of(case) as backend:
        assert isinstance(backend, RedisBackend)
        yield case, backend


def dispatch(case: BackendCase, **options: Any) -> str:
    return scripted.using(backend=case.name, **options).dispatch(action="ok", key=None, db=case.side_effect_db)


def bulk(case: BackendCase, count: int) -> list[str]:
    builders = [scripted.builder(action="ok", key=f"k{index}", db=case.side_effect_db) for index in range(count)]
    return Jobs.bulk(builders, backend=case.name)


# -- the database: statements --


def test_a_dispatch_is_one_insert(database_backend):
    case, backend = database_backend
    dispatch(case)  # the first one builds the statement
    with CaptureQueriesContext(connections[backend.alias]) as queries:
        job_id = dispatch(case, priority=3)
    assert [query["sql"].split()[:2] for query in queries.captured_queries] == [["INSERT", "INTO"]]
    row = Job.objects.using(backend.alias).get(pk=job_id)
    assert (row.status, row.priority, row.attempts, row.owner_token, row.last_error, row.has_dependents) == (
        "pending",
        3,
        0,
        None,
        "",
        False,
    )


def test_a_bulk_of_2500_is_one_insert_per_1000_rows(database_backend):
    case, backend = database_backend
    connection = connections[backend.alias]
    with CaptureQueriesContext(connection) as queries:
        ids = bulk(case, BULK)
    # (Outside the test's transaction, as with server-side binding, the bulk's own one shows.)
    statements = [query["sql"] for query in queries.captured_queries if query["sql"] not in ("BEGIN", "COMMIT")]
    assert all(sql.split()[:2] == ["INSERT", "INTO"] or " times: INSERT INTO" in sql for sql in statements)
    if connection.vendor == "postgresql":
        assert len(statements) == 3  # 1,000 + 1,000 + 500 rows
    else:
        assert len(statements) == 1 and statements[0].startswith(f"{BULK} times: ")  # one executemany
    stored = Job.objects.using(backend.alias).filter(pk__in=ids)
    assert stored.count() == BULK
    assert set(stored.values_list("status", "attempts", "has_dependents").distinct()) == {("pending", 0, False)}


def test_a_bulk_too_large_for_one_statement_is_split(database_backend, monkeypatch):
    """On PostgreSQL a bulk's rows are one jsonb value, which holds at most 256 MB: 1,000 jobs
    of 300 KB each were refused whole ("total size of jsonb array elements exceeds the
    maximum"). Rows past ``JSON_CHARS_PER_STATEMENT`` go in more statements, every one kept."""
    case, backend = database_backend
    connection = connections[backend.alias]
    monkeypatch.setattr(rows, "JSON_CHARS_PER_STATEMENT", 20_000)
    builders = [
        scripted.builder(action="ok", key=None, db=case.side_effect_db, blob=f"{index}" * 2_000) for index in range(30)
    ]
    with CaptureQueriesContext(connection) as queries:
        ids = Jobs.bulk(builders, backend=case.name)
    inserts = [query for query in queries.captured_queries if "INSERT INTO" in query["sql"]]
    if connection.vendor == "postgresql":
        assert 4 <= len(inserts) <= 8, len(inserts)  # 30 rows of about 2,300 characters
    stored = dict(Job.objects.using(backend.alias).filter(pk__in=ids).values_list("id", "payload"))
    assert [stored[job_id]["kwargs"]["blob"] for job_id in ids] == [f"{index}" * 2_000 for index in range(30)]


# Values whose text form a driver must quote or a JSON column may rewrite: each is written by a
# bulk exactly as by one dispatch (on PostgreSQL both send their rows as one JSON text; elsewhere
# a parameter per value), and as they were given.
AWKWARD = [
    {"quote": 'it\'s "so"', "slash": "back\\slash", "braces": "{a,b} (c) [d]", "null": "NULL", "empty": ""},
    {"floats": [1e20, 0.5, 1.5e300, 2.0], "ints": [0, -1, 2**53], "none": None, "bool": [True, False]},
    {"text": "ünïcödé 字 \t tab \n newline", "nested": {"deep": [[{"x": None}], {}]}},
]


def _stored(alias: str, job_id: str) -> dict[str, Any]:
    """A job row's columns, but those one dispatch and another never share."""
    row = Job.objects.using(alias).values().get(pk=job_id)
    for name in ("id", "signature", "created_at", "updated_at"):
        row.pop(name)
    return row


def test_a_bulk_writes_each_row_as_one_dispatch_does(database_backend):
    """What a bulk writes is what one dispatch writes, and what each was given, for values a
    driver must quote and floats a JSON column may rewrite (on PostgreSQL both send their rows as
    one JSON text, read back with a cast per column); and each job runs, its signature verified,
    with the payload it was given."""
    case, backend = database_backend
    at = timezone.now().replace(microsecond=123456) + timedelta(days=1)
    options: list[dict[str, Any]] = [
        {"priority": -7, "timeout": 2.5, "name": "named", "idempotency_key": uuid.uuid4().hex, "scheduled_at": at},
        {"max_retries": 3, "queue": "emails", "scheduled_at": at},
        {"scheduled_at": at},
    ]
    single, builders = [], []
    for payload, opts in zip(AWKWARD, options, strict=True):
        once = {**opts, "idempotency_key": f"{opts['idempotency_key']}-single"} if "idempotency_key" in opts else opts
        single.append(scripted.using(backend=case.name, **once).dispatch(key=None, db=case.side_effect_db, **payload))
        builders.append(scripted.using(**opts).builder(key=None, db=case.side_effect_db, **payload))
    bulked = Jobs.bulk(builders, backend=case.name)
    for one, other in zip(single, bulked, strict=True):
        expected, got = _stored(backend.alias, one), _stored(backend.alias, other)
        if expected["idempotency_key"]:
            expected["idempotency_key"] = expected["idempotency_key"].removesuffix("-single")
        assert repr(got) == repr(expected)  # a float stays a float, not an equal int
        index = bulked.index(other)
        assert got["payload"]["kwargs"] == {"key": None, "db": case.side_effect_db, **AWKWARD[index]}
        given = options[index]
        assert (got["priority"], got["timeout"], got["name"], got["max_retries"], got["queue"]) == (
            given.get("priority", 0),
            given.get("timeout"),
            given.get("name", got["handler"]),
            given.get("max_retries", 0),
            given.get("queue", "default"),
        )
        assert got["available_at"] == at and got["idempotency_key"] == given.get("idempotency_key")
    Job.objects.using(backend.alias).filter(pk__in=single + bulked).update(available_at=timezone.now())
    worker = QueueWorker(case.name, ["default", "emails"], prefetch=1)
    assert sorted(worker.process_once(queue).status for queue in ["default"] * 4 + ["emails"] * 2) == ["acked"] * 6


# -- Redis: round trips --


def _names(packed: bytes) -> list[str]:
    """The names of the commands in ``packed`` (RESP arrays of bulk strings), in order;
    ``SCRIPT`` with its subcommand."""
    names, at = [], 0
    while at < len(packed):
        end = packed.index(b"\r\n", at)
        count, at = int(packed[at + 1 : end]), end + 2
        words = []
        for _ in range(count):
            end = packed.index(b"\r\n", at)
            size, at = int(packed[at + 1 : end]), end + 2
            words.append(packed[at : at + size])
            at += size + 2
        name = words[0].decode().upper()
        names.append(f"{name} {words[1].decode().upper()}" if name == "SCRIPT" else name)
    return names


@contextmanager
def round_trips(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[str]]]:
    """What the Redis client sends while it is open: one list of command names per send (a
    round trip: a pipeline sends all its commands at once)."""
    sent: list[list[str]] = []
    original = redis.connection.AbstractConnection.send_packed_command

    def spy(self: Any, command: Any, check_health: bool = True) -> None:
        packed = command if isinstance(command, bytes) else b"".join(bytes(chunk) for chunk in command)
        sent.append(_names(packed))
        original(self, command, check_health)

    with monkeypatch.context() as patch:
        patch.setattr(redis.connection.AbstractConnection, "send_packed_command", spy)
        yield sent


def test_a_redis_dispatch_is_one_evalsha(redis_backend_case, monkeypatch, django_capture_on_commit_callbacks):
    case, backend = redis_backend_case
    with django_capture_on_commit_callbacks(execute=True):
        dispatch(case)  # connects
    with round_trips(monkeypatch) as sent, django_capture_on_commit_callbacks(execute=True):
        job_id = dispatch(case, priority=2)
    assert sent == [["EVALSHA"]]
    assert backend.peek(job_id) is not None


def test_a_redis_dispatch_loads_a_script_the_server_lost_then_sends_it_again(
    redis_backend_case, monkeypatch, django_capture_on_commit_callbacks
):
    case, backend = redis_backend_case
    for server in redis_connection.servers(backend.client):
        server.ping()  # connects (to every primary of a cluster), and registers the scripts
    # A script no server holds yet, as after a restart: its source differs by a comment.
    lost = backend.client.register_script(f"{backend._scripts['enqueue'].script}\n-- {uuid.uuid4().hex}")
    monkeypatch.setitem(backend._scripts, "enqueue", lost)
    with round_trips(monkeypatch) as sent, django_capture_on_commit_callbacks(execute=True):
        job_id = dispatch(case)
    loads = [["SCRIPT LOAD"]] * len(redis_connection.servers(backend.client))  # every primary of a cluster
    assert sent == [["EVALSHA"], *loads, ["EVALSHA"]]
    assert backend.peek(job_id) is not None


def test_a_redis_bulk_is_one_round_trip_of_one_script_call_per_1000_jobs(
    redis_backend_case, monkeypatch, django_capture_on_commit_callbacks
):
    case, backend = redis_backend_case
    with django_capture_on_commit_callbacks(execute=True):
        bulk(case, 2)  # connects, and the server loads the script
    with round_trips(monkeypatch) as sent, django_capture_on_commit_callbacks(execute=True):
        ids = bulk(case, BULK)
    assert sent == [["EVALSHA"] * 3]  # 1,000 + 1,000 + 500 jobs, no SCRIPT EXISTS
    assert backend.size("default") == BULK + 2
    assert all(backend.peek(job_id) is not None for job_id in ids[:: BULK // 10])
