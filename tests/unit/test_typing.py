"""The typed API: mypy checks a ``@job`` call against the function's signature and the job options.

mypy runs in this process (``mypy.api.run``) with the project's own configuration, on two small
modules: one that uses the API correctly (no error allowed) and one whose lines marked
``# E: <code> ...`` must each be reported with those error codes, and nothing else.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from tests.procs import REPO_ROOT

mypy_api = pytest.importorskip("mypy.api")

GOOD = """
from datetime import timedelta

from django_jobs import Jobs, job
from django_jobs.api import BoundJob, JobBuilder, JobFunction, JobOptions


@job(queue="emails", max_retries=3, retry_on=[ConnectionError], backoff={"strategy": "fixed", "base": 2})
def send_welcome(user_id: int) -> None: ...


@job
def add(x: int, y: int = 0) -> int:
    return x + y


@job(concurrency=2, rate="100/m")
def limited(order_id: int) -> None: ...


job_id: str = send_welcome.dispatch(user_id=7)
also: str = send_welcome.dispatch(7)
total: int = add(2, y=3)  # a direct call keeps the function's return type
as_function: JobFunction[[int], None] = send_welcome
bound = send_welcome.using(priority=5, delay=timedelta(seconds=10), idempotency_key="k", backend=None, timeout=None)
as_bound: BoundJob[[int], None] = bound
more: str = bound.dispatch(user_id=8)
builder: JobBuilder = add.builder(1, y=2)
ids: list[str] = Jobs.bulk([builder, send_welcome.using(queue="emails").builder(user_id=1)])
options: JobOptions = {"queue": "emails", "single_instance": True}
chained: JobBuilder = Jobs.define("command", "clearsessions").max_retries(2).options(**options)
"""

BAD = """
from django_jobs import Jobs, job


@job
def send_welcome(user_id: int) -> None: ...


@job
def count(n: int) -> int:
    return n


@job(queu="emails")  # E: call-overload untyped-decorator
def misspelled(user_id: int) -> None: ...


send_welcome.dispatch(user_id="7")  # E: arg-type
send_welcome.dispatch(7, 8)  # E: call-arg
send_welcome.dispatch(user=7)  # E: call-arg
send_welcome.using(priorty=5)  # E: call-arg
send_welcome.using(priority="high")  # E: arg-type
send_welcome.using(backoff={"strategy": "linear"})  # E: typeddict-item
send_welcome.using(retry_on="builtins.ValueError")  # E: arg-type
send_welcome.using().dispatch(user_id=None)  # E: arg-type
send_welcome.builder("7")  # E: arg-type
text: str = count(7)  # E: assignment
Jobs.define("command").options(max_retries="3")  # E: arg-type
send_welcome.using(concurrency=1)  # E: call-arg


@job(concurrency="2")  # E: call-overload untyped-decorator
def limited(order_id: int) -> None: ...
"""

ERROR = re.compile(r"^(?P<file>[^:]+\.py):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")


@pytest.fixture(scope="module")
def reported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, set[str]]]:
    """Error codes mypy reports, by snippet name and line."""
    folder = tmp_path_factory.mktemp("typing")
    for name, text in (("good", GOOD), ("bad", BAD)):
        (folder / f"{name}.py").write_text(textwrap.dedent(text))
    args = [
        str(folder / "good.py"),
        str(folder / "bad.py"),
        "--config-file",
        str(REPO_ROOT / "pyproject.toml"),
        "--cache-dir",
        str(folder / ".mypy_cache"),
        "--follow-imports",
        "silent",  # the package's own errors are the package check's business
        "--hide-error-context",
        "--no-pretty",
        "--no-error-summary",
        "--show-error-codes",
    ]
    # The package is installed in editable mode through an import hook mypy cannot follow.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MYPYPATH", str(REPO_ROOT))
        stdout, stderr, status = mypy_api.run(args)
    assert status in (0, 1), f"mypy did not run: {stderr}{stdout}"
    found: dict[str, dict[int, set[str]]] = {"good": {}, "bad": {}}
    for line in stdout.splitlines():
        if ": note: " in line:
            continue
        match = ERROR.match(line)
        assert match, f"unexpected mypy output: {line}\n{stdout}"
        name = Path(match["file"]).stem
        assert name in found, f"an error outside the snippets: {line}"
        found[name].setdefault(int(match["line"]), set()).add(match["code"])
    return found


def expected(text: str) -> dict[int, set[str]]:
    marks = {}
    for number, line in enumerate(textwrap.dedent(text).splitlines(), start=1):
        if "# E: " in line:
            marks[number] = set(line.rsplit("# E: ", 1)[1].split())
    return marks


def test_correct_use_of_the_typed_api_has_no_error(reported):
    assert reported["good"] == {}


def test_wrong_arguments_and_unknown_options_are_reported(reported):
    assert reported["bad"] == expected(BAD)


def test_job_options_name_every_option_the_runtime_accepts():
    from django_jobs.api import OPTION_NAMES, JobOptions

    assert (
        set(OPTION_NAMES)
        == set(JobOptions.__annotations__)
        == {
            "queue",
            "priority",
            "max_retries",
            "timeout",
            "delay",
            "scheduled_at",
            "idempotency_key",
            "name",
            "backend",
            "backoff",
            "retry_on",
            "single_instance",
            "keep_result",
            "depends_on",
            "run_if_parent_fails",
        }
    )
