"""Dispatch refuses, with a message that says what to do, what a worker could not run.

Tried as a new user would: a ``@job`` in a module no worker imports, a model instance passed as
an argument, a dict with int keys. Everything here is checked by ``build()`` (what ``dispatch()``
sends), so no queue is needed.
"""

from __future__ import annotations

import math
import re
import sys
import types
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import override_settings

from django_jobs import Jobs, api, envelope, job, registry
from django_jobs.api import JobFunction
from django_jobs.exceptions import InvalidPayload
from tests.api_support import jobs_settings
from tests.testapp import jobs as testapp_jobs
from tests.testapp.jobs import remember, scripted


@job
def stray(n: int = 0) -> int:
    """Top level in a test module: importable by its path, but no worker imports it."""
    return n


@job
def also_stray() -> None:
    """Another one, for the re-export test (the importable answer is kept per function)."""


@pytest.fixture
def registrations(monkeypatch: pytest.MonkeyPatch) -> None:
    """@job functions a test defines are forgotten after it."""
    monkeypatch.setattr(registry, "_registered", dict(registry.registered()))


def job_in(module_name: str, monkeypatch: pytest.MonkeyPatch) -> JobFunction[[], None]:
    """A ``@job`` function defined in a module named ``module_name`` (made up here, in sys.modules)."""
    module = types.ModuleType(module_name)
    exec("from django_jobs import job\n\n@job\ndef work() -> None: ...\n", module.__dict__)  # noqa: S102
    monkeypatch.setitem(sys.modules, module_name, module)
    function: JobFunction[[], None] = module.work
    return function


# -- a @job function a worker would not import -------------------------------------------------------


def test_a_job_outside_every_module_a_worker_imports_is_refused_with_the_way_to_register_it():
    with pytest.raises(TypeError) as refused:
        stray.builder(1)
    message = str(refused.value)
    assert message.startswith("tests.unit.test_dispatch_validation.stray cannot be dispatched")
    assert "a worker would not import its module 'tests.unit.test_dispatch_validation'" in message
    assert "move the function to <app>/jobs.py" in message
    assert "add 'tests.unit.test_dispatch_validation' to JOBS['IMPORTS']" in message
    assert stray(3) == 3  # a direct call still works


def test_a_module_in_or_under_imports_is_accepted_and_the_answer_follows_the_settings():
    for imports in (["tests.unit.test_dispatch_validation"], ["tests.unit"]):
        with jobs_settings(IMPORTS=imports):
            assert stray.builder(2).build().payload == {"args": [2], "kwargs": {}}
    # The settings changed back: the kept answer is forgotten, and the job refused again.
    with pytest.raises(TypeError, match="cannot be dispatched"):
        stray.builder(2)


def test_an_apps_jobs_module_and_its_submodules_are_accepted(monkeypatch, registrations):
    assert scripted.builder(action="ok").build().handler == "tests.testapp.jobs.scripted"
    nested = job_in("tests.testapp.jobs.reports", monkeypatch)
    assert nested.builder().build().handler == "tests.testapp.jobs.reports.work"


def test_a_module_of_an_app_outside_its_jobs_module_is_refused_naming_that_apps_jobs_file(monkeypatch, registrations):
    helper = job_in("tests.testapp.helpers", monkeypatch)
    with pytest.raises(TypeError, match="move the function to tests/testapp/jobs.py"):
        helper.builder()


def test_a_job_re_exported_by_an_apps_jobs_module_is_accepted(monkeypatch):
    with pytest.raises(TypeError, match="cannot be dispatched"):
        also_stray.builder()
    # As `from tests.unit.test_dispatch_validation import also_stray` in tests/testapp/jobs.py.
    monkeypatch.setattr(testapp_jobs, "also_stray", also_stray, raising=False)
    assert also_stray.builder().build().handler == "tests.unit.test_dispatch_validation.also_stray"


@pytest.mark.parametrize(
    "tasks, accepted",
    [
        pytest.param({"default": {"BACKEND": registry.TASK_BACKEND}}, True, id="django-jobs-runs-tasks"),
        pytest.param({"default": {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"}}, False, id="other"),
    ],
)
def test_an_apps_tasks_module_counts_only_when_django_tasks_runs_on_django_jobs(
    tasks, accepted, monkeypatch, registrations
):
    in_tasks = job_in("tests.testapp.tasks_helpers_for_jobs", monkeypatch)  # not "tasks": never accepted
    in_tasks_module = job_in("tests.testapp.tasks.jobs_in_tasks", monkeypatch)
    with override_settings(TASKS=tasks):
        with pytest.raises(TypeError, match="cannot be dispatched"):
            in_tasks.builder()
        if accepted:
            assert in_tasks_module.builder().build().handler == "tests.testapp.tasks.jobs_in_tasks.work"
        else:
            with pytest.raises(TypeError, match="cannot be dispatched"):
                in_tasks_module.builder()


def test_the_answer_is_kept_per_function(monkeypatch):
    looked: list[str] = []
    real = api._worker_modules

    def counting() -> list[str]:
        looked.append("once")
        return real()

    monkeypatch.setattr(api, "_worker_modules", counting)
    api._importable.difference_update({scripted, remember})
    for _ in range(3):
        scripted.builder(action="ok")
    remember.builder()
    assert looked == ["once", "once"]  # one look for each function, not one per dispatch


def test_a_function_without_a_dotted_path_is_still_refused_first(registrations):
    @job
    def inner() -> None: ...

    with pytest.raises(TypeError, match="defined inside another function or in __main__"):
        inner.builder()


# -- dict keys that are not str ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload, where",
    [
        pytest.param(
            {"scores": {1: "gold"}}, "payload['scores'] has the key 1 (an int), which JSON would turn into '1'"
        ),
        pytest.param(
            {"rows": [{"ok": 1}, {None: 2}]},
            "payload['rows'][1] has the key None (a NoneType), which JSON would turn into 'null'",
        ),
        pytest.param([{True: 1}], "payload[0] has the key True (a bool), which JSON would turn into 'true'"),
        pytest.param({"at": {(1, 2): 3}}, "payload['at'] has the key (1, 2) (a tuple): JSON object keys are strings"),
    ],
)
def test_a_dict_key_that_is_not_a_str_is_refused_naming_its_path(payload, where):
    with pytest.raises(InvalidPayload, match=re.escape(where)):
        Jobs.define("command", payload).build()


def test_a_non_str_key_in_a_job_argument_names_the_argument():
    with pytest.raises(InvalidPayload) as refused:
        scripted.builder(action="ok", scores={"alice": {3: 1.0}}).build()
    assert str(refused.value) == (
        "tests.testapp.jobs.scripted(): argument 'scores' has a dict key that is not a str: "
        "scores['alice'] has the key 3 (an int), which JSON would turn into '3'; use str keys"
    )
    with pytest.raises(InvalidPayload, match=r"argument 'args\[0\]' has a dict key that is not a str"):
        remember.builder({1: "x"}).build()
    # Braces in a str are no dict: the key check looks, and finds nothing wrong.
    assert remember.builder("{{{", key="}{").build().payload == {"args": ["{{{"], "kwargs": {"key": "}{"}}


def test_str_keys_are_accepted_in_dicts_and_their_subclasses():
    class Ordered(dict[str, Any]):
        pass

    payload = {"a": [{"b": Ordered(c=1)}, ("t", {"u": None})]}
    assert Jobs.define("command", payload).build().payload is payload


# -- values JSON cannot carry: the argument at fault, and what to pass instead ------------------------


def test_a_model_instance_argument_is_named_with_the_advice_to_pass_its_id():
    user = User(pk=7, username="ada")
    with pytest.raises(InvalidPayload) as refused:
        scripted.builder(action="ok", user=user).build()
    assert str(refused.value) == (
        "tests.testapp.jobs.scripted(): argument 'user' (a User) is not JSON-serialisable; "
        "pass user.pk and load it in the job"
    )


def test_a_positional_argument_is_named_by_its_parameter():
    with pytest.raises(InvalidPayload, match=r"scripted\(\): argument 'action' \(a User\) is not JSON-serialisable"):
        scripted.builder(User(pk=1)).build()  # type: ignore[arg-type]
    with pytest.raises(InvalidPayload, match=r"remember\(\): argument 'args\[1\]' \(a set\) is not JSON"):
        remember.builder(1, {2}).build()


def test_a_value_inside_an_argument_is_named_by_its_path():
    with pytest.raises(InvalidPayload) as refused:
        scripted.builder(action="ok", users=[User(pk=1), User(pk=2)]).build()
    assert str(refused.value) == (
        "tests.testapp.jobs.scripted(): argument 'users' is not JSON-serialisable: users[0] is a User; "
        "pass users[0].pk and load it in the job"
    )
    with pytest.raises(InvalidPayload) as refused:
        scripted.builder(action="ok", when={"at": datetime(2026, 6, 1, tzinfo=UTC)}).build()
    assert str(refused.value).startswith(
        "tests.testapp.jobs.scripted(): argument 'when' is not JSON-serialisable: when['at'] is a datetime; "
        "pass JSON values"
    )


def test_nan_and_infinity_are_named_too():
    with pytest.raises(InvalidPayload) as refused:
        scripted.builder(action="ok", seconds=math.inf).build()
    assert str(refused.value) == (
        "tests.testapp.jobs.scripted(): argument 'seconds' is not JSON-serialisable: "
        "seconds is inf (JSON has no NaN or Infinity)"
    )
    with pytest.raises(InvalidPayload, match=r"payload\['ratio'\] is nan"):
        Jobs.define("command", {"ratio": math.nan}).build()


def test_a_define_payload_names_the_path_of_the_value_at_fault():
    with pytest.raises(InvalidPayload) as refused:
        Jobs.define("command", {"name": "x", "options": {"users": {1, 2}}}).build()
    assert str(refused.value) == "job payload is not JSON-serialisable: payload['options']['users'] is a set"


@pytest.fixture
def self_referencing() -> Iterator[list[Any]]:
    loop: list[Any] = []
    loop.append(loop)
    yield loop
    loop.clear()


def test_a_circular_or_too_deep_payload_is_invalid_not_a_crash(self_referencing):
    with pytest.raises(InvalidPayload, match="Circular reference"):
        Jobs.define("command", {"loop": self_referencing}).build()
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(InvalidPayload, match="not JSON-serialisable"):
        Jobs.define("command", deep).build()


def test_a_payload_that_is_fine_is_never_walked_by_the_error_path(monkeypatch):
    """The walk that names a problem runs only when there is one: a good payload is encoded and
    its keys looked at, nothing more."""

    def never(*args: Any) -> None:
        raise AssertionError("a good payload was walked by the error path")

    monkeypatch.setattr(envelope, "payload_problem", never)
    monkeypatch.setattr(api, "payload_problem", never)
    rows = [{"id": i, "tags": ["a", "b"], "nested": {"k": [i, None, 1.5]}} for i in range(500)]
    assert scripted.builder(action="ok", rows=rows).build().payload["kwargs"]["rows"] is rows
    assert Jobs.define("command", {"rows": rows}).build().payload == {"rows": rows}


# -- the builder's options -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "define, error",
    [
        pytest.param(lambda b: b.priority("5"), TypeError, id="priority-str"),
        pytest.param(lambda b: b.priority(True), TypeError, id="priority-bool"),
        pytest.param(lambda b: b.priority(1.5), TypeError, id="priority-float"),
        pytest.param(lambda b: b.options(priority="high"), TypeError, id="options-priority"),
        pytest.param(lambda b: b.timeout(-1), ValueError, id="timeout-negative"),
        pytest.param(lambda b: b.timeout(math.nan), ValueError, id="timeout-nan"),
        pytest.param(lambda b: b.timeout("30"), TypeError, id="timeout-str"),
        pytest.param(lambda b: b.options(timeout=math.inf), ValueError, id="options-timeout"),
        pytest.param(lambda b: b.options(delay=-5), ValueError, id="options-delay"),
        pytest.param(lambda b: b.options(idempotency_key=7), TypeError, id="options-idempotency-key"),
    ],
)
def test_bad_option_values_are_refused_when_set(define, error):
    with pytest.raises(error):
        define(Jobs.define("command", "clearsessions"))


def test_good_option_values_are_kept_as_given():
    env = Jobs.define("command", "clearsessions").options(priority=-3, timeout=30, delay=0).build()
    assert (env.priority, env.timeout) == (-3, 30)
    assert Jobs.define("command").options(timeout=None).build().timeout is None
