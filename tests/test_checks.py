"""System checks (SPEC 2): ``manage.py check`` reports bad JOBS settings before a worker starts."""

from __future__ import annotations

import pytest
from django.core import checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from tests.api_support import jobs_settings
from tests.backend_params import ALL_DATABASES

# Django's own model checks ask the database whether it supports JSONField.
pytestmark = pytest.mark.django_db


def jobs_errors(**changes) -> list[checks.CheckMessage]:
    """The django_jobs messages of a full check run under ``JOBS`` = test settings + ``changes``."""
    with jobs_settings(**changes):
        messages = checks.run_checks()
    return [m for m in messages if m.id and m.id.startswith("django_jobs.")]


def only(errors: list[checks.CheckMessage], check_id: str, *fragments: str) -> checks.CheckMessage:
    """Exactly one message, an Error with this id, naming every fragment."""
    assert [e.id for e in errors] == [check_id], [str(e) for e in errors]
    [error] = errors
    assert error.level == checks.ERROR and error.obj == "settings.JOBS"
    for fragment in fragments:
        assert fragment in error.msg
    return error


@pytest.mark.django_db(databases=ALL_DATABASES)
def test_the_test_settings_pass_every_check():
    # Model checks ask every configured database for its features (MariaDB: partial indexes).
    assert [m for m in checks.run_checks() if not m.is_silenced()] == []


def test_defaults_pass():
    # Only BACKENDS/QUEUES come from the test settings; everything else takes its default.
    assert jobs_errors() == []


def test_unknown_engine():
    only(jobs_errors(BACKENDS={"default": {"ENGINE": "database"}, "fast": {"ENGINE": "rabbitmq"}}),
         "django_jobs.E002", "'fast'", "rabbitmq")


def test_engine_dotted_path_that_cannot_be_imported():
    only(jobs_errors(BACKENDS={"default": {"ENGINE": "myproject.queues.NoSuchBackend"}}),
         "django_jobs.E002", "'default'")


def test_dotted_path_engine_that_exists_passes():
    assert jobs_errors(BACKENDS={"default": {"ENGINE": "django_jobs.backends.database.DatabaseBackend"}}) == []


def test_default_backend_missing_from_backends():
    only(jobs_errors(DEFAULT_BACKEND="fast"), "django_jobs.E001", "'fast'")


def test_unknown_strategy():
    error = only(jobs_errors(RETRY_BACKOFF_STRATEGY="fibonacci"), "django_jobs.E003", "fibonacci")
    assert "exponential" in error.hint


@pytest.mark.parametrize("key", [
    "RETRY_BACKOFF_BASE", "RETRY_BACKOFF_MULTIPLIER", "RETRY_BACKOFF_MAX", "DEFAULT_MAX_RETRIES",
    "LEASE_TIMEOUT", "IDEMPOTENCY_TTL", "POLL_INTERVAL",
])
@pytest.mark.parametrize("value", [-1, -0.5, "5", True])
def test_negative_or_non_numeric_numbers(key, value):
    only(jobs_errors(**{key: value}), "django_jobs.E004", key)


@pytest.mark.parametrize("value", [0, -3, "30"])
def test_default_timeout_must_be_none_or_positive(value):
    only(jobs_errors(DEFAULT_TIMEOUT=value), "django_jobs.E004", "DEFAULT_TIMEOUT")


def test_zero_is_a_valid_number():
    assert jobs_errors(DEFAULT_MAX_RETRIES=0, RETRY_BACKOFF_BASE=0, IDEMPOTENCY_TTL=0, POLL_INTERVAL=0) == []


def test_unknown_idempotency_cache_alias():
    only(jobs_errors(IDEMPOTENCY_CACHE="redis-idem"), "django_jobs.E007", "redis-idem")


def test_queue_handlers_naming_an_unknown_handler():
    error = only(
        jobs_errors(QUEUE_HANDLERS={"default": ["command", "tests.testapp.jobs.scripted", "ghost.handler"]}),
        "django_jobs.E006", "'ghost.handler'", "'default'",
    )
    assert error.hint


def test_queue_handlers_naming_known_handlers_pass():
    assert jobs_errors(
        HANDLERS={"giveup": "tests.api_support.GiveUpHandler"},
        QUEUE_HANDLERS={"default": ["command", "shell", "giveup"], "emails": ["tests.testapp.jobs.scripted"]},
    ) == []


def test_empty_queues():
    only(jobs_errors(QUEUES=[]), "django_jobs.E005")


def test_a_zero_lease_timeout_is_refused():
    # A lease of 0 s would expire at once: every running job would be reaped.
    assert [e.id for e in jobs_errors(LEASE_TIMEOUT=0)] == ["django_jobs.E004"]


def test_several_problems_are_all_reported():
    errors = jobs_errors(RETRY_BACKOFF_STRATEGY="nope", LEASE_TIMEOUT=-1, IDEMPOTENCY_CACHE="nope")
    assert sorted(e.id for e in errors) == ["django_jobs.E003", "django_jobs.E004", "django_jobs.E007"]


def test_manage_py_check_fails_on_bad_settings():
    with jobs_settings(RETRY_BACKOFF_STRATEGY="fibonacci"), pytest.raises(SystemCheckError, match="fibonacci"):
        call_command("check")
