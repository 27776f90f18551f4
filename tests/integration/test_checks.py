"""System checks: ``manage.py check`` reports bad ``JOBS`` settings before a worker starts."""

from __future__ import annotations

from io import StringIO
from unittest import mock

import pytest
from django.conf import settings
from django.core import checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from django_jobs import checks as jobs_checks
from django_jobs import conf, registry
from django_jobs.api import job
from django_jobs.checks import check_connection_pools, check_servicebus_delivery_count, check_settings
from tests.api_support import jobs_settings
from tests.backend_params import ALL_DATABASES

# Django's own model checks ask the database whether it supports JSONField.
pytestmark = pytest.mark.django_db


def run_jobs_checks() -> list[checks.CheckMessage]:
    return [*check_settings(), *check_servicebus_delivery_count()]


def jobs_errors(**changes) -> list[checks.CheckMessage]:
    """The django_jobs check messages under ``JOBS`` = test settings + ``changes``."""
    with jobs_settings(**changes):
        return run_jobs_checks()


def only(
    errors: list[checks.CheckMessage],
    check_id: str,
    *fragments: str,
    obj: str = "settings.JOBS",
) -> checks.CheckMessage:
    """Exactly one message, an Error with this id about ``obj``, naming every fragment."""
    assert [e.id for e in errors] == [check_id], [str(e) for e in errors]
    [error] = errors
    assert error.level == checks.ERROR and error.obj == obj
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
    only(
        jobs_errors(BACKENDS={"default": {"ENGINE": "database"}, "fast": {"ENGINE": "rabbitmq"}}),
        "django_jobs.E002",
        "'fast'",
        "rabbitmq",
    )


def test_engine_dotted_path_that_cannot_be_imported():
    only(
        jobs_errors(BACKENDS={"default": {"ENGINE": "myproject.queues.NoSuchBackend"}}), "django_jobs.E002", "'default'"
    )


def test_engine_that_is_not_a_queue_backend():
    # Anything else importable (a function, a class of its own) is an error of the check, which
    # must not crash on it.
    for engine in ("django_jobs.api.job", "collections.OrderedDict"):
        only(jobs_errors(BACKENDS={"default": {"ENGINE": engine}}), "django_jobs.E002", "not a subclass of")


def test_dotted_path_engine_that_exists_passes():
    assert jobs_errors(BACKENDS={"default": {"ENGINE": "django_jobs.backends.database.DatabaseBackend"}}) == []


def test_default_backend_missing_from_backends():
    only(jobs_errors(DEFAULT_BACKEND="fast"), "django_jobs.E001", "'fast'")


def test_unknown_strategy():
    error = only(jobs_errors(RETRY_BACKOFF_STRATEGY="fibonacci"), "django_jobs.E003", "fibonacci")
    assert "exponential" in error.hint


@pytest.mark.parametrize(
    "key",
    [
        "RETRY_BACKOFF_BASE",
        "RETRY_BACKOFF_MULTIPLIER",
        "RETRY_BACKOFF_MAX",
        "DEFAULT_MAX_RETRIES",
        "LEASE_TIMEOUT",
        "IDEMPOTENCY_TTL",
        "POLL_INTERVAL",
    ],
)
@pytest.mark.parametrize("value", [-1, -0.5, "5", True])
def test_negative_or_non_numeric_numbers(key, value):
    only(jobs_errors(**{key: value}), "django_jobs.E004", key)


@pytest.mark.parametrize("value", [0, -3, "30"])
def test_default_timeout_must_be_none_or_positive(value):
    only(jobs_errors(DEFAULT_TIMEOUT=value), "django_jobs.E004", "DEFAULT_TIMEOUT")


def test_zero_is_a_valid_number():
    assert jobs_errors(DEFAULT_MAX_RETRIES=0, RETRY_BACKOFF_BASE=0, IDEMPOTENCY_TTL=0) == []


def test_a_zero_poll_interval_is_refused_it_would_poll_in_a_busy_loop():
    only(jobs_errors(POLL_INTERVAL=0), "django_jobs.E004", "POLL_INTERVAL", "positive")


@pytest.mark.parametrize(
    "key", ["LEASE_TIMEOUT", "ABORT_GRACE", "DEFAULT_TIMEOUT", "IDEMPOTENCY_TTL", "POLL_INTERVAL", "RETRY_BACKOFF_MAX"]
)
def test_a_duration_past_a_year_is_refused(key):
    # 1e12 s from now is past the year 9999: a worker could store no lease or due time.
    only(jobs_errors(**{key: 1e12}), "django_jobs.E004", key, "at most 31536000")


def test_unknown_idempotency_cache_alias():
    only(jobs_errors(IDEMPOTENCY_CACHE="redis-idem"), "django_jobs.E007", "redis-idem")


def test_queue_handlers_naming_an_unknown_handler():
    error = only(
        jobs_errors(QUEUE_HANDLERS={"default": ["command", "tests.testapp.jobs.scripted", "ghost.handler"]}),
        "django_jobs.E006",
        "'ghost.handler'",
        "'default'",
    )
    assert error.hint


def test_queue_handlers_naming_known_handlers_pass():
    assert (
        jobs_errors(
            HANDLERS={"giveup": "tests.api_support.GiveUpHandler"},
            QUEUE_HANDLERS={"default": ["command", "shell", "giveup"], "emails": ["tests.testapp.jobs.scripted"]},
        )
        == []
    )


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


@pytest.mark.django_db(databases=ALL_DATABASES)  # Django's model checks ask every database
def test_jobs_work_runs_django_jobs_checks_and_no_others():
    # Without TEMPLATES the admin's own check fails: `manage.py check` reports it, a worker starts.
    with override_settings(TEMPLATES=[]):
        with pytest.raises(SystemCheckError, match="admin.E403"):
            call_command("check")
        call_command("jobs_work", "--once", skip_checks=False, stdout=StringIO())
    with jobs_settings(LEASE_TIMOUT=5), pytest.raises(SystemCheckError, match="django_jobs.E009"):
        call_command("jobs_work", "--once", skip_checks=False, stdout=StringIO())


def test_every_django_jobs_check_carries_its_tag():
    registered = checks.registry.registry.get_checks(include_deployment_checks=True)
    tagged = {check.__name__ for check in registered if jobs_checks.TAG in check.tags}
    assert tagged == {
        "check_settings",
        "check_servicebus_delivery_count",
        "check_backend_persistence",
        "check_connection_pools",
    }


# -- the shape of JOBS and its keys --------------------------------------------------------------------


@pytest.mark.parametrize("value", [["QUEUES", ["default"]], "QUEUES", 1])
def test_jobs_must_be_a_dict(value):
    with override_settings(JOBS=value):
        only(run_jobs_checks(), "django_jobs.E008", "dict")


def test_every_setting_has_a_validation_rule():
    assert set(jobs_checks.RULES) == set(conf.DEFAULTS)
    assert "ALLOWED_COMMANDS" in conf.DEFAULTS and conf.DEFAULTS["ALLOWED_COMMANDS"] == []


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [
        ("RETRY_BACKOF_BASE", "'RETRY_BACKOFF_BASE'"),
        ("LEASE_TIMOUT", "'LEASE_TIMEOUT'"),
        ("retry_backoff_base", "'RETRY_BACKOFF_BASE'"),  # lower case: Django settings keys are upper case
        ("allowed_commands", "'ALLOWED_COMMANDS'"),
        ("ALLOWED_COMMAND", "'ALLOWED_COMMANDS'"),
    ],
)
def test_unknown_key_with_a_did_you_mean_hint(key, suggestion):
    error = only(jobs_errors(**{key: 5}), "django_jobs.E009", repr(key))
    assert suggestion in error.hint


def test_an_unknown_key_is_an_error_that_does_not_claim_to_be_ignored():
    # A blocking error stops the command: the key is not "ignored", nothing runs.
    error = only(jobs_errors(QUEUS=["default"]), "django_jobs.E009", "'QUEUS'")
    assert "ignored" not in error.msg and "'QUEUES'" in error.hint


def test_a_misspelt_engine_gets_a_did_you_mean_hint():
    backends = {"default": {"ENGINE": "databse", "OPTIONS": {}}}
    error = only(jobs_errors(BACKENDS=backends), "django_jobs.E002", "'databse'")
    assert error.hint == "did you mean 'database'?"


def test_unknown_key_without_a_close_match_still_reported():
    error = only(jobs_errors(COLOUR="blue"), "django_jobs.E009", "'COLOUR'")
    assert error.hint is None


def test_unknown_key_in_a_backend_definition():
    backends = {"default": {"ENGIN": "redis", "OPTIONS": {}}}
    error = only(jobs_errors(BACKENDS=backends), "django_jobs.E009", "'ENGIN'", "'default'")
    assert "'ENGINE'" in error.hint


# Wrong types and ranges for every key of the settings table: (key, bad value, check id).
# E004 numbers, E011 settings that guard what may run (a wrong type there weakens security),
# E010 everything else.
BAD_VALUES = [
    ("DEFAULT_BACKEND", ["default"], "E010"),
    ("DEFAULT_BACKEND", "", "E010"),
    ("BACKENDS", [{"ENGINE": "database"}], "E010"),
    ("BACKENDS", {"default": "database"}, "E010"),
    ("BACKENDS", {"default": {"ENGINE": ["database"]}}, "E010"),
    ("BACKENDS", {"default": {"ENGINE": "database", "OPTIONS": "default"}}, "E010"),
    ("QUEUES", "default", "E010"),  # would be consumed as queues d, e, f, ...
    ("QUEUES", ["default", 3], "E010"),
    ("QUEUES", ["default", ""], "E010"),
    ("QUEUES", {"default", "other", "emails"}, "E010"),  # a set has no first (default) queue
    ("RETRY_BACKOFF_STRATEGY", ["exponential"], "E003"),
    ("RETRY_BACKOFF_BASE", "5", "E004"),
    ("RETRY_BACKOFF_MULTIPLIER", None, "E004"),
    ("RETRY_BACKOFF_MAX", float("inf"), "E004"),
    ("RETRY_BACKOFF_JITTER", "yes", "E010"),
    ("RETRY_BACKOFF_JITTER", 1, "E010"),
    ("DEFAULT_MAX_RETRIES", 2.5, "E004"),
    ("DEFAULT_MAX_RETRIES", True, "E004"),
    ("DEFAULT_TIMEOUT", True, "E004"),
    ("DEFAULT_TIMEOUT", float("nan"), "E004"),
    ("LEASE_TIMEOUT", float("nan"), "E004"),
    ("LEASE_TIMEOUT", None, "E004"),
    ("DEAD_LETTER_QUEUE", ["other"], "E010"),
    ("IDEMPOTENCY_TTL", "1d", "E004"),
    ("IDEMPOTENCY_CACHE", None, "E010"),
    ("IDEMPOTENCY_CACHE", ["default"], "E010"),
    ("HANDLERS", ["tests.api_support.GiveUpHandler"], "E010"),
    ("HANDLERS", {"giveup": 3}, "E010"),
    ("IMPORTS", "tests.api_support", "E010"),  # would import t, e, s, ...
    ("IMPORTS", [None], "E010"),
    ("POLL_INTERVAL", None, "E004"),
    ("METRICS_COLLECTOR", 1, "E010"),
    ("SCHEDULE", [], "E010"),
    ("MAX_MESSAGE_BYTES", "1MB", "E004"),
    ("MAX_MESSAGE_BYTES", 0, "E004"),  # every job would be rejected
    ("MAX_MESSAGE_BYTES", -1, "E004"),
    ("MAX_MESSAGE_BYTES", 1.5e6, "E004"),
    ("MAX_MESSAGE_BYTES", True, "E004"),
    ("SIGNING_KEY", "", "E011"),
    ("SIGNING_KEY", b"", "E011"),
    ("SIGNING_KEY", ["a-key"], "E011"),
    ("SIGNING_KEY", 12345, "E011"),
    ("SIGNING_KEY_FALLBACKS", "old-key", "E011"),  # one-character keys: anyone could forge
    ("SIGNING_KEY_FALLBACKS", b"old-key", "E011"),
    ("SIGNING_KEY_FALLBACKS", [""], "E011"),  # an empty key: anyone could forge
    ("SIGNING_KEY_FALLBACKS", ["old-key", b""], "E011"),
    ("SIGNING_KEY_FALLBACKS", ["old-key", None], "E011"),
    ("SIGNING_KEY_FALLBACKS", None, "E011"),
    ("VERIFY_SIGNATURE", "False", "E011"),
    ("VERIFY_SIGNATURE", 0, "E011"),
    ("QUEUE_HANDLERS", ["command"], "E011"),
    ("QUEUE_HANDLERS", {"default": "command"}, "E011"),  # a substring test: 'comma' would pass
    ("QUEUE_HANDLERS", {"default": ["command", 1]}, "E011"),
    ("ALLOWED_SHELL_COMMANDS", "sh -c", "E011"),  # a substring test: 'sh' would pass
    ("ALLOWED_SHELL_COMMANDS", [""], "E011"),
    ("ALLOWED_SHELL_COMMANDS", None, "E011"),
    ("ALLOWED_COMMANDS", "clearsessions", "E011"),
    ("ALLOWED_COMMANDS", ["clearsessions", None], "E011"),
    ("URL_ALLOW_PRIVATE_NETWORKS", "no", "E011"),
]


@pytest.mark.parametrize(("key", "value", "check_id"), BAD_VALUES, ids=[f"{k}={v!r}" for k, v, _ in BAD_VALUES])
def test_wrong_type_or_range_for_every_key(key, value, check_id):
    only(jobs_errors(**{key: value}), f"django_jobs.{check_id}", key)


def test_signing_keys_are_never_quoted_in_messages():
    error = only(jobs_errors(SIGNING_KEY_FALLBACKS="very-secret-old-key"), "django_jobs.E011")
    assert "very-secret" not in error.msg


def test_good_values_of_every_kind_pass():
    assert (
        jobs_errors(
            SIGNING_KEY=b"k" * 32,
            SIGNING_KEY_FALLBACKS=("old", b"older"),
            VERIFY_SIGNATURE=False,
            ALLOWED_SHELL_COMMANDS=("/bin/echo",),
            ALLOWED_COMMANDS=["clearsessions", "check"],
            QUEUES=("default", "other", "emails"),
            QUEUE_HANDLERS={"emails": []},
            MAX_MESSAGE_BYTES=65535,
            DEFAULT_TIMEOUT=2.5,
            DEFAULT_MAX_RETRIES=3,
            LEASE_TIMEOUT=0.5,
            SCHEDULE={},
            METRICS_COLLECTOR=None,
            DEAD_LETTER_QUEUE="other",
            IMPORTS=["tests.api_support"],
            HANDLERS={"shell": None, "giveup": "tests.api_support.GiveUpHandler"},
            URL_ALLOW_PRIVATE_NETWORKS=True,
            RETRY_BACKOFF_JITTER=False,
        )
        == []
    )


def test_secret_key_fallbacks_are_checked_when_keys_derive_from_them():
    with override_settings(SECRET_KEY_FALLBACKS="old-secret"):
        only(jobs_errors(), "django_jobs.E011", "SECRET_KEY_FALLBACKS", obj="settings.SECRET_KEY_FALLBACKS")
        # With a SIGNING_KEY of its own, django-jobs never reads them.
        assert jobs_errors(SIGNING_KEY="a-real-key") == []
    with override_settings(SECRET_KEY_FALLBACKS=[""]):
        assert [e.id for e in jobs_errors()] == ["django_jobs.E011"]


def test_a_bad_key_is_reported_once_not_again_by_the_checks_that_use_it():
    # E001 (default backend), E002 (engines), E006 (handlers), E012 (queues) need a valid value.
    assert [e.id for e in jobs_errors(BACKENDS=["default"])] == ["django_jobs.E010"]
    assert [e.id for e in jobs_errors(HANDLERS="x", QUEUE_HANDLERS={"default": ["ghost"]})] == ["django_jobs.E010"]


# -- queue names ---------------------------------------------------------------------------------------


def test_job_decorator_naming_an_unknown_queue(monkeypatch):
    monkeypatch.setattr(registry, "_registered", dict(registry.registered()))  # forgotten after the test

    @job(queue="emials")
    def notify() -> None: ...

    error = only(jobs_errors(), "django_jobs.E012", "'emials'", "@job", obj=notify.key)
    assert "'emails'" in error.hint


def test_registered_jobs_queues_must_stay_in_queues():
    # tests.api_support.configured_job is @job(queue="emails").
    only(
        jobs_errors(QUEUES=["default", "other"]), "django_jobs.E012", "'emails'", obj="tests.api_support.configured_job"
    )


def test_queue_handlers_key_naming_an_unknown_queue():
    # Its allowlist would guard no real queue: 'default' would accept every handler.
    error = only(jobs_errors(QUEUE_HANDLERS={"defualt": ["command"]}), "django_jobs.E012", "'defualt'")
    assert "'default'" in error.hint


def test_dead_letter_queue_not_in_queues():
    only(jobs_errors(DEAD_LETTER_QUEUE="dead"), "django_jobs.E012", "'dead'", "DEAD_LETTER_QUEUE")
    assert jobs_errors(DEAD_LETTER_QUEUE="other") == []


def test_did_you_mean_on_backend_and_cache_names():
    assert "'default'" in only(jobs_errors(DEFAULT_BACKEND="defualt"), "django_jobs.E001").hint
    assert "'default'" in only(jobs_errors(IDEMPOTENCY_CACHE="Default"), "django_jobs.E007").hint
    error = only(jobs_errors(RETRY_BACKOFF_STRATEGY="exponentail"), "django_jobs.E003")
    assert "'exponential'" in error.hint and "full_jitter" in error.hint


# -- modules a worker imports ----------------------------------------------------------------------------


def test_imports_that_cannot_be_imported():
    only(jobs_errors(IMPORTS=["tests.no_such_module_here"]), "django_jobs.E013", "'tests.no_such_module_here'")


def test_an_apps_jobs_module_that_cannot_be_imported_is_named_once_without_knock_on_errors():
    # Its schedule entry's job is in the failed module: E013 says why, no E014 "unknown job".
    schedule = {"nightly": {"job": "tests.brokenapp.jobs.send", "daily": "03:00"}}
    with override_settings(INSTALLED_APPS=[*settings.INSTALLED_APPS, "tests.brokenapp"]):
        errors = jobs_errors(SCHEDULE=schedule)
    error = only(errors, "django_jobs.E013", "jobs module 'tests.brokenapp.jobs'", "ModuleNotFoundError")
    assert "no_such_helpers" in error.msg


def test_manage_py_check_reports_settings_that_weaken_security():
    with (
        jobs_settings(SIGNING_KEY_FALLBACKS=[""], ALLOWED_SHELL_COMMANDS="sh -c"),
        pytest.raises(SystemCheckError, match="SIGNING_KEY_FALLBACKS") as info,
    ):
        call_command("check")
    assert "ALLOWED_SHELL_COMMANDS" in str(info.value)


# -- periodic jobs (SCHEDULE) ----------------------------------------------------------------------------


def test_a_bad_cron_expression_is_a_check_error():
    schedule = {"nightly": {"job": "tests.testapp.jobs.scripted", "cron": "0 3 * *"}}
    only(jobs_errors(SCHEDULE=schedule), "django_jobs.E014", "SCHEDULE['nightly']['cron']", "5 fields")


def test_a_schedule_naming_an_unknown_job_is_a_check_error():
    # The check imports the jobs modules first, as a worker does: scripted is registered.
    schedule = {"nightly": {"job": "tests.testapp.jobs.scriptd", "daily": "03:00"}}
    only(
        jobs_errors(SCHEDULE=schedule),
        "django_jobs.E014",
        "unknown job 'tests.testapp.jobs.scriptd'",
        "did you mean 'tests.testapp.jobs.scripted'?",
    )


def test_every_mistake_of_one_entry_is_reported_in_one_run():
    schedule = {"a": {"job": "tests.testapp.jobs.scripted", "evry": 60, "timezone": "Mars/Olympus", "priority": "hi"}}
    errors = jobs_errors(SCHEDULE=schedule)
    assert [e.id for e in errors] == ["django_jobs.E014"] * 4, [e.msg for e in errors]
    text = "\n".join(e.msg for e in errors)
    for mistake in ("unknown key 'evry'", "exactly one trigger", "Mars/Olympus", "['priority']"):
        assert mistake in text, text


def test_every_bad_entry_is_reported_and_manage_py_check_fails():
    schedule = {
        "a": {"job": "tests.testapp.jobs.scripted", "every": 60, "timezone": "Mars/Olympus"},
        "b": {"job": "tests.testapp.jobs.scripted", "every": 60, "daily": "03:00"},
    }
    assert [e.id for e in jobs_errors(SCHEDULE=schedule)] == ["django_jobs.E014"] * 2
    with jobs_settings(SCHEDULE=schedule), pytest.raises(SystemCheckError, match="Mars/Olympus"):
        call_command("check")


def test_a_good_schedule_passes_every_check():
    schedule = {
        "nightly": {
            "job": "tests.testapp.jobs.scripted",
            "kwargs": {"action": "ok"},
            "cron": "0 3 * * *",
            "timezone": "Europe/Paris",
            "queue": "other",
            "backend": "pg",
            "priority": 5,
            "missed": "catch_up_once",
        },
        "ping": {"job": "url", "payload": {"url": "https://example.com"}, "every": "5m", "enabled": False},
        "weekly": {"job": "tests.api_support.bare_job", "args": [1], "weekly": "mon 09:00"},
    }
    with jobs_settings(SCHEDULE=schedule):
        assert [m for m in checks.run_checks(tags=[checks.Tags.compatibility]) if not m.is_silenced()] == []


def test_a_schedule_that_is_not_a_dict_is_reported_once():
    assert [e.id for e in jobs_errors(SCHEDULE=[])] == ["django_jobs.E010"]


# -- a backend that keeps nothing on disk (only under check --deploy) ----------------------------------


def persistence_warnings() -> list[checks.CheckMessage]:
    # The compatibility tag: the model checks would ask every database (MariaDB too) for its features.
    found = checks.run_checks(tags=[checks.Tags.compatibility], include_deployment_checks=True)
    return [m for m in found if m.id == "django_jobs.W003"]


def test_deploy_check_warns_of_a_redis_that_keeps_nothing_on_disk(redis_up):
    # The test Redis has neither AOF nor RDB save points: the warning is real.
    [warning] = persistence_warnings()
    assert warning.level == checks.WARNING and warning.obj == "settings.JOBS"
    assert warning.msg.startswith("backend 'redis': Redis at ") and "keeps nothing on disk" in warning.msg
    assert "appendonly yes" in warning.hint


def test_manage_py_check_deploy_shows_the_warning_and_passes(redis_up):
    out = StringIO()
    call_command("check", "--deploy", "--tag", "compatibility", stdout=out, stderr=out)
    assert "django_jobs.W003" in out.getvalue()


def test_a_plain_check_never_asks_the_servers():
    from django_jobs.backends.redis import RedisBackend

    with mock.patch.object(RedisBackend, "persistence_warning", return_value="keeps nothing") as asked:
        checks.run_checks(tags=[checks.Tags.compatibility])
        asked.assert_not_called()
        assert [m.msg for m in persistence_warnings()] == ["backend 'redis': keeps nothing"]  # --deploy asks


def test_a_redis_with_an_aof_is_not_warned_about(private_redis):
    with jobs_settings(
        BACKENDS={
            "default": {"ENGINE": "database"},
            "redis": {"ENGINE": "redis", "OPTIONS": {"URL": private_redis.url}},
        }
    ):
        assert persistence_warnings() == []


def test_an_unreachable_redis_never_fails_the_check():
    from tests.servers import free_port

    closed = {"ENGINE": "redis", "OPTIONS": {"URL": f"redis://127.0.0.1:{free_port()}/0"}}
    with jobs_settings(BACKENDS={"default": {"ENGINE": "database"}, "redis": closed}):
        assert persistence_warnings() == []
        call_command("check", "--deploy", "--tag", "compatibility", stdout=StringIO(), stderr=StringIO())


# -- Django's connection pool under a database backend -----------------------------------------------


@pytest.mark.parametrize(
    ("pool", "size"),
    [
        ({"max_size": 2}, 2),
        ({"min_size": 2}, 2),  # psycopg_pool: max_size defaults to min_size
        ({"min_size": 1, "max_size": 1}, 1),
        (None, None),
        (True, None),  # psycopg_pool's default: 4
        ({"min_size": 1, "max_size": 3}, None),
    ],
)
def test_a_pool_too_small_for_a_worker_process_is_warned_of(monkeypatch, pool, size):
    database = {**settings.DATABASES["default"], "OPTIONS": {} if pool is None else {"pool": pool}}
    monkeypatch.setitem(settings.DATABASES, "pooled", database)
    backends = {
        "pooled": {"ENGINE": "database", "OPTIONS": {"DATABASE": "pooled"}},
        "broker": {"ENGINE": "redis", "OPTIONS": {"URL": "redis://127.0.0.1:6379/9", "DATABASE": "pooled"}},
    }
    with jobs_settings(BACKENDS=backends, DEFAULT_BACKEND="pooled"):
        warnings = check_connection_pools()
    if size is None:
        assert warnings == []
        return
    [warning] = warnings
    assert (warning.id, warning.level, warning.obj) == ("django_jobs.W004", checks.WARNING, "settings.DATABASES")
    assert f"backend 'pooled': the connection pool of database 'pooled' holds {size} connection(s)" in warning.msg
    assert "DATABASES['pooled']['OPTIONS']['pool'] a max_size of at least 3" in warning.hint
