"""Red-team regressions in-process: promises of the docs attacked from outside, one test per
break found (the process-level ones are in tests/processes/test_redteam.py)."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.test import override_settings


@pytest.mark.django_db
def test_redteam_jobs_work_refuses_a_backend_database_alias_missing_from_databases():
    """docs/commands.md: a bad argument or setting is refused before anything starts, "with a
    one-line `CommandError: ...` on stderr and exit status 1". Attack: the database backend's
    OPTIONS['DATABASE'] names an alias that DATABASES lacks; jobs_work's migration check raised
    Django's ConnectionDoesNotExist with a traceback."""
    bad = {**settings.JOBS, "BACKENDS": {"default": {"ENGINE": "database", "OPTIONS": {"DATABASE": "nope"}}}}
    with override_settings(JOBS=bad), pytest.raises(CommandError, match=r"'nope'.*DATABASES"):
        call_command("jobs_work", "--once")
