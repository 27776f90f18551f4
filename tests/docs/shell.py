"""Running a page's shell commands as a reader would type them, in a project of their own."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from tests.docs.pages import REPO_ROOT

# The programs a page's commands start, run with the interpreter of this test run.
PROGRAMS = {
    "python": [sys.executable],
    "$py": [sys.executable],  # scripts/demo's name for its virtualenv's python
    "django-admin": [sys.executable, "-m", "django"],
}


def commands(text: str) -> list[list[str]]:
    """The commands of a shell block, one per line (a quoted argument may go on over several
    lines), split as a shell does, ``# comments`` left out."""
    found: list[list[str]] = []
    pending = ""
    for line in text.splitlines(keepends=True):
        pending += line
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on over the next line
            continue
        if argv:
            found.append(argv)
        pending = ""
    assert not pending.strip(), f"a quote is never closed in {text!r}"
    return found


def environ() -> dict[str, str]:
    """A reader's environment: this checkout's ``django_jobs`` first on the path, no test
    settings, output unbuffered so that stdout and stderr interleave as on a terminal."""
    env = {name: value for name, value in os.environ.items() if name != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(argv: list[str], cwd: Path, timeout: float = 60) -> str:
    """Run one command in ``cwd`` and return what it printed, stdout and stderr in the order a
    terminal shows them; fail unless it exits 0."""
    program = PROGRAMS.get(argv[0])
    assert program, f"no way to run {argv[0]!r} (known: {', '.join(PROGRAMS)})"
    done = subprocess.run(
        [*program, *argv[1:]],
        cwd=cwd,
        env=environ(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"`{shlex.join(argv)}` exited {done.returncode}:\n{done.stdout}"
    return done.stdout
