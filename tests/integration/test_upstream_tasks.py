"""Django's own ``tests/tasks`` (from the sdist of the installed Django) and django-tasks-db's
backend tests (``tests/tests.py`` of its sdist), run against ``JobsTaskBackend``.

Each upstream test case runs as it is, adapted only as listed here (and in docs/tasks.md,
"Conformance"): the backend's dotted path and class stand for Django's and django-tasks-db's
backends, the queues the suites name are ``JOBS`` queues, test cases that enqueue may use the
database, and tests of another backend's own parts (a dummy's result list, django-tasks-db's
table, worker command and admin) are skipped. A test that fails on a deliberate difference is an
``xfail`` with the reason (strict: one that starts passing fails the run).

Django 5.2 ships no ``tests/tasks``, and django-tasks-db's sdist lacks the tasks module its tests
import (Django's ``tests/tasks/tasks.py`` stands in for it): on Django 5.2 this module skips.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
from typing import Any

import django
import pytest
from django.conf import settings
from django.test import TestCase, TransactionTestCase, override_settings

from django_jobs.testing import run_jobs
from tests import upstream

if django.VERSION < (6, 0):
    pytest.skip("Django 5.2 has no tests/tasks (django.tasks is Django 6's)", allow_module_level=True)

TASKS_DB_VERSION = "0.13.0"
DJANGO_TREE = upstream.sdist("django", django.get_version(), ["tests/tasks"])
TASKS_DB_TREE = upstream.sdist("django-tasks-db", TASKS_DB_VERSION, ["tests/tests.py"])
# Django's runner imports its test apps from tests/: the package is "tasks" (task paths too).
sys.path.insert(0, str(DJANGO_TREE / "tests"))

BACKEND = "django_jobs.tasks.JobsTaskBackend"
IMPORT_BACKEND = "from django_jobs.tasks import JobsTaskBackend as {}"
# The queues the suites name: a task's queue must be one of JOBS["QUEUES"].
JOBS = {**settings.JOBS, "QUEUES": [*settings.JOBS["QUEUES"], "queue_1", "queue-1", "queue-2", "unknown_queue"]}
NO_CLEAR = ("    def setUp(self):\n        default_task_backend.clear()\n\n", "")


def django_module(name: str, *substitutions: tuple[str, str]) -> Any:
    return upstream.load(DJANGO_TREE / "tests" / "tasks" / f"{name}.py", f"tasks.{name}", substitutions)


# Tests of another backend's own parts, found by what their source uses (a pattern): skipped.
NOT_OURS = {
    r"default_task_backend\.(results|clear\(\))": "DummyBackend's own list of results",
    r"\bDBTaskResult\b": "django-tasks-db's own table (DBTaskResult)",
    r"\bid_function\b": "django-tasks-db's id_function option",
    r"\bdb_worker\b|self\.run_worker\((?!\))": "django-tasks-db's db_worker command and its options",
}
# Deliberate differences, each the reason of a strict xfail.
READY = "enqueue() returns the task READY, before it runs, also on the sync engine (docs/tasks.md)"
SYNC_IN_ASYNC = (
    "the sync API reads the database, which Django refuses in an async test (SynchronousOnlyOperation); "
    "aget_result() and arefresh() work there"
)
UUID7 = "result ids are time-ordered UUIDv7s (django-tasks-db makes UUID4s)"


def inline_subtest(self: Any, msg: Any = None, **params: Any) -> contextlib.AbstractContextManager[None]:
    """A ``subTest`` block runs as part of its test: its first failure fails the test (so an
    expected failure inside a block is the test's)."""
    return contextlib.nullcontext()


def adapt(upstream_case: type, base: type, xfail: dict[str, str] | None = None, **overrides: Any) -> type:
    """``upstream_case`` on ``base`` (a test case that may use the database), with settings
    ``overrides``; its tests of another backend's own parts skipped, those in ``xfail`` expected
    to fail with that reason (a name that is gone is an error: review the table)."""
    xfail = xfail or {}
    for test, reason in xfail.items():
        pytest.mark.xfail(reason=reason, strict=True)(getattr(upstream_case, test))
    for name, method in inspect.getmembers(upstream_case, inspect.isfunction):
        source = inspect.getsource(method)
        why = next((why for pattern, why in NOT_OURS.items() if re.search(pattern, source)), None)
        if name.startswith("test") and why is not None and name not in xfail:
            pytest.mark.skip(reason=f"tests {why}")(method)
    attrs = {"databases": {"default"}, "available_apps": None, "subTest": inline_subtest, "__module__": __name__}
    adapted = type(upstream_case.__name__, (upstream_case, base), attrs)
    return override_settings(**{"JOBS": JOBS, **overrides})(adapted)


# -- Django's tests/tasks ---------------------------------------------------------------------------

tasks_tests = django_module(
    "test_tasks",
    ("from django.tasks.backends.dummy import DummyBackend", IMPORT_BACKEND.format("DummyBackend")),
    ("from django.tasks.backends.immediate import ImmediateBackend", IMPORT_BACKEND.format("ImmediateBackend")),
    ('"django.tasks.backends.dummy.DummyBackend"', repr(BACKEND)),
    ('"django.tasks.backends.immediate.ImmediateBackend"', repr(BACKEND)),
    NO_CLEAR,
)
TaskTestCase = adapt(
    tasks_tests.TaskTestCase,
    TestCase,
    {
        "test_get_missing_result": SYNC_IN_ASYNC,
        "test_refresh_result": SYNC_IN_ASYNC,
        "test_task_error_invalid_exception": READY,
        "test_task_error_unknown_module": READY,
    },
)

dummy_tests = django_module(
    "test_dummy_backend",
    ("from django.tasks.backends.dummy import DummyBackend", IMPORT_BACKEND.format("DummyBackend")),
    ('"django.tasks.backends.dummy.DummyBackend"', repr(BACKEND)),
    NO_CLEAR,
)
DummyBackendTestCase = adapt(dummy_tests.DummyBackendTestCase, TestCase, {"test_get_missing_result": SYNC_IN_ASYNC})
DummyBackendTransactionTestCase = adapt(dummy_tests.DummyBackendTransactionTestCase, TransactionTestCase)

immediate_tests = django_module(
    "test_immediate_backend",
    ("from django.tasks.backends.immediate import ImmediateBackend", IMPORT_BACKEND.format("ImmediateBackend")),
    ('"django.tasks.backends.immediate.ImmediateBackend"', repr(BACKEND)),
)
SYNC = {**JOBS, "DEFAULT_BACKEND": "sync"}  # ImmediateBackend runs a task in enqueue(): the sync engine
IMMEDIATE_XFAIL = {
    name: READY
    for name in (
        "test_enqueue_task",
        "test_enqueue_task_async",
        "test_catches_exception",
        "test_complex_exception",
        "test_complex_return_value",
        "test_result",
        "test_result_async",
        "test_successful_task_no_none_in_logs",
        "test_takes_context",
        "test_context",
    )
}
ImmediateBackendTestCase = adapt(
    immediate_tests.ImmediateBackendTestCase,
    TransactionTestCase,
    {
        **IMMEDIATE_XFAIL,
        "test_throws_keyboard_interrupt": "a KeyboardInterrupt a task raises is a failed run, as any error",
        "test_cannot_get_result": "results can be read back (supports_get_result)",
        "test_cannot_refresh_result": "results can be read back (supports_get_result)",
        "test_enqueue_logs": "task_enqueued is sent once the job is dispatched: after the sync engine ran it",
        "test_failed_logs": "task_enqueued is sent once the job is dispatched: after the sync engine ran it",
    },
    JOBS=SYNC,
)
ImmediateBackendTransactionTestCase = adapt(
    immediate_tests.ImmediateBackendTransactionTestCase,
    TransactionTestCase,
    {"test_doesnt_wait_until_transaction_commit_by_default": READY},
    JOBS=SYNC,
)

# Custom backends and task classes: Django's own, beside JobsTaskBackend's tasks (nothing to adapt).
custom_tests = django_module("test_custom_backend")
CustomBackendTestCase = adapt(custom_tests.CustomBackendTestCase, TestCase)
CustomTaskTestCase = adapt(custom_tests.CustomTaskTestCase, TestCase)


# -- django-tasks-db's backend tests ------------------------------------------------------------


def absent(*names: str) -> str:
    """The statements that bind django-tasks-db's own ``names`` to stand-ins (not installed)."""
    return "\n".join(f"{name} = _Absent({'django_tasks_db.' + name!r})" for name in names)


tasks_db = upstream.load(
    TASKS_DB_TREE / "tests" / "tests.py",
    "tasks_db_tests",
    [
        (
            "from django_tasks_db import DatabaseBackend, compat",
            (
                f"{IMPORT_BACKEND.format('DatabaseBackend')}\nfrom django_jobs.tasks import compat\n"
                "from tests.upstream import Absent as _Absent"
            ),
        ),
        ("from django_tasks_db.admin import DBTaskResultAdmin", absent("DBTaskResultAdmin")),
        (
            "from django_tasks_db.management.commands.prune_db_task_results import (\n    logger as prune_db_tasks_logger,\n)",
            absent("prune_db_tasks_logger"),
        ),
        ("from django_tasks_db.models import DBTaskResult, get_date_max", absent("DBTaskResult", "get_date_max")),
        (
            "from django_tasks_db.utils import (\n    exclusive_transaction,\n    normalize_uuid,\n)",
            absent("exclusive_transaction", "normalize_uuid"),
        ),
        ("from tests import tasks as test_tasks", "from tasks import tasks as test_tasks"),
        ('"django_tasks_db.DatabaseBackend"', repr(BACKEND)),
        ('self.assertIn("django_tasks_db", errors[0].hint)', 'self.assertIn("django_jobs", errors[0].hint)'),
    ],
)
# django-tasks-db's test settings: its backend as the default, with Django's default queues.
TASKS_DB_SETTINGS = {"default": {"BACKEND": BACKEND}}


def run_worker(**options: Any) -> None:
    """db_worker's stand-in: a django-jobs worker runs every ready job here, then returns."""
    run_jobs()


DatabaseBackendTestCase = adapt(
    tasks_db.DatabaseBackendTestCase,
    TransactionTestCase,
    {"test_enqueue_task": UUID7, "test_enqueue_task_async": UUID7},
    TASKS=TASKS_DB_SETTINGS,
)
DatabaseBackendWorkerTestCase = adapt(
    tasks_db.DatabaseBackendWorkerTestCase,
    TransactionTestCase,
    {
        "test_complex_return_value": "a return value JSON cannot hold fails the task with InvalidPayload "
        "(a ValueError that says why), not TypeError",
        "test_no_tasks": "a django-jobs worker claims from each of its queues in turn: its queries are not db_worker's",
    },
)
DatabaseBackendWorkerTestCase.run_worker = staticmethod(run_worker)
CompatTestCase = adapt(tasks_db.CompatTestCase, TestCase)
