"""The reference pages against the code: docs/settings.md's defaults are ``conf.DEFAULTS``,
docs/commands.md's option tables list every option of their command with its real default, and
each example of its exit status table exits with that status."""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from pathlib import Path

import pytest
from django.core.management import load_command_class
from django.core.management.base import BaseCommand
from django.db import connections

from django_jobs import conf
from tests.docs import pages

SETTINGS = pages.REPO_ROOT / "docs" / "settings.md"
COMMANDS = pages.REPO_ROOT / "docs" / "commands.md"


def table(page: Path, heading: str, first: str) -> list[list[str]]:
    """The rows of the one table of ``page`` under ``heading`` whose first column is ``first``."""
    found = [t.rows for t in pages.tables(page) if t.heading == heading and t.header[0] == first]
    assert len(found) == 1, f"{page.name}: no single table with a {first!r} column under {heading!r}"
    return found[0]


def test_the_settings_table_shows_every_default() -> None:
    shown = {pages.code(row[0])[0]: row[1] for row in table(SETTINGS, "Keys", "key")}
    assert sorted(shown) == sorted(conf.DEFAULTS)
    for key, cell in shown.items():
        value = ast.literal_eval(pages.code(cell)[0])
        default = conf.DEFAULTS[key]
        assert (value, type(value)) == (default, type(default)), f"{key}: shows {cell}, the default is {default!r}"


def own_arguments(name: str, shown: list[str]) -> dict[str, argparse.Action]:
    """The arguments of command ``name`` that Django does not give every command, by the name
    its table shows: the option (``--backend``), or for the positional argument the table's
    own name for it (``QUEUE``), taken from ``shown``."""
    common = {action.dest for action in BaseCommand().create_parser("manage.py", name)._actions}
    parser = load_command_class("django_jobs", name).create_parser("manage.py", name)
    own = [action for action in parser._actions if action.dest not in common]
    options = {action.option_strings[0]: action for action in own if action.option_strings}
    names = [name for name in shown if not name.startswith("-")]
    positional = [action for action in own if not action.option_strings]
    # One the table leaves out keeps its own name, so that the comparison sees it missing.
    return {**options, **{names[i] if i < len(names) else a.dest: a for i, a in enumerate(positional)}}


def check_default(option: str, cell: str, action: argparse.Action) -> None:
    """``off`` is a flag, ``none`` no default, a number that number; anything else is resolved
    when the command runs (the parser's default is empty), from the settings it names."""
    if cell == "off":
        assert (action.nargs, action.default) == (0, False), f"{option}: shows off, it is not a flag"
    elif cell == "none":
        assert action.default is None, option
    elif re.fullmatch(r"\d+(\.\d+)?", cell):
        assert action.default == float(cell), f"{option}: shows {cell}, the default is {action.default!r}"
    else:
        assert action.default in (None, []), f"{option}: shows {cell!r}, the default is {action.default!r}"
        assert set(pages.code(cell)) <= set(conf.DEFAULTS), f"{option}: {cell!r} names an unknown setting"


def test_each_options_table_lists_every_option_with_its_default() -> None:
    checked = []
    for found in pages.tables(COMMANDS):
        if found.header[0] != "option":
            continue
        name = pages.code(found.heading)[0]
        shown = {pages.code(row[0])[0].split()[0]: row for row in found.rows}
        options = own_arguments(name, list(shown))
        assert sorted(shown) == sorted(options), f"docs/commands.md's table of {name}"
        if "default" in found.header:
            for option, row in shown.items():
                check_default(option, row[found.header.index("default")], options[option])
        checked.append(name)
    assert {"jobs_work", "jobs_reap", "jobs_purge"} <= set(checked), checked


def exit_status(argv: list[str]) -> int:
    """Run ``manage.py ARGV`` in this process, as the command line does, and return its status.
    The system checks are skipped: the model checks would ask the test settings' MariaDB."""
    try:
        load_command_class("django_jobs", argv[0]).run_from_argv(["manage.py", *argv, "--skip-checks"])
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.usefixtures("clean_state")
def test_each_exit_status_example_exits_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # A command run from the command line closes the connections as it ends; the test's stay.
    monkeypatch.setattr(connections, "close_all", lambda: None)
    statuses = table(COMMANDS, "Exit status", "status")
    ran = {}
    for row in statuses:
        for example in (text for text in pages.code(row[-1]) if text.startswith("jobs_")):
            ran[example] = exit_status(shlex.split(example))
    want = {example: int(row[0]) for row in statuses for example in pages.code(row[-1]) if example in ran}
    assert ran == want
    assert set(want.values()) == {0, 1, 2}, "an example of each status"
