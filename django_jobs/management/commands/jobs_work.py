from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_jobs import checks, registry, signing
from django_jobs.backends import get_backend, persistence_warning
from django_jobs.backends.base import QueueBackend
from django_jobs.exceptions import summary
from django_jobs.pool import STOP_SIGNALS, Sidecar, WorkerPool, announce_stop
from django_jobs.reaper import Reaper, recover_claims
from django_jobs.worker import EXIT_UNREACHABLE, QueueWorker

from . import _report, _validate


class Command(BaseCommand):
    help = "Run a django-jobs worker until SIGTERM/SIGINT (or --once / --max / --max-time)."
    # django-jobs' own checks only: those of settings a worker would lose or mis-run jobs with.
    # The others (models, admin, URLs, templates, ...) are for the deploy's `manage.py check`.
    requires_system_checks = [checks.TAG]

    def add_arguments(self, parser: CommandParser) -> None:
        _validate.add_target_arguments(parser, "queues to consume, in priority order (default: the first of QUEUES)")
        parser.add_argument("--once", action="store_true", help="one fetch, at most one job, then exit")
        parser.add_argument("--max", type=int, dest="max_jobs", help="exit after N jobs")
        parser.add_argument("--max-time", type=float, help="exit after S seconds")
        parser.add_argument("--concurrency", type=int, default=1, help="worker processes (default 1)")
        parser.add_argument("--sleep", type=float, help="seconds to wait after an empty fetch (default POLL_INTERVAL)")
        parser.add_argument(
            "--prefetch",
            type=int,
            help="jobs each process claims at a time on the database and Redis backends (default PREFETCH; 1 for long jobs)",
        )
        parser.add_argument(
            "--with-scheduler",
            action="store_true",
            help="also dispatch the periodic jobs of JOBS['SCHEDULE'], in one more process (as jobs_schedule)",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        # Bad arguments and settings are refused here, in one line, before any process is forked.
        backend = _validate.backend(opts["backend"])
        queues = _validate.queues(opts["queues"] or _validate.known_queues()[:1])
        _validate.at_least_one("--concurrency", opts["concurrency"])
        _validate.at_least_one("--max", opts["max_jobs"])
        _validate.at_least_one("--prefetch", opts["prefetch"])
        _validate.positive_seconds("--max-time", opts["max_time"])
        _validate.positive_seconds("--sleep", opts["sleep"])
        try:
            signing.signing_keys()
            registry.autodiscover()  # before forking, so every process has the @job registrations
        except ImproperlyConfigured as exc:
            raise CommandError(_validate.one_line(exc)) from exc
        _validate.migrated(backend)
        # Colours on a terminal only (or with --force-color); --no-color has made the style plain.
        colour = opts["force_color"] or self.stdout.isatty()
        self.report = _report.Report(self.stdout, opts["verbosity"], self.style if colour else None, self.stderr)
        per_job = opts["verbosity"] >= 1
        limits: dict[str, Any] = {
            "max_jobs": 1 if opts["once"] else opts["max_jobs"],
            "max_time": opts["max_time"],
            "once": opts["once"],
            "sleep": opts["sleep"],
            "on_result": self.report.result if per_job else None,  # one line per job
        }
        # A rejection's line is all a worker's terminal shows of it (its log record stays elsewhere).
        with _report.rejections_once_on_a_terminal() if per_job else contextlib.nullcontext():
            self.work(backend, queues, opts, limits)

    def work(self, backend: str, queues: list[str], opts: dict[str, Any], limits: dict[str, Any]) -> None:
        """Here (a bounded run of one process), or in a supervised pool of processes."""
        per_job, prefetch, tracebacks = opts["verbosity"] >= 1, opts["prefetch"], opts["verbosity"] >= 2
        sidecar, announce = self.scheduler(opts["verbosity"]) if opts["with_scheduler"] else (None, None)
        if sidecar is None and opts["concurrency"] == 1 and (opts["once"] or opts["max_jobs"] is not None):
            worker = QueueWorker(backend, queues, exit_on_hard_timeout=True, prefetch=prefetch, tracebacks=tracebacks)
            self.work_here(worker, limits)
            return
        pool = WorkerPool(
            lambda: QueueWorker(backend, queues, prefetch=prefetch, tracebacks=tracebacks),
            opts["concurrency"],
            recover=functools.partial(recover_claims, backend),
            reap=lambda: Reaper(backend, queues).reap_once(),
            on_start=self.report.restart,
            on_stop=self.report.stopped if per_job else None,
            sidecar=sidecar,
            **limits,
        )
        pool.install_signal_handlers()
        self.report.started(backend, queues, opts["concurrency"])
        if announce is not None:
            announce()
        self.under_the_start_line(backend)
        code = pool.run()
        if code == EXIT_UNREACHABLE:
            raise unreachable(get_backend(backend), None)
        if code:
            raise CommandError("worker processes keep dying at start-up (see the errors logged above); giving up")

    def scheduler(self, verbosity: int) -> tuple[Sidecar, Callable[[], None]]:
        """``--with-scheduler``: the scheduler's process, and what prints its start lines. Its
        own process, not a thread: a supervisor that forks must hold no connection or lock. (The
        scheduler's code is imported for this option only.)"""
        from django_jobs.scheduler import POLL

        from . import jobs_schedule

        scheduler = jobs_schedule.build(POLL, self.stdout, verbosity)
        sidecar = Sidecar("scheduler", functools.partial(jobs_schedule.serve, scheduler, self.stdout))
        return sidecar, functools.partial(jobs_schedule.announce, scheduler, self.stdout)

    def under_the_start_line(self, backend: QueueBackend | str) -> None:
        """A ``WARNING:`` line under the start line when a restart of the backend's server
        would lose every queued job (Redis without AOF or RDB save points), and the backend's
        word in the log on how idle workers will wait for work. A backend that cannot be built
        or reached here is left to the worker processes, which report why."""
        if isinstance(backend, str):
            try:
                backend = get_backend(backend)  # pool.run() closes it before forking
            except Exception:  # noqa: BLE001 - not this line's to report
                return
        warning = persistence_warning(backend)
        if warning is not None:
            self.report.warning(warning)
        with contextlib.suppress(Exception):  # unreachable: the workers' first wait finds out
            backend.prepare_to_wait()

    def work_here(self, worker: QueueWorker, limits: dict[str, Any]) -> None:
        """A bounded run of one process (``--once``, ``--max``) needs no supervisor: the worker
        runs in this process, on its database connections. So ``call_command`` in a test sees
        the test's rows, and the test sees what the jobs did. ``SIGTERM``/``SIGINT`` stop it
        after the job in hand, a ``SIGINT`` while stopping at once (the job in hand is handed
        back, not counted); a job that ends the process (``os._exit``, a crash, a hard timeout)
        ends the command with the process's status."""

        def on_signal(signum: int, frame: object) -> None:
            if signum == signal.SIGINT and worker.stopping:
                worker.interrupt()  # raises WorkerInterrupted into the job in hand, if any
            elif not worker.stopping:
                announce_stop(signum)
                worker.stop()

        # Signal handlers can be set from the main thread only; the previous ones come back after.
        main = threading.current_thread() is threading.main_thread()
        previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS} if main else {}
        try:
            self.report.started(worker.backend.name, worker.queues, 1)
            self.under_the_start_line(worker.backend)
            worker.run(**limits)
            if self.report.verbosity >= 1:
                self.report.stopped()
            if worker.unreachable is not None:
                raise unreachable(worker.backend, worker.unreachable)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)
            # Hands back a job reserved ahead (beanstalkd, Service Bus). A database backend's
            # connection is the caller's own, perhaps in its transaction: it stays open.
            if not worker.backend.transactional:
                worker.backend.close()


def unreachable(backend: QueueBackend, error: Exception | None) -> CommandError:
    """A bounded run never reached its backend: exit status ``EXIT_UNREACHABLE``."""
    why = "" if error is None else f": {summary(error)}"
    return CommandError(f"never reached {backend.where()}{why}", returncode=EXIT_UNREACHABLE)
