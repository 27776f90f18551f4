"""A @job dispatch refuses, at dispatch, what would only fail in the worker."""

from __future__ import annotations

import pytest

from django_jobs import job
from tests.testapp.jobs import noop, scripted


def test_arguments_that_do_not_fit_the_signature_are_refused_at_dispatch():
    with pytest.raises(TypeError, match=r"tests\.testapp\.jobs\.noop\(\): .*'nope'"):
        noop.builder(nope=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="too many positional arguments"):
        scripted.using(priority=1).builder("ok", "k", "default", 0, 0, "one too many")  # type: ignore[call-arg]
    assert noop.builder().build().payload == {"args": [], "kwargs": {}}


def test_a_function_no_worker_can_import_is_refused_at_dispatch():
    @job
    def inner(n: int) -> None:
        """Defined inside a function: it has no importable dotted path."""

    with pytest.raises(TypeError, match="cannot be dispatched"):
        inner.builder(1)
    assert inner(1) is None  # still directly callable
