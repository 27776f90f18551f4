"""The ``jobs_work`` supervisor: N forked worker processes, restarted if they die.

Each process runs one job at a time in its main thread, so ``SIGALRM`` timeouts work and a job
that crashes or wedges its process (``os._exit``, a segfault, a hard timeout) costs one restart,
never the worker. ``SIGTERM``/``SIGINT`` let every process finish its current job, then exit 0;
a ``SIGINT`` while stopping (a second Ctrl-C) stops at once: each process hands the job in hand
back without counting a run, and one that does not exit within ``INTERRUPT_GRACE`` is killed.
Each process keeps its row in the workers panel while it runs (:mod:`~django_jobs.presence`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict

from django.db import connections

from . import backends
from .backends.base import Lease
from .exceptions import summary
from .logfields import log_fields
from .presence import Presence
from .worker import EXIT_UNREACHABLE, QueueWorker, WorkerResult

if TYPE_CHECKING:
    from multiprocessing.sharedctypes import Synchronized
    from types import FrameType

logger = logging.getLogger("django_jobs.worker")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
PR_SET_PDEATHSIG = 1
# A worker process's state, shared with the supervisor: it tells a death at start-up (before its
# worker was built) from a death while it ran jobs, and a clean finish from both.
STARTING, RUNNING, FINISHED = 0, 1, 2
# Deaths at start-up in a row after which the supervisor gives up.
STARTUP_DEATHS = 5
# A worker process's claims, shared with the supervisor: "<length of the queue's name>:queue<US>
# owner token<US>lease token of the job in hand<US>its job id", then "<US>lease token<US>job id"
# for each failed run whose requeue waits for the batch (the job id left out where it is the
# token, as on the database and Redis backends). The queue's name is read by its length: it may
# hold the separator. Room for about 100 of those, ``PREFETCH``'s default, with ``HAND_ROOM`` kept
# for the job in hand; past that, the next failed runs' requeues are written at once.
CLAIMS_BYTES = 4096
HAND_ROOM = 256
SEPARATOR = "\x1f"
ENTRY_END = f"{SEPARATOR}\0".encode()  # after each token in the shared acks: the list ends there
# Its successes whose acks wait for the batch, shared too: "<lease token><US>" each, appended one
# memory write per success, cleared once the batch has written them. Room for about 240 lease
# tokens; past that, the next successes are acked at once.
ACKS_BYTES = 8192
# After a second SIGINT, a worker process still running this long (its job stuck where no
# signal reaches it, or its hand-back held up by the backend) is killed; its job is recovered.
INTERRUPT_GRACE = 5.0


class SharedBudget:
    """``--max N`` shared by every process: a job is counted before it is fetched."""

    def __init__(self, total: int) -> None:
        self.left: Synchronized[int] = multiprocessing.get_context("fork").Value("q", total)

    def take(self) -> bool:
        with self.left.get_lock():
            if self.left.value <= 0:
                return False
            self.left.value -= 1
            return True

    def give_back(self) -> None:
        with self.left.get_lock():
            self.left.value += 1

    def exhausted(self) -> bool:
        return self.left.value <= 0


class Sidecar(NamedTuple):
    """A process the pool runs beside its workers (the scheduler of ``jobs_work --with-scheduler``):
    ``run(stop)`` until ``stop`` is set, which a stop signal does. Supervised like a worker
    process, it is stopped once the last worker process has finished."""

    name: str
    run: Callable[[threading.Event], object]


class _RunOptions(TypedDict):
    """What each process's ``QueueWorker.run`` is given, besides the shared budget."""

    max_time: float | None
    once: bool
    sleep: float | None
    on_result: Callable[[WorkerResult], None] | None


class WorkerPool:
    """Runs ``concurrency`` worker processes built by ``make_worker``."""

    def __init__(
        self,
        make_worker: Callable[[], QueueWorker],
        concurrency: int = 1,
        *,
        max_jobs: int | None = None,
        max_time: float | None = None,
        once: bool = False,
        sleep: float | None = None,
        on_result: Callable[[WorkerResult], None] | None = None,
        recover: Callable[[str, str, Sequence[str], Sequence[str]], object] | None = None,
        reap: Callable[[], object] | None = None,
        on_start: Callable[[], None] | None = None,
        on_stop: Callable[[], None] | None = None,
        sidecar: Sidecar | None = None,
    ) -> None:
        """``recover(queue, owner_token, counted, succeeded)`` is called when a worker process dies
        holding claims (:func:`~django_jobs.reaper.recover_claims`), ``counted`` the lease tokens of
        its job in hand and of its failed runs whose requeues were not written, ``succeeded`` those
        of its successes whose acks were not written; ``reap()``, the reaping of
        the workers' queues at start, is called here once the first processes are forked, so
        none of them waits for it before its first claim (each reaps every ``LEASE_TIMEOUT``
        after that); ``on_start`` and ``on_stop`` run in each worker process before and after
        its run; ``sidecar`` runs in one more process, in the slot after the workers'."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.make_worker = make_worker
        self.concurrency = concurrency
        self.run_options: _RunOptions = {"max_time": max_time, "once": once, "sleep": sleep, "on_result": on_result}
        self.budget = SharedBudget(max_jobs) if max_jobs is not None else None
        self.recover, self.reap = recover, reap
        self.on_start, self.on_stop = on_start, on_stop  # in each worker process, around its run
        self.sidecar = sidecar
        # pid -> slot, state, start, claims
        self.children: dict[int, tuple[int, Synchronized[int], float, Shared]] = {}
        self.stopping = False
        self._worker: QueueWorker | None = None
        # Set by the supervisor on a second SIGINT, read by each worker process's handler: the
        # signal that follows means "stop at once", not "finish the job in hand".
        self._now: ctypes.c_byte = multiprocessing.get_context("fork").Value("b", 0, lock=False)

    def install_signal_handlers(self) -> None:
        """Call before announcing start: from then on a signal means a clean stop, and a SIGINT
        while stopping a stop at once."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._worker is not None:  # a worker process: the supervisor says which stop
            if self._now.value:
                self._worker.interrupt()  # raises WorkerInterrupted into the job in hand, if any
            else:
                self._worker.stop()
            return
        if self.stopping and signum == signal.SIGINT:
            self._stop_now()
            return
        if not self.stopping:
            announce_stop(signum)
        self._stop()

    def _stop(self) -> None:
        """Every process finishes its job in hand, then exits."""
        self.stopping = True
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def _stop_now(self) -> None:
        """Every process ends its run in hand now (handed back, not counted) and exits; one
        still running ``INTERRUPT_GRACE`` seconds later is killed, and its job recovered."""
        if self._now.value:
            return
        self._now.value = 1
        logger.warning("SIGINT again: stopping now; the jobs in hand are interrupted and handed back")
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
        signal.signal(signal.SIGALRM, self._kill_stragglers)
        signal.setitimer(signal.ITIMER_REAL, INTERRUPT_GRACE)

    def _kill_stragglers(self, signum: int, frame: FrameType | None) -> None:
        for pid, (slot, *_) in list(self.children.items()):
            logger.error(
                "%s process %d (slot %d) still runs %gs after the second SIGINT; killing it",
                self._kind(slot),
                pid,
                slot,
                INTERRUPT_GRACE,
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def run(self) -> int:
        """Supervise until every process has finished. Returns the exit code: 0; 1 when worker
        processes kept dying at start-up and the supervisor gave up; ``EXIT_UNREACHABLE`` when a
        worker process of a bounded run never reached its backend.

        A death at start-up is a process that died before its worker was built (e.g. a backend
        that cannot be constructed). After ``STARTUP_DEATHS`` of them in a row, replacing it again
        would only fail again: every process is stopped and 1 returned. Any other death (a job's
        ``os._exit()``, a signal, a hard timeout, a crash after start-up) resets the count.
        """
        _close_connections()  # children must not share the parent's sockets
        for slot in range(self.concurrency + (self.sidecar is not None)):
            self._spawn(slot)
        self._reap_at_start()
        quick_deaths = 0
        gave_up = unreachable = False
        while self.children:
            self._stop_sidecar_when_alone()
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            slot, state, started, shared = self.children.pop(pid)
            if state.value == FINISHED:
                unreachable = unreachable or os.waitstatus_to_exitcode(status) == EXIT_UNREACHABLE
                continue
            claims = Claims.read(shared)
            if self.stopping or (self.budget is not None and self.budget.exhausted()):
                self._recover(claims)  # not replaced: its jobs go back now all the same
                continue
            code = os.waitstatus_to_exitcode(status)
            lived = time.monotonic() - started
            quick_deaths = quick_deaths + 1 if state.value == STARTING else 0
            if quick_deaths >= STARTUP_DEATHS:
                logger.error(
                    "%s process %d (slot %d) died with status %s at start-up, %d times in a row; giving up",
                    self._kind(slot),
                    pid,
                    slot,
                    code,
                    quick_deaths,
                )
                gave_up = True
                self._stop()  # stop the others; their jobs finish first
                continue
            logger.error(
                "%s process %d (slot %d) died with status %s; starting a new one",
                self._kind(slot),
                pid,
                slot,
                code,
                extra=_death_fields(claims),
            )
            self._recover(claims)  # after the death is logged: the job it ran counts from here
            if lived < 1:
                time.sleep(1)  # do not spin if it dies at start-up
            if not self.stopping:
                self._spawn(slot)
        if self._now.value:
            signal.setitimer(signal.ITIMER_REAL, 0)  # every process is gone: nothing to kill
        return 1 if gave_up else EXIT_UNREACHABLE if unreachable else 0

    def _kind(self, slot: int) -> str:
        return self.sidecar.name if self.sidecar is not None and slot == self.concurrency else "worker"

    def _stop_sidecar_when_alone(self) -> None:
        """Every worker process has finished (``--max``, ``--max-time``): stop the sidecar too."""
        if self.sidecar is not None and all(slot == self.concurrency for slot, *_ in self.children.values()):
            for pid in list(self.children):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)

    def _reap_at_start(self) -> None:
        """The reaping at start, here, while the worker processes start; this process's
        connections are closed again before its next fork. A failure is logged: the worker
        processes reap every ``LEASE_TIMEOUT``."""
        if self.reap is None:
            return
        try:
            self.reap()
        except Exception as exc:  # noqa: BLE001 - logged; the worker processes reap every LEASE_TIMEOUT
            logger.error(
                "reaping expired leases at start failed: %s; the worker processes reap them later", summary(exc)
            )
        finally:
            _close_connections()

    def _recover(self, claims: Claims | None) -> None:
        """A worker process died: recover the claims it held now, in this process (whose
        connections are closed again before the next fork)."""
        if claims is None or self.recover is None:
            return
        try:
            self.recover(claims.queue, claims.owner, claims.counted, claims.succeeded)
        except Exception:
            logger.exception(
                "could not recover the jobs of a dead worker process; their leases expire instead",
                extra=_death_fields(claims),
            )
        finally:
            _close_connections()

    def _spawn(self, slot: int) -> None:
        context = multiprocessing.get_context("fork")
        state = context.Value("b", STARTING)
        claims = Shared(context.Array("c", CLAIMS_BYTES, lock=False), context.Array("c", ACKS_BYTES, lock=False))
        parent = os.getpid()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        pid = os.fork()
        if pid:
            self.children[pid] = (slot, state, time.monotonic(), claims)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            return
        code = 1
        try:
            self.children = {}
            _die_with_parent(parent)
            if self.sidecar is not None and slot == self.concurrency:
                self._run_sidecar(self.sidecar, state, mask)
                code = 0
            else:
                code = self._run_worker(claims, state, mask)
            state.value = FINISHED
        except BaseException:
            logger.exception("%s process crashed", self._kind(slot))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _run_worker(self, claims: Shared, state: Synchronized[int], mask: set[int | signal.Signals]) -> int:
        """A worker process's life, from its start (stop signals still blocked) to its stop;
        its exit status: 0, or ``EXIT_UNREACHABLE`` when a bounded run never reached the backend."""
        self._worker = worker = self.make_worker()
        worker.supervisor = Recorder(claims)
        state.value = RUNNING
        worker.exit_on_hard_timeout = True
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if self.stopping:
            worker.stop()
        if self.on_start is not None:
            self.on_start()
        with Presence(worker):  # its row in the workers panel, written every Worker.BEAT
            worker.run(budget=self.budget, reap_at_start=self.reap is None, **self.run_options)
        if self.on_stop is not None:
            self.on_stop()
        worker.backend.close()  # hands back anything still held for us (a reserved-ahead job)
        bounded = self.budget is not None or self.run_options["max_time"] is not None or self.run_options["once"]
        return EXIT_UNREACHABLE if bounded and worker.unreachable is not None else 0

    def _run_sidecar(self, sidecar: Sidecar, state: Synchronized[int], mask: set[int | signal.Signals]) -> None:
        """The sidecar process: a stop signal sets its ``stop`` event."""
        stop = threading.Event()
        for signum in STOP_SIGNALS:
            signal.signal(signum, lambda *_: stop.set())
        state.value = RUNNING
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if self.stopping:
            stop.set()
        sidecar.run(stop)


def announce_stop(signum: int) -> None:
    """The first stop signal: what happens now, and (for a SIGINT) how to stop at once."""
    if signum == signal.SIGINT:
        logger.warning("SIGINT: stopping once the jobs in hand are finished; SIGINT again to stop at once")
    else:
        logger.info("%s: stopping once the jobs in hand are finished", signal.Signals(signum).name)


class Shared(NamedTuple):
    """A worker process's memory shared with its supervisor: its claims (``CLAIMS_BYTES``) and
    its successes not acked yet (``ACKS_BYTES``)."""

    claims: ctypes.Array[ctypes.c_char]
    acks: ctypes.Array[ctypes.c_char]


class Claims(NamedTuple):
    """What a worker process held, as its supervisor reads it from shared memory."""

    queue: str
    owner: str
    running: str | None  # the lease token of the job in hand
    job_id: str | None  # and its job's id
    failed: tuple[tuple[str, str], ...] = ()  # (lease token, job id or "") of each failed run not written
    succeeded: tuple[str, ...] = ()  # the lease tokens of the successes not acked yet

    @property
    def counted(self) -> list[str]:
        """The lease tokens whose loss counts a run: the job in hand, the failed runs."""
        return [token for token in (self.running, *(token for token, _ in self.failed)) if token]

    @staticmethod
    def read(shared: Shared) -> Claims | None:
        """The claims written by :class:`Recorder`, or ``None`` when it held none."""
        text = shared.claims.value.decode(errors="replace")
        if not text:
            return None
        length, _, text = text.partition(":")
        queue, text = text[: int(length)], text[int(length) + 1 :]
        owner, running, job_id, *failed = text.split(SEPARATOR)
        pairs = tuple(zip(failed[::2], failed[1::2], strict=False))
        # A token cut short by the death (a write under way) fences nothing: it is left alone.
        succeeded = tuple(token for token in shared.acks.value.decode(errors="replace").split(SEPARATOR) if token)
        return Claims(queue, owner, running or None, job_id or None, pairs, succeeded)


def _death_fields(claims: Claims | None) -> dict[str, Any]:
    """The log fields of a worker process's death: the job it had in hand, lost."""
    if claims is None:
        return log_fields(None, None)
    if claims.running is None:
        return log_fields(None, claims.queue)
    return log_fields(claims.job_id, claims.queue, outcome="lost")


class Recorder:
    """A worker process's :class:`~django_jobs.worker.Supervisor`: keeps its latest claim, the
    job it runs, its failed runs and its successes not written yet where the supervisor can read
    them after the process died (two shared-memory writes per job, one more per success and two
    more per failed run that wait for the batch). The main thread and the heartbeat's both
    write: under a lock."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared.claims
        self.acks = memoryview(shared.acks).cast("B")
        self._claim = ("", "")  # queue, owner token of the latest lease
        self._running = ("", "")  # lease token, job id of the job in hand
        self._failed: dict[str, str] = {}  # lease token -> job id, of the failed runs not written
        self._acked: dict[str, None] = {}  # the lease tokens of the successes not written, in order
        self._acks_end = 0  # where the next one goes in ``acks``
        self._lock = threading.Lock()

    def in_hand(self, lease: Lease, running: bool) -> None:
        with self._lock:
            self._claim = (lease.queue, lease.owner_token)
            self._running = (lease.token, _job_id(lease)) if running else ("", "")
            if not self._keep(self._text()):
                self.shared.value = b""  # too long to keep: the leases expire

    def succeeded(self, lease: Lease) -> bool:
        with self._lock:
            if (lease.queue, lease.owner_token) != self._claim:  # another claim's: recovered apart
                return False
            entry = lease.token.encode() + ENTRY_END
            end = self._acks_end + len(entry) - 1
            if end >= ACKS_BYTES:
                return False
            # (A death during the write can leave a token cut short, or the tokens of an earlier,
            # longer list after it: acks written already. Their fences fail: nothing is acked.)
            self.acks[self._acks_end : end + 1] = entry
            self._acks_end = end
            self._acked[lease.token] = None
            return True

    def unwritten(self, lease: Lease) -> bool:
        with self._lock:
            if (lease.queue, lease.owner_token) != self._claim:  # another claim's: recovered apart
                return False
            job_id = _job_id(lease)
            self._failed[lease.token] = "" if job_id == lease.token else job_id
            if self._keep(self._text(), HAND_ROOM):
                return True
            del self._failed[lease.token]
            return False

    def written(self, leases: Iterable[Lease]) -> None:
        with self._lock:
            failed, acked = len(self._failed), len(self._acked)
            for lease in leases:
                self._failed.pop(lease.token, None)
                self._acked.pop(lease.token, None)
            if len(self._failed) != failed:
                self._keep(self._text())
            if len(self._acked) != acked:
                entries = "".join(f"{token}{SEPARATOR}" for token in self._acked).encode()
                self._acks_end = len(entries)
                self.acks[: self._acks_end + 1] = entries + b"\0"

    def _text(self) -> bytes:
        failed = [part for pair in self._failed.items() for part in pair]
        queue, owner = self._claim
        return f"{len(queue)}:{SEPARATOR.join((queue, owner, *self._running, *failed))}".encode()

    def _keep(self, text: bytes, room: int = 0) -> bool:
        """Write ``text`` where ``room`` bytes more would still fit; ``False`` if it would not."""
        if len(text) + room >= CLAIMS_BYTES:
            return False
        self.shared.value = text
        return True


def _close_connections() -> None:
    """Close this process's connections before it forks: the database's, the pools that
    Django's ``OPTIONS["pool"]`` keeps them in on PostgreSQL (a pool closed only hands them
    back to itself, and a child would use the same sockets), and the backends'."""
    connections.close_all()
    for connection in connections.all():
        close_pool = getattr(connection, "close_pool", None)  # PostgreSQL on Django 5.1 and later
        if close_pool is not None:
            close_pool()
    backends.reset()


def _job_id(lease: Lease) -> str:
    return lease.token if lease.envelope is None else lease.envelope.id


def _die_with_parent(parent: int) -> None:
    """Linux: a SIGKILLed supervisor takes its workers down too, like a crashed worker would."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)
