"""Misconfigured settings are refused at run time too, not only by ``manage.py check``.

A str where a list is meant must never be iterated character by character (one-character signing
keys, queue ``d``, an allowlist turned into a substring test), an empty signing key never
accepted, and the ``command`` handler runs only the management commands of ``ALLOWED_COMMANDS``.
The last two tests start real ``jobs_work`` processes: a bad ``--backend`` is one line and a
non-zero exit, and a supervisor whose worker processes die at start-up gives up.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
from django.contrib.sessions.models import Session
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.test import override_settings
from django.utils import timezone

from django_jobs import Jobs, conf, registry, signing
from django_jobs.exceptions import HandlerNotAllowed
from django_jobs.handlers import CommandHandler, ShellHandler
from django_jobs.models import Job
from django_jobs.pool import WorkerPool
from django_jobs.worker import QueueWorker
from tests.api_support import jobs_settings, runs
from tests.procs import REPO_ROOT, processes, worker_env
from tests.testapp.jobs import scripted

REAL_KEY = "the-real-signing-key-of-this-deployment"


def forged(key: bytes | str, **fields) -> object:
    """An envelope signed with ``key``, as an attacker who guessed that key would write it."""
    env = Jobs.define("command", "clearsessions").build()
    env = replace(env, **fields)
    key = key if isinstance(key, bytes) else key.encode()
    return replace(env, signature=hmac.new(key, signing.canonical(env.signed_fields()), hashlib.sha256).hexdigest())


def context(payload: object) -> SimpleNamespace:
    return SimpleNamespace(payload=payload, remaining=lambda: 10.0)


# -- signing keys ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fallbacks", ["abc", b"abc"])
def test_signing_key_fallbacks_given_as_a_str_is_refused_not_read_as_one_character_keys(fallbacks):
    env = forged("a")  # what a one-character key signs
    with override_settings(JOBS={"SIGNING_KEY": REAL_KEY, "SIGNING_KEY_FALLBACKS": fallbacks}):
        with pytest.raises(ImproperlyConfigured, match="SIGNING_KEY_FALLBACKS"):
            signing.verify(env)
        with pytest.raises(ImproperlyConfigured, match="SIGNING_KEY_FALLBACKS"):
            Jobs.define("command", "clearsessions").build()  # and nothing is signed either


@pytest.mark.parametrize("fallbacks", [[""], [b""], ["an-old-key", ""]])
def test_an_empty_fallback_key_is_refused(fallbacks):
    env = forged(b"")  # anyone can compute an HMAC with the empty key
    with (
        override_settings(JOBS={"SIGNING_KEY": REAL_KEY, "SIGNING_KEY_FALLBACKS": fallbacks}),
        pytest.raises(ImproperlyConfigured, match="empty"),
    ):
        signing.verify(env)


@pytest.mark.parametrize("key", ["", b""])
def test_an_empty_signing_key_is_refused(key):
    with override_settings(JOBS={"SIGNING_KEY": key}), pytest.raises(ImproperlyConfigured, match="SIGNING_KEY"):
        Jobs.define("command", "clearsessions").build()


def test_a_signing_key_of_the_wrong_type_is_refused():
    with override_settings(JOBS={"SIGNING_KEY": ["a-key"]}), pytest.raises(ImproperlyConfigured, match="SIGNING_KEY"):
        Jobs.define("command", "clearsessions").build()


def test_secret_key_fallbacks_given_as_a_str_is_refused_when_keys_derive_from_them():
    derived = hashlib.sha256(b"django_jobs.signing:o").digest()  # the key an "o" fallback would derive
    env = forged(derived)
    with (
        override_settings(SECRET_KEY_FALLBACKS="old-secret", JOBS={"SIGNING_KEY": None}),
        pytest.raises(ImproperlyConfigured, match="SECRET_KEY_FALLBACKS"),
    ):
        signing.verify(env)
    # With a SIGNING_KEY of its own, django-jobs never reads them.
    with override_settings(SECRET_KEY_FALLBACKS="old-secret", JOBS={"SIGNING_KEY": REAL_KEY}):
        signing.verify(Jobs.define("command", "clearsessions").build())


def test_valid_keys_of_both_types_still_rotate():
    with override_settings(JOBS={"SIGNING_KEY": b"old-binary-key"}):
        old = Jobs.define("command", "clearsessions").build()
    with override_settings(JOBS={"SIGNING_KEY": REAL_KEY, "SIGNING_KEY_FALLBACKS": (b"old-binary-key",)}):
        signing.verify(old)


@pytest.mark.django_db
@pytest.mark.usefixtures("clean_state")
def test_a_worker_never_runs_a_job_forged_with_a_one_character_key():
    with jobs_settings(SIGNING_KEY="s"):
        job_id = scripted.dispatch(action="ok", key="forged")
    with jobs_settings(SIGNING_KEY=REAL_KEY, SIGNING_KEY_FALLBACKS="s3cret"):
        try:
            result = QueueWorker("default").process_once()
        except ImproperlyConfigured as exc:  # today: the worker logs it and backs off
            assert "SIGNING_KEY_FALLBACKS" in str(exc)
            result = None
    assert runs("forged") == 0
    assert result is None or result.status != "acked"
    assert Job.objects.get(pk=job_id).status != "completed"


# -- allowlists ----------------------------------------------------------------------------------------------


def test_allowed_shell_commands_given_as_a_str_is_refused_not_a_substring_test(tmp_path):
    marker = tmp_path / "ran"
    with (
        override_settings(JOBS={"ALLOWED_SHELL_COMMANDS": "sh -c"}),
        pytest.raises(ImproperlyConfigured, match="ALLOWED_SHELL_COMMANDS"),
    ):
        ShellHandler().handle(context(["sh", "-c", f"touch {marker}"]))
    assert not marker.exists()


def test_queue_handlers_given_as_a_str_is_refused_not_a_substring_test():
    with (
        override_settings(JOBS={"QUEUE_HANDLERS": {"default": "shell command"}}),
        pytest.raises(ImproperlyConfigured, match="QUEUE_HANDLERS"),
    ):
        registry.resolve("shell", "default")
    with override_settings(JOBS={"QUEUE_HANDLERS": ["default"]}), pytest.raises(ImproperlyConfigured):
        registry.resolve("shell", "default")
    with override_settings(JOBS={"QUEUE_HANDLERS": {"default": ["shell"]}}):
        assert isinstance(registry.resolve("shell", "default"), ShellHandler)
        with pytest.raises(HandlerNotAllowed):
            registry.resolve("command", "default")


# -- the command handler: deny by default ------------------------------------------------------------------


@pytest.mark.parametrize("payload", ["clearsessions", ["flush", "--no-input"], {"name": "flush"}])
def test_command_handler_runs_nothing_by_default(payload):
    with (
        override_settings(JOBS={}),
        mock.patch("django_jobs.handlers.call_command") as called,
        pytest.raises(HandlerNotAllowed, match="ALLOWED_COMMANDS"),
    ):
        CommandHandler().handle(context(payload))
    called.assert_not_called()


def test_command_handler_runs_only_the_allowed_commands():
    with (
        override_settings(JOBS={"ALLOWED_COMMANDS": ["clearsessions"]}),
        mock.patch("django_jobs.handlers.call_command") as called,
    ):
        CommandHandler().handle(context(["clearsessions", "--verbosity", "0"]))
        called.assert_called_once_with("clearsessions", "--verbosity", "0")
        with pytest.raises(HandlerNotAllowed, match="'flush'"):
            CommandHandler().handle(context({"name": "flush", "options": {"interactive": False}}))
        with pytest.raises(HandlerNotAllowed, match="'clearsession'"):  # compared exactly
            CommandHandler().handle(context("clearsession"))
    assert called.call_count == 1


def test_allowed_commands_given_as_a_str_is_refused():
    with (
        override_settings(JOBS={"ALLOWED_COMMANDS": "clearsessions"}),
        mock.patch("django_jobs.handlers.call_command") as called,
        pytest.raises(ImproperlyConfigured, match="ALLOWED_COMMANDS"),
    ):
        CommandHandler().handle(context("clear"))
    called.assert_not_called()


@pytest.mark.django_db
@pytest.mark.usefixtures("clean_state")
def test_a_command_job_not_allowed_is_dead_lettered_without_running():
    expired = timezone.now() - timedelta(days=1)
    Session.objects.create(session_key="expired", session_data="x", expire_date=expired)
    with jobs_settings(ALLOWED_COMMANDS=[]):
        job_id = Jobs.define("command", "clearsessions").max_retries(3).dispatch()
        assert QueueWorker("default").process_once().status == "dead-lettered"  # permanent: no retry
    job = Job.objects.get(pk=job_id)
    assert job.status == "failed" and job.last_error.startswith("HandlerNotAllowed")
    assert "ALLOWED_COMMANDS" in job.last_error
    assert Session.objects.filter(session_key="expired").exists()


# -- other settings a str would turn into characters --------------------------------------------------------


def test_queues_given_as_a_str_is_refused_not_read_as_queue_d():
    with (
        override_settings(JOBS={"QUEUES": "default"}),
        mock.patch.object(WorkerPool, "install_signal_handlers"),
        mock.patch.object(WorkerPool, "run", side_effect=AssertionError("a worker started on queue 'd'")),
    ):
        with pytest.raises(ImproperlyConfigured, match="QUEUES"):
            conf.queues()
        with pytest.raises(CommandError, match="QUEUES"):
            call_command("jobs_work", "--once")


def test_imports_given_as_a_str_is_refused():
    with override_settings(JOBS={"IMPORTS": "tests.api_support"}), pytest.raises(ImproperlyConfigured, match="IMPORTS"):
        registry.autodiscover()


def test_handlers_of_the_wrong_type_is_improperly_configured():
    with (
        override_settings(JOBS={"HANDLERS": ["tests.api_support.GiveUpHandler"]}),
        pytest.raises(ImproperlyConfigured, match="HANDLERS"),
    ):
        conf.handlers()


@pytest.mark.parametrize("value", [["QUEUES", ["x"]], "QUEUES"])
def test_jobs_that_is_not_a_dict_is_improperly_configured(value):
    with override_settings(JOBS=value), pytest.raises(ImproperlyConfigured, match="settings.JOBS must be a dict"):
        conf.get("QUEUES")


# -- real jobs_work processes -----------------------------------------------------------------------------------


def test_jobs_work_with_an_unknown_backend_exits_at_once_with_one_line():
    with processes() as procs:
        start = time.monotonic()
        code, proc = procs.run("jobs_work", "--backend", "nope", "--once", env=worker_env(), timeout=30)
        took = time.monotonic() - start
    assert code == 1, proc.output()
    lines = [line for line in proc.err if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("CommandError: unknown backend 'nope'"), proc.output()
    assert "Traceback" not in proc.output()
    assert not proc.out  # no worker was started
    assert took < 20


BROKEN_SETTINGS = '''
from tests.settings import *  # noqa: F403

JOBS = {**JOBS, "BACKENDS": {**JOBS["BACKENDS"], "broken": {"ENGINE": "broken_settings.BrokenBackend"}}}


from django_jobs.backends.sync import SyncBackend


class BrokenBackend(SyncBackend):
    """Imports fine (so the checks and jobs_work's own validation pass), fails when built: in
    each worker process, at start-up."""

    def __init__(self, name, options):
        raise RuntimeError("this backend cannot be built")
'''


def test_supervisor_gives_up_when_worker_processes_keep_dying_at_start_up(tmp_path: Path):
    (tmp_path / "broken_settings.py").write_text(BROKEN_SETTINGS)
    env = worker_env(
        DJANGO_SETTINGS_MODULE="broken_settings", PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO_ROOT)])
    )
    with processes() as procs:
        start = time.monotonic()
        code, proc = procs.run(
            "jobs_work", "--backend", "broken", "--concurrency", "2", "--max-time", "120", env=env, timeout=40
        )
        took = time.monotonic() - start
    assert code == 1, proc.output()
    proc.wait_started(timeout=0)  # it did start: the deaths happened in the forked processes
    assert proc.err[-1].startswith("CommandError: worker processes keep dying at start-up"), proc.output()
    assert sum("this backend cannot be built" in line for line in proc.err) >= 5  # each death is logged
    assert any("giving up" in line for line in proc.err[:-1])
    assert took < 30
