"""Helpers for tests that drive real ``manage.py`` processes (``jobs_work``, ``jobs_reap``).

Every process is started in its own session (its own process group), so a test can signal the
supervisor alone, or the supervisor and its forked workers at once, and so cleanup can kill
exactly the processes a test started (``os.killpg`` on that group's id), never anything else.

Waiting is always a poll with a deadline: a test fails with a message saying what it waited
for, instead of hanging or relying on a fixed sleep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# The repository root: the parent of the tests package (CI runs from a fresh clone elsewhere).
REPO_ROOT = Path(__file__).resolve().parent.parent

# A safety net passed to every worker: if a test dies without its finally (e.g. pytest is
# SIGKILLed), the worker still exits on its own. Far above any test's own deadline.
SAFETY_MAX_TIME = 150

START_LINE = "django-jobs worker started"
STOP_LINE = "django-jobs worker stopped"


def worker_env(lease_timeout: float | None = None, **extra: str) -> dict[str, str]:
    """os.environ plus what points a subprocess at the test databases."""
    env = dict(os.environ)
    env.update(DJANGO_SETTINGS_MODULE="tests.settings", JOBS_TEST_SUBPROCESS="1", PYTHONUNBUFFERED="1")
    env.pop("JOBS_TEST_LEASE_TIMEOUT", None)
    if lease_timeout is not None:
        env["JOBS_TEST_LEASE_TIMEOUT"] = str(lease_timeout)
    env.update(extra)
    return env


def manage(*args: str) -> list[str]:
    return [sys.executable, "-m", "django", *args]


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned) or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, already dead but not yet reaped, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


class Proc:
    """A started command whose stdout and stderr are collected line by line by reader threads."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.args = args
        self.popen = subprocess.Popen(
            args,
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: see killpg below
        )
        self.pid = self.popen.pid
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.popen.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.popen.stderr, self.err), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: Any, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))
        stream.close()

    # -- observing --

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        """Everything printed so far (for assertion messages)."""
        return "\n".join(["--- stdout", *self.out, "--- stderr", *self.err])

    def wait_for_line(self, predicate: Callable[[str], bool], timeout: float, what: str) -> str:
        def found() -> str | None:
            line = next((line for line in list(self.out) if predicate(line)), None)
            if line is None and not self.alive():
                raise AssertionError(f"{self.args} exited ({self.returncode}) before printing {what}\n{self.output()}")
            return line

        try:
            return wait_until(found, timeout, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.output()}") from None

    def wait_started(self, timeout: float = 30) -> str:
        return self.wait_for_line(lambda line: line.startswith(START_LINE), timeout, "the worker's start line")

    def job_lines(self, status: str | None = None) -> list[str]:
        """The per-job lines printed so far (``status`` filters on the first column)."""
        lines = [line for line in list(self.out) if line and not line.startswith((START_LINE, STOP_LINE))]
        return [line for line in lines if status is None or line.split()[0] == status]

    # -- ending --

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit; fail (and kill it) if it does not within ``timeout``."""
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.args} did not exit within {timeout:g}s\n{self.output()}") from None
        for reader in self._readers:
            reader.join(timeout=5)
        return code

    def send(self, signum: int, *, group: bool = False) -> None:
        """Send ``signum`` to the supervisor, or to its whole process group (as a terminal's ^C)."""
        if group:
            os.killpg(self.pid, signum)
        else:
            self.popen.send_signal(signum)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Ask for a clean stop and return the exit code."""
        if self.alive():
            self.send(signum)
        return self.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the process group this Proc started (the supervisor and its forked workers)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


class Procs:
    """Starts processes and remembers them, so a ``finally`` can kill every one of them."""

    def __init__(self) -> None:
        self.started: list[Proc] = []

    def start(self, *args: str, env: dict[str, str]) -> Proc:
        proc = Proc(manage(*args), env)
        self.started.append(proc)
        return proc

    def worker(self, *args: str, env: dict[str, str], wait_started: bool = True) -> Proc:
        """``jobs_work ARGS --max-time <safety net>``, by default waited for until its start line."""
        proc = self.start("jobs_work", *args, "--max-time", str(SAFETY_MAX_TIME), env=env)
        if wait_started:
            proc.wait_started()
        return proc

    def run(self, *args: str, env: dict[str, str], timeout: float = 60) -> tuple[int, Proc]:
        """Run a command to completion; returns its exit code and the Proc (for its output)."""
        proc = self.start(*args, env=env)
        return proc.wait(timeout), proc

    def kill_all(self) -> None:
        for proc in self.started:
            proc.kill()


@contextmanager
def processes() -> Iterator[Procs]:
    """``with processes() as procs:`` -- every process started through ``procs`` is killed on exit."""
    procs = Procs()
    try:
        yield procs
    finally:
        procs.kill_all()
