"""docs/quickstart.md, followed for real: a new project in a temporary folder, the files the page
has the reader write, every command of its ``sh`` blocks in page order, and each output block
compared with what the commands above it printed.

The code comes from the page itself, so editing the page changes what runs. The conventions the
page follows for that:

- a ``python`` block whose introducing prose names a file (``In `mysite/settings.py` ...``) is
  that file's content; for the settings, the block is added to the generated ``settings.py``
  with its ``# ... Django's apps ...`` line standing for the apps ``startproject`` listed;
- an output block (a fence without a language) right under an ``sh`` block shows what that
  block's commands print, stdout and stderr as a terminal interleaves them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs import pages, shell
from tests.docs.output import OutputCheck

pytestmark = pytest.mark.slow

QUICKSTART = pages.REPO_ROOT / "docs" / "quickstart.md"
SETTINGS = "mysite/settings.py"

# The page's commands that this test does not run, and why. Each must still be on the page.
SKIPPED = {
    ("python", "-m", "venv"): "the test runs in the virtualenv of its own interpreter",
    ("pip", "install"): "django_jobs is importable already (PYTHONPATH: this checkout)",
    ("python", "manage.py", "createsuperuser"): "it asks for a password",
    ("python", "manage.py", "runserver"): "it serves until it is stopped",
}

DJANGO_APPS = re.compile(r"^INSTALLED_APPS = \[\n(?P<apps>.*?)^\]", re.MULTILINE | re.DOTALL)
PLACEHOLDER = re.compile(r"^ *# \.\.\. Django's apps \.\.\.\n", re.MULTILINE)


def named_file(block: pages.Block) -> str | None:
    """The file the prose just above ``block`` names (its last `*.py`), if any."""
    names = [name for name in pages.code(block.before) if name.endswith(".py")]
    return names[-1] if names else None


def with_settings(generated: str, shown: str) -> str:
    """``settings.py`` as ``startproject`` wrote it, then the page's block, whose placeholder
    line becomes the apps ``startproject`` listed."""
    apps = DJANGO_APPS.search(generated)
    assert apps, "startproject wrote no INSTALLED_APPS list"
    code, found = PLACEHOLDER.subn(lambda _: apps["apps"], shown)
    assert found == 1, f"the settings block has no `# ... Django's apps ...` line:\n{shown}"
    return f"{generated}\n{code}"


def test_the_quickstart_runs_as_shown(tmp_path: Path) -> None:
    check = OutputCheck()
    skipped: set[tuple[str, ...]] = set()
    written: list[str] = []
    previous: pages.Block | None = None
    printed = ""
    for block in pages.blocks(QUICKSTART):
        where = block.where(QUICKSTART)
        if block.lang == "python" and (name := named_file(block)):
            path = tmp_path / name
            text = with_settings(path.read_text(), block.text) if name == SETTINGS else block.text
            path.write_text(text)
            written.append(name)
        elif block.lang == "sh":
            printed = ""
            for argv in shell.commands(block.text):
                prefix = next((p for p in SKIPPED if tuple(argv[: len(p)]) == p), None)
                if prefix is not None:
                    skipped.add(prefix)
                    continue
                printed += shell.run(argv, tmp_path)
        elif block.lang == "":
            shows_output = previous is not None and previous.lang == "sh" and not block.before.strip()
            assert shows_output, f"{where}: an output block that no sh block right above it prints"
            check(block, where, printed)
        previous = block
    check.assert_none()
    assert {SETTINGS, "shop/jobs.py"} <= set(written), f"the page no longer has the reader write: {written}"
    assert skipped == set(SKIPPED), f"not on the page any more: {set(SKIPPED) - skipped}"
