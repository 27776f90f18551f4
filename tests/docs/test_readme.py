"""README.md's demo, run for real: the ``manage.py`` commands of ``scripts/demo``, in its order,
in a copy of the example project (its own SQLite file), with this test run's interpreter instead
of the demo's ``.venv`` (so no ``pip``); the report the README shows is compared with the one
they print."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.docs import pages, shell
from tests.docs.output import OutputCheck

pytestmark = pytest.mark.slow

README = pages.REPO_ROOT / "README.md"
DEMO = pages.REPO_ROOT / "scripts" / "demo"


def demo_commands() -> list[list[str]]:
    """The lines of ``scripts/demo`` that start with ``"$py" manage.py``, without the shell's
    ``|| status=$?``. The superuser step (``createsuperuser`` inside ``if out=$(...)``) is not
    one of them: the report does not need it."""
    lines = re.findall(r'^"\$py" (manage\.py .*?)(?: \|\|.*)?$', DEMO.read_text(), re.MULTILINE)
    return [["$py", *shlex.split(line)] for line in lines]


def test_the_demo_ends_with_the_report_the_readme_shows(tmp_path: Path) -> None:
    project = tmp_path / "example_project"
    shutil.copytree(
        pages.REPO_ROOT / "example_project", project, ignore=shutil.ignore_patterns("db.sqlite3*", "__pycache__")
    )
    commands = demo_commands()
    assert [argv[2] for argv in commands[-3:]] == ["demo_dispatch", "jobs_work", "demo_report"], commands
    printed = [shell.run(argv, project) for argv in commands]

    shown = [block for block in pages.blocks(README) if block.lang == ""]
    assert len(shown) == 1, "README.md shows one output block: the demo's report"
    check = OutputCheck()
    check(shown[0], shown[0].where(README), printed[-1])
    check.assert_none()
