"""Other projects' test suites, run against django-jobs: their source distributions are fetched
from PyPI with ``pip download`` into ``.cache/upstream/`` (git-ignored) once, and their test
modules loaded with a list of textual adaptations, each of which must still match.

A distribution that cannot be fetched (no network) skips the tests that need it; under
``CI=true`` it fails them, as a missing service does (tests/conftest.py).
"""

from __future__ import annotations

import linecache
import os
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "upstream"
IN_CI = os.environ.get("CI") == "true"


def sdist(name: str, version: str, members: Sequence[str]) -> Path:
    """The folder ``<name>-<version>`` holding the ``members`` (paths inside the source
    distribution, folders included whole) of ``name==version``'s sdist, fetched and unpacked
    once. Skips the calling module's tests (fails them under CI) when it cannot be fetched."""
    stem = f"{name.replace('-', '_').lower()}-{version}"
    tree, archive = CACHE / stem, CACHE / f"{stem}.tar.gz"
    done = tree / ".unpacked"
    if done.exists():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    if not archive.exists():
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        try:
            fetched = subprocess.run(
                [*command, f"{name}=={version}", "-d", str(CACHE)],
                check=False,
                capture_output=True,
                text=True,
                timeout=600,
            )
        except subprocess.TimeoutExpired:
            _unavailable(f"pip download {name}=={version} timed out")
        if fetched.returncode != 0 or not archive.exists():
            _unavailable(f"pip download {name}=={version} failed: {fetched.stderr.strip()[-500:]}")
    with tarfile.open(archive) as tar:
        wanted = [f"{stem}/{member}" for member in members]
        picked = [m for m in tar.getmembers() if any(m.name == w or m.name.startswith(f"{w}/") for w in wanted)]
        if not picked:
            raise AssertionError(f"{archive.name} has none of {list(members)}")
        tar.extractall(CACHE, members=picked, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    done.touch()
    return tree


def _unavailable(reason: str) -> NoReturn:
    message = f"the upstream test suite is not available: {reason}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: a missing suite is a failure)", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def load(path: Path, name: str, substitutions: Sequence[tuple[str, str]] = ()) -> ModuleType:
    """Import ``path`` as module ``name`` after replacing each ``(old, new)`` of
    ``substitutions`` in its source; an ``old`` that is not found is an error (the upstream file
    changed: review the adaptations)."""
    source = path.read_text(encoding="utf-8")
    for old, new in substitutions:
        if old not in source:
            raise AssertionError(f"{path}: {old!r} not found; the upstream file changed, review its adaptations")
        source = source.replace(old, new)
    # Tracebacks and inspect.getsource() read the adapted source, under a name that says so.
    filename = f"{path} (adapted)"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    module = ModuleType(name)
    module.__file__ = str(path)
    module.__package__ = name.rpartition(".")[0]
    sys.modules[name] = module
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - a fetched test module, on purpose
    return module


class Absent:
    """What a loaded module gets for a name it imports from a package that is not installed
    (another backend's model, admin or helpers): calling it, or decorating with what a call
    returns, works, so its class bodies load; any attribute fails the test that reads it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: object, **kwargs: object) -> object:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator: the function stays as it was
        return self

    def __getattr__(self, attr: str) -> object:
        raise AssertionError(f"{self._name} is not installed: a test of it does not apply here")
