"""``manage.py jobs_health`` and the backend hooks it stands on (``oldest_ready_age``,
``persistence_warning``), on the real servers."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from io import StringIO
from urllib.parse import urlsplit

import pytest
import redis
from django.conf import settings
from django.core.management import CommandError, call_command
from django.utils import timezone

from django_jobs import Jobs
from django_jobs.backends.base import QueueBackend
from django_jobs.models import Job, Worker
from tests.api_support import jobs_settings
from tests.conftest import require_service
from tests.procs import wait_until
from tests.servers import free_port
from tests.testapp.jobs import scripted

# The test Redis (tests/settings.py), which keeps nothing on disk.
SHARED_REDIS = f"{urlsplit(settings.REDIS_URL).hostname}:{urlsplit(settings.REDIS_URL).port or 6379}"
pytestmark = [pytest.mark.django_db(databases=["default", "postgres"]), pytest.mark.usefixtures("clean_state")]


def health(*args: str) -> str:
    out = StringIO()
    call_command("jobs_health", *args, stdout=out)
    return out.getvalue()


def unhealthy(*args: str) -> tuple[str, str]:
    """The output and the error of a run that must exit 1."""
    out = StringIO()
    with pytest.raises(CommandError) as failed:
        call_command("jobs_health", *args, stdout=out)
    assert failed.value.returncode == 1
    return out.getvalue(), str(failed.value)


def serving(backend: str, *queues: str, **fields) -> Worker:
    """A Worker row, as a ``jobs_work`` process on ``backend`` writes it (seen now unless told)."""
    worker: Worker = Worker.objects.create(
        id=f"host:{Worker.objects.count() + 1}:x",
        hostname="host",
        pid=1,
        backend=backend,
        queues=list(queues),
        **fields,
    )
    return worker


def ready_since(backend: QueueBackend, seconds: float, queue: str = "default") -> str:
    """A signed job on ``queue`` that became ready ``seconds`` ago (negative: due later)."""
    env = scripted.using(queue=queue).builder(action="ok").build()
    return backend.enqueue(replace(env, available_at=timezone.now() - timedelta(seconds=seconds)))


# -- jobs_health --------------------------------------------------------------------------------------


def test_healthy_exits_0_with_a_line_per_check():
    serving("default", "default")
    scripted.dispatch(action="ok")  # ready just now

    lines = health("--queue", "default").splitlines()

    assert lines == [
        "ok       default: reachable",
        "ok       default/default: the oldest ready job has waited 0s",
        "ok       default/default: 1 live worker(s)",
        "healthy: 3 ok, 0 problem(s), 0 warning(s)",
    ]


def test_an_unreachable_backend_exits_1_naming_it(redis_up):
    closed = f"redis://127.0.0.1:{free_port()}/0"
    with jobs_settings(
        BACKENDS={**settings.JOBS["BACKENDS"], "redis": {"ENGINE": "redis", "OPTIONS": {"URL": closed}}}
    ):
        out, error = unhealthy("--backend", "redis", "--backend", "default", "--queue", "default")
    assert "problem  redis: unreachable: ConnectionError" in out
    assert error.startswith("unhealthy (") and "redis: unreachable" in error
    assert "default/default: no live worker serves it" in error  # the other backend is still checked


def test_an_old_ready_database_job_exits_1_naming_its_queue():
    serving("default", "default", "other")
    job_id = scripted.using(queue="other").dispatch(action="ok")
    Job.objects.filter(pk=job_id).update(available_at=timezone.now() - timedelta(hours=1))

    out, error = unhealthy("--queue", "default", "--queue", "other")

    assert "ok       default/default: no ready job waiting" in out
    assert "problem  default/other: the oldest ready job has waited 3600s, more than --max-age 300s" in out
    assert "default/other: the oldest ready job has waited 3600s" in error
    assert health("--queue", "default", "--queue", "other", "--max-age", "7200").endswith("0 warning(s)\n")


def test_no_age_check_ignores_a_backlog_but_not_an_unreachable_backend(redis_up):
    serving("default", "default")
    job_id = scripted.dispatch(action="ok")
    Job.objects.filter(pk=job_id).update(available_at=timezone.now() - timedelta(hours=1))

    lines = health("--queue", "default", "--no-age-check").splitlines()
    assert lines == [
        "ok       default: reachable",
        "ok       default/default: 1 live worker(s)",
        "healthy: 2 ok, 0 problem(s), 0 warning(s)",
    ]
    closed = f"redis://127.0.0.1:{free_port()}/0"
    with jobs_settings(
        BACKENDS={**settings.JOBS["BACKENDS"], "redis": {"ENGINE": "redis", "OPTIONS": {"URL": closed}}}
    ):
        out, _ = unhealthy("--backend", "redis", "--queue", "default", "--no-age-check", "--no-worker-check")
    assert "problem  redis: unreachable: ConnectionError" in out


def test_an_old_ready_redis_job_exits_1_naming_its_queue(redis_up):
    serving("redis", "default")
    ready_since(Jobs.backend("redis"), 3600)
    out, error = unhealthy("--backend", "redis", "--queue", "default")
    assert "problem  redis/default: the oldest ready job has waited 3600s" in out and "redis/default" in error


def test_an_old_ready_beanstalk_job_exits_1_naming_its_queue(beanstalk_up):
    serving("beanstalk", "default")
    backend = Jobs.backend("beanstalk")
    ready_since(backend, 0)
    # beanstalkd counts a job's age itself, in whole seconds, from its put: wait for the first.
    wait_until(lambda: (backend.oldest_ready_age("default") or 0) >= 1, 5, "a ready job of 1s")
    out, error = unhealthy("--backend", "beanstalk", "--queue", "default", "--max-age", "0.5")
    assert "problem  beanstalk/default: the oldest ready job has waited" in out and "beanstalk/default" in error


@pytest.mark.parametrize(
    "row",
    [
        {"last_seen": timezone.now() - timedelta(hours=1)},
        {"stopped_at": timezone.now() - timedelta(minutes=1)},
    ],
    ids=["dead", "stopped"],
)
def test_no_live_worker_exits_1(row):
    worker = serving("default", "default", **row)
    serving("default", "other")  # alive, but on another queue
    serving("pg", "default")  # alive, but on another backend

    out, error = unhealthy("--queue", "default")

    state = "stopped" if worker.stopped_at else "was last seen"
    assert f"problem  default/default: no live worker serves it (host:1 {state} " in out
    assert "default/default: no live worker serves it" in error
    assert health("--queue", "default", "--no-worker-check").startswith("ok       default: reachable\n")


def test_the_redis_persistence_warning_shows_and_fails_only_with_strict(redis_up):
    serving("redis", "default")
    expected = (
        f"warning  redis: Redis at {SHARED_REDIS} keeps nothing on disk (no AOF, no RDB save points): "
        "a restart loses every queued job"
    )

    out = health("--backend", "redis", "--queue", "default")
    assert expected in out.splitlines()
    assert out.endswith("healthy: 3 ok, 0 problem(s), 1 warning(s)\n")

    out, error = unhealthy("--backend", "redis", "--queue", "default", "--strict")
    assert expected in out.splitlines() and "--strict" in error and "keeps nothing on disk" in error


def test_json_output_parses():
    serving("default", "default")
    report = json.loads(health("--queue", "default", "--json"))
    assert report["healthy"] is True and report["strict"] is False
    assert [(c["what"], c["backend"], c["queue"], c["status"]) for c in report["checks"]] == [
        ("reachable", "default", None, "ok"),
        ("ready-age", "default", "default", "ok"),
        ("workers", "default", "default", "ok"),
    ]

    out = StringIO()
    with pytest.raises(CommandError):
        call_command("jobs_health", "--queue", "other", "--json", stdout=out)
    report = json.loads(out.getvalue())
    assert report["healthy"] is False and report["checks"][-1]["status"] == "problem"


def test_a_sync_backend_has_nothing_to_watch():
    assert health("--backend", "sync", "--queue", "default").splitlines()[0].startswith("ok       sync: runs each job")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "nope"], "unknown backend 'nope'"),
        (["--queue", "nope"], "unknown queue(s) nope"),
        (["--max-age", "0"], "--max-age must be a positive number of seconds, not 0.0"),
        (["--max-age", "nan"], "--max-age must be a positive number of seconds"),
    ],
)
def test_bad_arguments_are_one_line_errors(args, message):
    with pytest.raises(CommandError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as failed:
        call_command("jobs_health", *args, stdout=StringIO())
    assert "\n" not in str(failed.value)


# -- oldest_ready_age, per backend --------------------------------------------------------------------

# backend name, its service fixture, and what its age counts from: "ready" (when the job became
# ready: the database row's available_at, a Redis envelope's), "put" (beanstalkd: when it was
# put, in whole seconds), None (the backend cannot tell).
AGE_CASES = [
    pytest.param("default", None, "ready", id="database-sqlite"),
    pytest.param("pg", "postgres_up", "ready", id="database-postgres"),
    pytest.param("redis", "redis_up", "ready", id="redis"),
    pytest.param("beanstalk", "beanstalk_up", "put", id="beanstalk"),
    pytest.param("servicebus", None, None, id="servicebus"),
    pytest.param("sync", None, None, id="sync"),
]


@pytest.fixture
def aged(request: pytest.FixtureRequest) -> Iterator[tuple[QueueBackend, str | None]]:
    name, service, counts_from = request.param
    if service:
        request.getfixturevalue(service)
    yield Jobs.backend(name), counts_from


@pytest.mark.parametrize(
    "aged", [case.values for case in AGE_CASES], ids=[case.id for case in AGE_CASES], indirect=True
)
def test_oldest_ready_age(aged):
    backend, counts_from = aged
    queue = "emails"
    assert backend.oldest_ready_age(queue) is None  # nothing ready

    ready_since(backend, -3600, queue)  # delayed by an hour: not ready, not counted
    assert backend.oldest_ready_age(queue) is None

    ready_since(backend, 60, queue)
    ready_since(backend, 30, queue)
    age = backend.oldest_ready_age(queue)
    if counts_from is None:
        assert age is None
    elif counts_from == "put":
        assert age is not None and 0 <= age < 60
    else:
        assert age is not None and 60 <= age < 120


def test_redis_cannot_tell_the_age_of_a_job_dispatched_to_run_at_once(redis_up):
    scripted.using(backend="redis", queue="emails").dispatch(action="ok")
    assert Jobs.backend("redis").oldest_ready_age("emails") is None


def test_redis_counts_a_due_delayed_job_from_its_due_time(redis_up):
    backend = Jobs.backend("redis")
    ready_since(backend, -3600, "emails")
    keys = backend.keys("emails")
    [job_id] = backend.client.zrange(keys.delayed, 0, -1)
    due = (timezone.now() - timedelta(seconds=90)).timestamp() * 1000
    backend.client.zadd(keys.delayed, {job_id: due})  # came due 90 s ago; no fetch promoted it yet
    age = backend.oldest_ready_age("emails")
    assert age is not None and 90 <= age < 150


# -- persistence_warning ------------------------------------------------------------------------------


def test_redis_warns_when_it_keeps_nothing_on_disk(redis_up):
    assert Jobs.backend("redis").persistence_warning() == (
        f"Redis at {SHARED_REDIS} keeps nothing on disk (no AOF, no RDB save points): a restart loses every queued job"
    )


def test_redis_with_an_aof_keeps_its_jobs(private_redis):
    with jobs_settings(BACKENDS={"redis": {"ENGINE": "redis", "OPTIONS": {"URL": private_redis.url}}}):
        assert Jobs.backend("redis").persistence_warning() is None


@pytest.fixture
def redis_without_config() -> Iterator[str]:
    """A redis-server of this test's own, without persistence and with CONFIG disabled (as
    managed Redis services do); its URL."""
    binary = shutil.which("redis-server")
    require_service("redis-server", binary is not None, "redis-server is not on PATH")
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    server = subprocess.Popen(
        [*args, "--rename-command", "CONFIG", "", "--dir", "/tmp"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        client = redis.Redis(port=port, socket_connect_timeout=1)
        wait_until(lambda: _pings(client), 30, f"the private redis-server on port {port}")
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.kill()
        server.wait(10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def test_redis_without_config_is_judged_by_info_persistence(redis_without_config):
    port = redis_without_config.rsplit(":", 1)[1].split("/")[0]
    with jobs_settings(BACKENDS={"redis": {"ENGINE": "redis", "OPTIONS": {"URL": redis_without_config}}}):
        assert Jobs.backend("redis").persistence_warning() == (
            f"Redis at 127.0.0.1:{port} has AOF off and has written no RDB snapshot since it started (its save "
            "points are unknown: CONFIG is disabled): a restart may lose every queued job"
        )


@pytest.mark.parametrize("name", ["default", "beanstalk", "servicebus", "sync"])
def test_other_backends_have_no_persistence_warning(name):
    assert Jobs.backend(name).persistence_warning() is None
