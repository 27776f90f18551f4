"""Error paths that need no server: SQLite, the locmem cache, and backends faked one method deep.

The fakes subclass the real ``SyncBackend`` and override the one method whose failure a test is
about; the worker, pipeline, heartbeat and audit code under test stay real.
"""

from __future__ import annotations

import http.server
import logging
import ssl
import sys
import threading
import time
from datetime import timedelta
from typing import Any, ClassVar

import pytest
from django.conf import settings
from django.core.cache.backends.locmem import LocMemCache
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError
from django.test import override_settings
from django.utils import timezone

from django_jobs import Jobs, audit, checks, conf, heartbeat, operations, registry
from django_jobs.backends import get_backend, reset
from django_jobs.backends.base import Lease
from django_jobs.backends.redis import RedisBackend
from django_jobs.backends.sync import SyncBackend
from django_jobs.exceptions import HandlerNotAllowed, InvalidPayload, LeaseLost
from django_jobs.handlers import CommandHandler, ShellHandler, UrlHandler
from django_jobs.heartbeat import Heartbeat
from django_jobs.idempotency import IdempotencyGuard
from django_jobs.locks import CacheLock
from django_jobs.models import Job, JobStatus
from django_jobs.pipeline import DeliveryPipeline, JobContext, Outcome
from django_jobs.worker import QueueWorker
from tests.testapp import jobs as jobs_module
from tests.testapp.jobs import remember, scripted

pytestmark = pytest.mark.usefixtures("clean_state")

HERE = __name__


def jobs_settings(**changes: Any):
    return override_settings(JOBS={**settings.JOBS, **changes})


def lease_of(builder: Any) -> Lease:
    """A freshly leased delivery of the signed envelope ``builder`` describes."""
    env = builder.build()
    return Lease(
        token=env.id,
        owner_token="owner",
        expires_at=timezone.now() + timedelta(seconds=60),
        queue=env.queue,
        envelope=env,
    )


def wait_until(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


# -- fakes: a real backend with one method overridden -------------------------------------------


class NackFails(SyncBackend):
    nacks: ClassVar[list[Lease]] = []

    def nack(self, lease: Lease, delay: float, *, error: str = "", count_run: bool = True) -> None:
        NackFails.nacks.append(lease)
        raise ConnectionError("broker went away during nack")


class WaitFails(SyncBackend):
    waits = 0

    def wait_for_work(self, queues: list[str], timeout: float) -> bool:
        self.waits += 1
        raise ConnectionError("broker went away during wait")


class ExtendCounts(SyncBackend):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.extended: list[Lease] = []
        self.resets = 0

    def extend(self, lease: Lease, seconds: float) -> None:
        self.extended.append(lease)

    def reset_connection(self) -> None:
        self.resets += 1


class ExtendLost(SyncBackend):
    def extend(self, lease: Lease, seconds: float) -> None:
        raise LeaseLost("reaped")


class ExtendAndResetFail(SyncBackend):
    def extend(self, lease: Lease, seconds: float) -> None:
        raise ConnectionError("extend failed")

    def reset_connection(self) -> None:
        raise OSError("closing a dead socket failed")


class PurgeFails(SyncBackend):
    def purge_failed(self, queue: str, before: timedelta | None = None) -> int:
        raise ConnectionError("broker refused the purge")


class CloseRecords(SyncBackend):
    closed: ClassVar[list[str]] = []

    def close(self) -> None:
        CloseRecords.closed.append(self.name)


class SetFailsCache(LocMemCache):
    """The idempotency cache goes down just as a run's success is to be recorded."""

    def set(self, *args: Any, **kwargs: Any) -> None:
        raise ConnectionError("cache down")


class TouchRecordingCache(LocMemCache):
    touches: ClassVar[list[tuple[str, Any]]] = []

    def touch(self, key: Any, timeout: Any = None, version: Any = None) -> bool:
        TouchRecordingCache.touches.append((key, timeout))
        return super().touch(key, timeout, version)


class CanRetryRaises:
    """A class handler whose retry policy itself is broken."""

    def handle(self, context: Any) -> None:
        raise RuntimeError("handler failed")

    def can_retry(self, attempt: int, error: BaseException) -> bool:
        raise KeyError("policy bug")


class ExplodesOnInit:
    def __init__(self) -> None:
        raise RuntimeError("needs arguments")

    def handle(self, context: Any) -> None:  # pragma: no cover - never built
        pass


class _HandlerObject:
    seen: ClassVar[list[Any]] = []

    def handle(self, context: Any) -> str:
        _HandlerObject.seen.append(context.payload)
        return "done"


handler_object = _HandlerObject()


def backend_settings(**backends: str):
    """Extra backends whose ENGINE is one of the fakes above."""
    return jobs_settings(BACKENDS={**settings.JOBS["BACKENDS"], **{k: {"ENGINE": v} for k, v in backends.items()}})


# -- api: refused options -----------------------------------------------------------------------


def test_max_retries_must_not_be_negative():
    with pytest.raises(ValueError, match="must not be negative"):
        Jobs.define("command", "clearsessions").max_retries(-1)


def test_scheduled_at_refuses_a_string():
    with pytest.raises(TypeError, match="needs an aware datetime, not str"):
        Jobs.define("command", "clearsessions").scheduled_at("2030-01-01T00:00:00Z")  # type: ignore[arg-type]


def test_a_payload_with_nul_is_refused_at_build():
    with pytest.raises(InvalidPayload, match="U\\+0000"):
        Jobs.define("command", ["clearsessions", "a\x00b"]).build()


def test_an_oversized_payload_is_refused_before_the_envelope_is_built():
    refused = pytest.raises(InvalidPayload, match="payload of \\d+ bytes exceeds JOBS\\['MAX_MESSAGE_BYTES'\\]")
    with jobs_settings(MAX_MESSAGE_BYTES=100), refused:
        Jobs.define("command", ["clearsessions", "x" * 100]).build()


@pytest.mark.parametrize(
    ("key", "error", "message"),
    [
        (42, TypeError, "must be a str, not int"),
        ("k" * 256, ValueError, "256 characters is too long: at most 255"),
        ("a\x00b", ValueError, "contains U\\+0000"),
    ],
)
def test_bad_idempotency_keys_are_refused(key, error, message):
    with pytest.raises(error, match=message):
        Jobs.define("command", "clearsessions").idempotency_key(key)
    with pytest.raises(error, match=message):  # the same check guards the @job options path
        scripted.using(idempotency_key=key).builder().build()


# -- audit ----------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_record_failure_never_raises_and_logs_a_database_error(monkeypatch, caplog):
    env = scripted.builder().build()

    def broken(*args: Any, **kwargs: Any) -> None:
        raise DatabaseError("disk full")

    monkeypatch.setattr(Job.objects, "update_or_create", broken)
    with caplog.at_level(logging.ERROR, logger="django_jobs.audit"):
        audit.record_failure(env, "boom", "redis", attempts=1)
    assert "could not record the failure of job" in caplog.text
    assert env.id in caplog.text
    assert "disk full" in caplog.text
    assert not Job.objects.filter(pk=env.id).exists()


@pytest.mark.django_db
def test_an_oversized_forgery_is_recorded_with_its_text_fields_cut():
    env = scripted.builder().build()
    env.name = "n" * 1000  # the signature no longer matches, and the column holds 255
    audit.record_failure(env, "boom", "redis", attempts=1)
    assert not Job.objects.filter(pk=env.id).exists()
    kept = Job.objects.get()
    assert kept.id != env.id
    assert kept.name == "n" * 255
    assert kept.status == JobStatus.FAILED
    assert "Not the record of job" in kept.last_error
    assert "failed verification (BadSignature)" in kept.last_error


@pytest.mark.django_db
def test_a_broker_copy_never_overwrites_another_backends_row():
    env = scripted.builder().build()
    Jobs.backend("default").submit([env])  # the database backend's own row
    audit.record_failure(env, "boom", "redis", attempts=3)
    own = Job.objects.get(pk=env.id)
    assert own.status == JobStatus.PENDING
    assert own.backend == "default"
    copy = Job.objects.exclude(pk=env.id).get()
    assert "already belongs to backend 'default'" in copy.last_error
    assert copy.backend == "redis"


# -- pipeline -------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_can_retry_that_raises_means_no_retry(caplog):
    with jobs_settings(HANDLERS={"can-retry-raises": f"{HERE}.CanRetryRaises"}):
        job_id = Jobs.define("can-retry-raises", {}).max_retries(5).dispatch(backend="default")
        with caplog.at_level(logging.ERROR, logger="django_jobs"):
            result = QueueWorker("default").process_once()
    assert result.status is Outcome.DEAD_LETTERED
    assert "can_retry() raised; not retrying" in caplog.text
    assert "KeyError" in caplog.text
    row = Job.objects.get(pk=job_id)
    assert row.status == JobStatus.FAILED
    assert row.attempts == 1


@pytest.mark.django_db
def test_a_failing_cleanup_is_logged_and_the_job_still_acked(caplog, django_capture_on_commit_callbacks):
    caches = {**settings.CACHES, "setfails": {"BACKEND": f"{HERE}.SetFailsCache"}}
    before = len(jobs_module.calls)
    with override_settings(CACHES=caches), jobs_settings(IDEMPOTENCY_CACHE="setfails"):
        sync = Jobs.backend("sync")
        with caplog.at_level(logging.WARNING, logger="django_jobs"), django_capture_on_commit_callbacks(execute=True):
            remember.using(idempotency_key="once", backend="sync").dispatch("x")
    [result] = sync.last_results
    assert result.status is Outcome.ACKED
    assert "could not mark the idempotency key done" in caplog.text
    assert "cache down" in caplog.text
    assert len(jobs_module.calls) == before + 1  # it ran, once


@pytest.mark.django_db
def test_a_lease_the_heartbeat_found_lost_never_starts():
    backend = ExtendLost("lost", {})
    beat = Heartbeat(backend, lease_seconds=30)
    lease = lease_of(remember.builder("never"))
    beat.watch(lease)
    assert beat._extend(lease) is False  # a beat finds the lease reaped
    before = len(jobs_module.calls)
    result = DeliveryPipeline(backend, heartbeat=beat).process(lease)
    assert result.status is Outcome.LEASE_LOST
    assert len(jobs_module.calls) == before


# -- worker ---------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_leased_ahead_job_that_cannot_be_handed_back_is_logged(caplog):
    NackFails.nacks.clear()
    worker = QueueWorker(NackFails("nackfails", {}))
    lease = lease_of(remember.builder("ahead"))
    worker.batches.hold(lease)  # leased together with the last ack
    with caplog.at_level(logging.WARNING, logger="django_jobs.worker"):
        assert worker.run(max_jobs=0, reap=False) == 0
    assert NackFails.nacks == [lease]
    assert not worker.batches
    assert f"job {lease.token}: could not hand back the job leased ahead" in caplog.text
    assert "broker went away during nack" in caplog.text


def test_an_undecodable_leased_ahead_job_is_not_nacked():
    NackFails.nacks.clear()
    worker = QueueWorker(NackFails("nackfails", {}))
    worker.batches.hold(Lease(token="t", owner_token="o", expires_at=timezone.now(), queue="default"))
    assert worker.run(max_jobs=0, reap=False) == 0
    assert not worker.batches
    assert NackFails.nacks == []


@pytest.mark.django_db
def test_the_sync_backend_takes_a_leased_ahead_job_back_quietly(caplog):
    worker = QueueWorker(SyncBackend("plain", {}))
    worker.batches.hold(lease_of(remember.builder("ahead")))
    with caplog.at_level(logging.WARNING, logger="django_jobs.worker"):
        assert worker.run(max_jobs=0, reap=True) == 0
    assert not worker.batches
    assert "could not hand back" not in caplog.text


def test_a_failing_wait_for_work_is_logged_and_the_worker_sleeps_instead(caplog):
    backend = WaitFails("waitfails", {})
    worker = QueueWorker(backend)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="django_jobs.worker"):
        done = worker.run(max_time=0.3, sleep=0.1, reap=False)
    assert done == 0
    assert backend.waits >= 1
    assert "worker: waiting for work on backend 'waitfails'" in caplog.text
    assert "broker went away during wait" in caplog.text
    # It slept between polls instead of spinning on the failing wait.
    assert time.monotonic() - start >= 0.25
    assert backend.waits <= 5


def test_the_sync_backends_reaper_finds_nothing():
    assert SyncBackend("plain", {}).reap_expired("default") == 0
    assert SyncBackend("plain", {}).reap_expired() == 0


# -- heartbeat ------------------------------------------------------------------------------------


def _lease(token: str = "t") -> Lease:
    return Lease(token=token, owner_token="o", expires_at=timezone.now(), queue="default")


def test_an_unexpected_error_in_a_heartbeat_action_does_not_end_the_thread(caplog):
    def kill_fails() -> None:
        raise RuntimeError("on_hard_timeout broke")

    backend = ExtendCounts("counts", {})
    beat = Heartbeat(backend, lease_seconds=0.3, on_hard_timeout=kill_fails)
    with caplog.at_level(logging.ERROR, logger="django_jobs.worker"):
        beat.start()
        try:
            beat.watch(_lease("first"))
            settled = threading.Event()
            beat.arm(time.monotonic(), settled.set)
            assert wait_until(lambda: "heartbeat: unexpected error; carrying on" in caplog.text)
            assert settled.is_set()
            second = _lease("second")
            beat.watch(second)
            assert wait_until(lambda: second in backend.extended), "the thread stopped beating"
        finally:
            beat.stop()
    assert "on_hard_timeout broke" in caplog.text


def test_a_failing_keep_alive_is_logged_resets_connections_and_the_lease_is_extended(caplog):
    backend = ExtendCounts("counts", {})
    beat = Heartbeat(backend, lease_seconds=30)
    lease = _lease("kept")
    renewed: list[int] = []

    def broken_keep() -> None:
        raise ConnectionError("lock cache down")

    with caplog.at_level(logging.WARNING, logger="django_jobs.worker"):
        beat._beat(lease, [broken_keep, lambda: renewed.append(1)])
    assert backend.extended == [lease]
    assert backend.resets == 1
    assert renewed == [1]  # one broken callback does not skip the others
    assert "job kept: could not renew its idempotency key or lock" in caplog.text


def test_a_reset_that_raises_is_swallowed_by_the_heartbeat(caplog):
    beat = Heartbeat(ExtendAndResetFail("broken", {}), lease_seconds=30)
    lease = _lease("gone")
    beat.watch(lease)
    with caplog.at_level(logging.DEBUG, logger="django_jobs.worker"):
        assert beat._extend(lease) is False
    assert "heartbeat: closing a broken connection failed" in caplog.text
    assert "job gone: heartbeat failed (ConnectionError: extend failed); retrying in" in caplog.text


def test_a_heartbeat_that_keeps_failing_tries_again_soon_and_warns_once(caplog):
    """Failed beats are tried again within a quarter second, at random moments (not in step
    with an outage that flaps); a run of failures is one warning, the rest at debug level."""
    beat = Heartbeat(ExtendAndResetFail("broken", {}), lease_seconds=60)
    lease = _lease("flaky")
    beat.watch(lease)
    waits = []
    with caplog.at_level(logging.DEBUG, logger="django_jobs.worker"):
        for _ in range(20):
            before = time.monotonic()
            assert beat._extend(lease) is False
            waits.append(beat._next_beat - before)
    assert all(0.1 - 0.01 <= wait <= 0.25 + 0.05 for wait in waits), waits
    assert len({round(wait, 3) for wait in waits}) > 1, "every try at the same pace"
    failures = [r for r in caplog.records if "heartbeat failed" in r.getMessage()]
    assert [r.levelno for r in failures] == [logging.WARNING] + [logging.DEBUG] * 19


def test_a_failed_beat_names_its_error_in_one_line_and_keeps_the_traceback_for_debug(caplog):
    """A flapping backend fails many beats: each warning was 80 lines of traceback (a red team:
    4,800 lines a minute per process). The line names the error; the traceback comes with DEBUG."""
    beat = Heartbeat(ExtendAndResetFail("broken", {}), lease_seconds=60)
    lease = _lease("terse")
    beat.watch(lease)
    with caplog.at_level(logging.WARNING, logger="django_jobs.worker"):
        beat._extend(lease)
    (record,) = [r for r in caplog.records if "heartbeat failed" in r.getMessage()]
    assert "(ConnectionError: extend failed)" in record.getMessage()
    assert record.exc_info is None
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="django_jobs.worker"):
        beat._extend(lease)
    assert all(r.exc_info for r in caplog.records if "heartbeat failed" in r.getMessage())


class LeaseGone(SyncBackend):
    def extend(self, lease: Lease, seconds: float) -> None:
        raise LeaseLost("gone")


def test_a_beat_that_finds_the_lease_gone_while_its_settle_is_under_way_is_no_alarm(caplog):
    """A beat held up by a slow link can reach the backend after the job's own ack: it finds the
    lease gone, though nothing reaped it (a red team: 10 false warnings in one run). While the
    settle is under way that is not a lost lease; the settle says whether it was."""
    beat = Heartbeat(LeaseGone("gone", {}), lease_seconds=60)
    settled, running = _lease("settled"), _lease("running")
    with caplog.at_level(logging.WARNING, logger="django_jobs.worker"):
        beat.watch(settled)
        beat.settling()
        assert beat._extend(settled) is False
        assert not beat.lost(settled)
        assert "lease lost while running" not in caplog.text
        beat.watch(running)
        assert beat._extend(running) is False
    assert beat.lost(running)
    assert "job running: lease lost while running" in caplog.text


def test_a_lease_found_lost_on_a_try_after_a_failed_one_may_have_been_settled_by_it():
    """A cut connection can lose the answer of a settle that was made: the try again then finds
    the lease gone, and says that the try before may have settled it."""
    from django_jobs.backends.base import retrying_settle

    answers = iter([ConnectionError("answer lost"), LeaseLost("gone")])

    def settle() -> None:
        raise next(answers)

    with pytest.raises(LeaseLost) as lost:
        retrying_settle(SyncBackend("sync", {}), settle, lambda error, pause: None, (0.0,))
    assert lost.value.after_failed_try

    def gone() -> None:
        raise LeaseLost("gone")

    with pytest.raises(LeaseLost) as lost:
        retrying_settle(SyncBackend("sync", {}), gone, lambda error, pause: None, (0.0,))
    assert not lost.value.after_failed_try


def test_a_hard_timeout_whose_settle_hangs_is_logged_and_still_kills(monkeypatch, caplog):
    monkeypatch.setattr(heartbeat, "SETTLE_BEFORE_KILL", 0.1)
    killed = threading.Event()
    release = threading.Event()
    beat = Heartbeat(ExtendCounts("counts", {}), lease_seconds=30, on_hard_timeout=killed.set)
    with caplog.at_level(logging.ERROR, logger="django_jobs.worker"):
        start = time.monotonic()
        beat._hard_timeout(lambda: release.wait(10))
        elapsed = time.monotonic() - start
    release.set()
    assert killed.is_set()
    assert elapsed < 5
    assert "hard timeout: the backend did not answer in 0.1s; the reaper will settle the job" in caplog.text


# -- conf, registry, checks, operations, backends ------------------------------------------------


def test_no_jobs_setting_means_every_default(settings):
    del settings.JOBS
    assert conf.user_settings() == {}
    assert conf.queues() == ["default"]


def test_jobs_setting_must_be_a_dict():
    refused = pytest.raises(ImproperlyConfigured, match="settings.JOBS must be a dict, not a list")
    with override_settings(JOBS=["not", "a", "dict"]), refused:
        conf.user_settings()


def test_a_long_bad_value_is_shortened_in_the_error():
    with jobs_settings(HANDLERS=[f"handler-{i}" for i in range(30)]), pytest.raises(ImproperlyConfigured) as raised:
        conf.handlers()
    message = str(raised.value)
    assert "...' (a list)" not in message
    assert "... (a list)" in message
    assert "handler-29" not in message


def test_empty_queues_setting_means_the_default_queue():
    with jobs_settings(QUEUES=[]):
        assert conf.queues() == ["default"]
        assert conf.default_queue() == "default"


def test_a_handler_path_that_cannot_be_imported_is_not_allowed():
    refused = pytest.raises(HandlerNotAllowed, match="'ghost' points to 'no_such_package.handlers.Ghost'")
    with jobs_settings(HANDLERS={"ghost": "no_such_package.handlers.Ghost"}), refused:
        registry.resolve("ghost", "default")


def test_a_handler_class_that_cannot_be_built_is_not_allowed():
    refused = pytest.raises(HandlerNotAllowed, match="cannot be instantiated: RuntimeError")
    with jobs_settings(HANDLERS={"explodes": f"{HERE}.ExplodesOnInit"}), refused:
        registry.resolve("explodes", "default")


def test_a_handler_object_from_settings_is_used_as_is():
    with jobs_settings(HANDLERS={"object": f"{HERE}.handler_object"}):
        assert registry.resolve("object", "default") is handler_object


def test_autodiscover_imports_the_imports_setting():
    refused = pytest.raises(ModuleNotFoundError, match="tests.no_such_jobs_module")
    with jobs_settings(IMPORTS=["tests.no_such_jobs_module"]), refused:
        registry.autodiscover()


def test_did_you_mean_ignores_a_non_string():
    assert checks.did_you_mean(5, ["default"]) is None
    assert checks.did_you_mean("defualt", ["default"]) == "did you mean 'default'?"


def test_a_jobs_module_that_fails_to_import_is_check_error_e013(monkeypatch):
    real = checks.import_module

    def broken(name: str) -> object:
        if name == "tests.testapp.jobs":
            raise SyntaxError("bad jobs module")
        return real(name)

    monkeypatch.setattr(checks, "import_module", broken)
    errors: list[Any] = []
    assert checks._import_job_modules(set(), errors) == {"tests.testapp.jobs"}
    assert [e.id for e in errors] == ["django_jobs.E013"]
    assert "jobs module 'tests.testapp.jobs' cannot be imported: SyntaxError: bad jobs module" in errors[0].msg


@pytest.mark.django_db
def test_job_aliases_skip_a_misconfigured_backend():
    with jobs_settings(BACKENDS={**settings.JOBS["BACKENDS"], "broken": {"ENGINE": "nope"}}):
        aliases = operations.job_aliases()
    assert "default" in aliases


def test_only_finished_jobs_can_be_purged():
    with pytest.raises(ValueError, match="only completed or failed"):
        operations.purge(JobStatus.PENDING)


@pytest.mark.django_db
def test_a_broker_that_cannot_purge_is_logged_and_the_rows_still_go(caplog):
    Job.objects.create(id="gone", queue="default", handler="h", status=JobStatus.FAILED, finished_at=timezone.now())
    with (
        jobs_settings(
            BACKENDS={"default": settings.JOBS["BACKENDS"]["default"], "pf": {"ENGINE": f"{HERE}.PurgeFails"}}
        ),
        caplog.at_level(logging.ERROR, logger="django_jobs"),
    ):
        assert operations.purge(JobStatus.FAILED, queue="default") == 1
    assert "could not purge failed messages of pf/default" in caplog.text
    assert not Job.objects.filter(pk="gone").exists()


def test_reset_closes_the_built_backends():
    CloseRecords.closed.clear()
    with backend_settings(closes=f"{HERE}.CloseRecords"):
        first = get_backend("closes")
        reset()
        assert CloseRecords.closed == ["closes"]
        assert get_backend("closes") is not first


# -- idempotency keys and locks renewed by the heartbeat ------------------------------------------


def _touching_cache():
    TouchRecordingCache.touches.clear()
    caches = {**settings.CACHES, "touch": {"BACKEND": f"{HERE}.TouchRecordingCache", "LOCATION": "touch"}}
    return override_settings(CACHES=caches)


def test_extend_renews_only_the_owners_idempotency_key():
    with _touching_cache(), jobs_settings(IDEMPOTENCY_CACHE="touch"):
        guard = IdempotencyGuard()
        guard.claim("k", "me", 5)
        guard.extend("k", "someone-else", 100)
        assert TouchRecordingCache.touches == []
        guard.extend("k", "me", 100)
        assert TouchRecordingCache.touches == [(guard.cache_key("k"), 101)]


def test_extend_renews_only_the_holders_lock():
    with _touching_cache(), jobs_settings(IDEMPOTENCY_CACHE="touch"):
        mine, theirs = CacheLock("single:x", "me", 30), CacheLock("single:x", "them", 30)
        assert mine.acquire()
        theirs.extend()
        assert TouchRecordingCache.touches == []
        mine.extend()
        assert TouchRecordingCache.touches == [("single:x", 31)]


# -- built-in handlers ----------------------------------------------------------------------------


def _context(payload: Any, timeout: float | None = None) -> JobContext:
    lease = lease_of(Jobs.define("command", payload))
    deadline = time.monotonic() + timeout if timeout else None
    return JobContext(lease.envelope, 1, deadline, lease)  # type: ignore[arg-type]


def test_command_handler_refuses_a_malformed_payload():
    with pytest.raises(InvalidPayload, match="command payload must be"):
        CommandHandler().handle(_context({"args": ["x"]}))


def test_shell_handler_refuses_a_malformed_payload():
    with pytest.raises(InvalidPayload, match="non-empty argv list"):
        ShellHandler().handle(_context(["ls", 1]))


def test_shell_handler_fails_on_a_non_zero_exit():
    with jobs_settings(ALLOWED_SHELL_COMMANDS=["false"]), pytest.raises(RuntimeError, match="false exited 1"):
        ShellHandler().handle(_context(["false"], timeout=10))


def test_url_handler_refuses_a_malformed_payload():
    with pytest.raises(InvalidPayload, match="url payload must be"):
        UrlHandler().handle(_context({"method": "GET"}))


def test_url_handler_fails_on_an_unresolvable_host():
    with pytest.raises(RuntimeError, match="cannot resolve 'no-such-host.invalid'"):
        UrlHandler().handle(_context("http://no-such-host.invalid/", timeout=10))


class _Headers(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[dict[str, str], bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        _Headers.seen.append((dict(self.headers), body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def local_server():
    _Headers.seen.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Headers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_url_handler_sends_a_json_body_as_json(local_server):
    with jobs_settings(URL_ALLOW_PRIVATE_NETWORKS=True):
        status = UrlHandler().handle(_context({"url": f"http://127.0.0.1:{local_server}/hook", "json": {"a": 1}}, 10))
    assert status == 204
    [(headers, body)] = _Headers.seen
    assert headers["Content-Type"] == "application/json"
    assert body == b'{"a": 1}'


def test_url_handler_speaks_tls_to_the_vetted_address(local_server):
    # The local server speaks plain HTTP: the pinned HTTPS connection reaches it and the TLS
    # handshake fails, so nothing is sent in clear text.
    with jobs_settings(URL_ALLOW_PRIVATE_NETWORKS=True), pytest.raises((ssl.SSLError, ConnectionError)):
        UrlHandler().handle(_context(f"https://localhost:{local_server}/secure", 10))
    assert _Headers.seen == []


# -- redis backend without a server ---------------------------------------------------------------


def test_redis_backend_needs_a_url_a_cache_or_sentinels():
    with pytest.raises(
        ImproperlyConfigured, match="needs OPTIONS\\['URL'\\], OPTIONS\\['CACHE'\\] or OPTIONS\\['SENTINELS'\\]"
    ):
        RedisBackend("nourl", {}).client  # noqa: B018


def test_redis_backend_with_a_cache_needs_django_redis(monkeypatch):
    monkeypatch.setitem(sys.modules, "django_redis", None)  # as if it were not installed
    with pytest.raises(ImproperlyConfigured, match="needs django-redis"):
        RedisBackend("viacache", {"CACHE": "default"}).client  # noqa: B018


def test_redis_wait_for_work_returns_at_once_for_a_due_message():
    backend = RedisBackend("due", {"URL": "redis://127.0.0.1:1/0"})  # never dialled
    backend._next_due["default"] = time.time() - 1  # a delayed message is already due
    start = time.monotonic()
    assert backend.wait_for_work(["default"], 5) is True
    assert time.monotonic() - start < 1


# -- the package's lazy exports and jobs_retry's arguments ---------------------------------------


def test_the_package_exports_its_worker_and_retry_policy_lazily():
    import django_jobs
    from django_jobs.retry import RetryPolicy
    from django_jobs.worker import QueueWorker

    assert django_jobs.RetryPolicy is RetryPolicy
    assert django_jobs.QueueWorker is QueueWorker
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = django_jobs.nope


@pytest.mark.parametrize("argv", [[], ["abc", "--all-failed"]])
def test_jobs_retry_wants_ids_or_all_failed_not_both(argv):
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match="give job ids or --all-failed"):
        call_command("jobs_retry", *argv)


@pytest.mark.django_db
def test_a_job_failed_for_good_is_logged_as_an_error_not_a_critical(caplog):
    from tests.testapp.jobs import scripted

    job_id = scripted.using(max_retries=0).dispatch(action="raise")
    with caplog.at_level(logging.DEBUG, logger="django_jobs.worker"):
        [result] = [QueueWorker("default").process_once()]
    assert result.status == Outcome.DEAD_LETTERED
    [record] = [r for r in caplog.records if "failed permanently" in r.getMessage()]
    assert record.levelno == logging.ERROR
    assert record.job_id == job_id and record.last_error.startswith("RuntimeError: scripted failure")
    assert not [r for r in caplog.records if r.levelno >= logging.CRITICAL]
