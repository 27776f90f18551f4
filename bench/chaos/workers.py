"""``jobs_work`` subprocesses driven by the chaos battery.

Each worker is ``python -m django jobs_work default other --backend chaos`` in its own session
(its own process group), so the driver can SIGKILL / SIGSTOP / SIGTERM one worker's supervisor
and forked child at once, and clean up exactly what it started (``killpg`` on that group).
Output goes to files (one pair per incarnation) that the driver parses afterwards: job result
lines (``completed``, ``lost``, ...) on stdout, WARNING+ logs (reaped leases, supervisor
restarts, backend errors) on stderr.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
START_LINE = "django-jobs worker started"
PR_SET_PDEATHSIG = 1


def _die_with_driver() -> None:
    """In the child before exec: if the driver dies (even SIGKILLed), its workers go too."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def group_pids(pgid: int) -> list[int]:
    """Live processes of one process group (the supervisor and its forked workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            found.append(int(entry))
    return found


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@dataclass
class Incarnation:
    slot: int
    number: int
    popen: subprocess.Popen[bytes]
    out: Path
    err: Path
    started: float
    killed_by_driver: bool = False
    terminated_by_driver: bool = False
    exit_code: int | None = None
    ended: float | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def children(self) -> list[int]:
        return [pid for pid in group_pids(self.pid) if pid != self.pid]


@dataclass
class Fleet:
    """``size`` worker slots; ``restart`` replaces a worker the driver killed."""

    directory: Path
    env: dict[str, str]
    size: int = 3
    queues: tuple[str, ...] = ("default", "other")
    max_time: float = 3600
    prefetch: int | None = None  # None: the PREFETCH setting (batches)
    slots: list[Incarnation | None] = field(default_factory=list)
    history: list[Incarnation] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.slots = [None] * self.size
        self.directory.mkdir(parents=True, exist_ok=True)

    def start_all(self) -> None:
        for slot in range(self.size):
            self.start(slot, wait=False)
        for slot in range(self.size):
            self.wait_started(slot)

    def start(self, slot: int, wait: bool = True) -> Incarnation:
        number = sum(1 for inc in self.history if inc.slot == slot) + 1
        out = self.directory / f"w{slot}-{number}.out"
        err = self.directory / f"w{slot}-{number}.err"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "django",
                    "jobs_work",
                    *self.queues,
                    "--backend",
                    "chaos",
                    "--max-time",
                    str(self.max_time),
                    *(["--prefetch", str(self.prefetch)] if self.prefetch else []),
                ],
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=fo,
                stderr=fe,
                start_new_session=True,
                preexec_fn=_die_with_driver,  # noqa: PLW1509 - the driver starts no threads
            )
        inc = Incarnation(slot, number, popen, out, err, time.time())
        self.slots[slot] = inc
        self.history.append(inc)
        if wait:
            self.wait_started(slot)
        return inc

    def wait_started(self, slot: int, timeout: float = 60) -> None:
        inc = self.slots[slot]
        assert inc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if inc.popen.poll() is not None:
                raise RuntimeError(f"worker {slot} exited ({inc.popen.returncode}) at start:\n{inc.err.read_text()}")
            if START_LINE in inc.out.read_text(errors="replace") and inc.children():
                return
            time.sleep(0.05)
        raise RuntimeError(f"worker {slot} did not start within {timeout}s:\n{inc.err.read_text()}")

    def live(self) -> list[Incarnation]:
        return [inc for inc in self.slots if inc is not None and inc.popen.poll() is None]

    def signal_group(self, inc: Incarnation, signum: int) -> tuple[list[int], float]:
        """Signal the worker's whole process group; returns the pids it held and the time of the
        signal (taken after the /proc scan, which costs milliseconds)."""
        pids = group_pids(inc.pid)
        at = time.time()
        try:
            os.killpg(inc.pid, signum)
        except ProcessLookupError:
            pass
        return pids, at

    def kill(self, inc: Incarnation) -> tuple[list[int], float]:
        inc.killed_by_driver = True
        pids, at = self.signal_group(inc, signal.SIGKILL)
        inc.exit_code = inc.popen.wait(10)
        inc.ended = time.time()
        return pids, at

    def poll_exits(self) -> list[Incarnation]:
        """Workers that exited since the last call (recorded with their exit code)."""
        ended = []
        for inc in self.slots:
            if inc is not None and inc.exit_code is None and inc.popen.poll() is not None:
                inc.exit_code, inc.ended = inc.popen.returncode, time.time()
                ended.append(inc)
        return ended

    def stop_all(self, timeout: float = 60) -> dict[int, int | None]:
        """SIGCONT (in case), SIGTERM each live worker, wait; SIGKILL what does not exit."""
        codes: dict[int, int | None] = {}
        # A worker restarted a moment ago may still be importing Django: before jobs_work installs
        # its handlers (it then prints its start line) SIGTERM has its default action and the
        # process dies with -15. It holds nothing yet, but let it come up so every exit is clean.
        for inc in self.live():
            try:
                self.wait_started(inc.slot, timeout=60)
            except RuntimeError:
                pass  # reported through its exit code
        for inc in self.live():
            inc.terminated_by_driver = True
            self.signal_group(inc, signal.SIGCONT)
            inc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for inc in self.slots:
            if inc is None:
                continue
            try:
                code = inc.popen.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self.kill(inc)
                code = None
            if inc.exit_code is None:
                inc.exit_code, inc.ended = code, time.time()
            codes[inc.slot] = code
        return codes

    def kill_everything(self) -> None:
        for inc in self.history:
            if inc.popen.poll() is None:
                try:
                    os.killpg(inc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    inc.popen.wait(10)
                except subprocess.TimeoutExpired:
                    pass

    # -- what the workers printed --

    def lines(self, which: str = "out") -> list[str]:
        text = []
        for inc in self.history:
            path = inc.out if which == "out" else inc.err
            if path.exists():
                text.extend(path.read_text(errors="replace").splitlines())
        return text

    def count_status(self, status: str) -> int:
        return sum(1 for line in self.lines("out") if line.split(" ", 1)[0] == status)

    def supervisor_restarts(self) -> list[str]:
        """``jobs_work``'s own restarts of a dead worker process (a crash or a hard timeout)."""
        return [line for line in self.lines("err") if "died with status" in line or "worker process crashed" in line]

    def unexpected_exits(self) -> list[dict[str, int | None]]:
        return [
            {"slot": inc.slot, "incarnation": inc.number, "exit_code": inc.exit_code}
            for inc in self.history
            if inc.exit_code is not None and not inc.killed_by_driver and not inc.terminated_by_driver
        ]
