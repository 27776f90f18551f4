"""Red-team regressions in-process: promises of the docs attacked from outside, one test per
break found (the process-level ones are in tests/processes/test_redteam.py)."""

from __future__ import annotations

import math

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_jobs.worker import QueueWorker
from tests.testapp import jobs


@pytest.mark.django_db
def test_redteam_jobs_work_refuses_a_backend_database_alias_missing_from_databases():
    """docs/commands.md: a bad argument or setting is refused before anything starts, "with a
    one-line `CommandError: ...` on stderr and exit status 1". Attack: the database backend's
    OPTIONS['DATABASE'] names an alias that DATABASES lacks; jobs_work's migration check raised
    Django's ConnectionDoesNotExist with a traceback."""
    bad = {**settings.JOBS, "BACKENDS": {"default": {"ENGINE": "database", "OPTIONS": {"DATABASE": "nope"}}}}
    with override_settings(JOBS=bad), pytest.raises(CommandError, match=r"'nope'.*DATABASES"):
        call_command("jobs_work", "--once")


@pytest.mark.postgres
@pytest.mark.django_db(databases=["default", "postgres"], transaction=True)
@pytest.mark.parametrize("value", [1e20, 1e308, -0.0], ids=["1e20", "1e308", "negative-zero"])
def test_redteam_a_float_in_the_payload_reaches_the_handler_as_that_float_on_postgresql(postgres_up, value):
    """docs/api.md (dispatch validation): the payload may hold `float`s, and what JSON would
    change without a word (an int dict key) is refused, "so the job would get another dict than
    it was given". Attack: a float that PostgreSQL's `jsonb` rewrites: 1e20 is stored as the
    number 100000000000000000000 and handed to the handler as an `int`; -0.0 loses its sign.
    SQLite and Redis hand back the float."""
    jobs.calls.clear()
    jobs.remember.using(backend="pg").dispatch(value)
    result = QueueWorker("pg", ["default"], prefetch=1).process_once()
    assert result.status == "acked"
    [((got,), _)] = jobs.calls
    assert type(got) is float and got == value and math.copysign(1, got) == math.copysign(1, value), repr(got)
