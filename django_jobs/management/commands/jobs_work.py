from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_jobs import registry, signing
from django_jobs.pool import WorkerPool
from django_jobs.worker import QueueWorker, WorkerResult

from . import _validate


class Command(BaseCommand):
    help = "Run a django-jobs worker until SIGTERM/SIGINT (or --once / --max / --max-time)."

    def add_arguments(self, parser: CommandParser) -> None:
        _validate.add_target_arguments(parser, "queues to consume, in priority order (default: the first of QUEUES)")
        parser.add_argument("--once", action="store_true", help="one fetch, at most one job, then exit")
        parser.add_argument("--max", type=int, dest="max_jobs", help="exit after N jobs")
        parser.add_argument("--max-time", type=float, help="exit after S seconds")
        parser.add_argument("--concurrency", type=int, default=1, help="worker processes (default 1)")
        parser.add_argument("--sleep", type=float, help="seconds to wait after an empty fetch (default POLL_INTERVAL)")

    def handle(self, *args: Any, **opts: Any) -> None:
        # Bad arguments and settings are refused here, in one line, before any process is forked.
        backend = _validate.backend(opts["backend"])
        queues = _validate.queues(opts["queues"] or _validate.known_queues()[:1])
        _validate.at_least_one("--concurrency", opts["concurrency"])
        _validate.at_least_one("--max", opts["max_jobs"])
        _validate.positive_seconds("--max-time", opts["max_time"])
        _validate.positive_seconds("--sleep", opts["sleep"])
        try:
            signing.signing_keys()
            registry.autodiscover()  # before forking, so every process has the @job registrations
        except ImproperlyConfigured as exc:
            raise CommandError(_validate.one_line(exc)) from exc
        pool = WorkerPool(
            lambda: QueueWorker(backend, queues),
            opts["concurrency"],
            max_jobs=1 if opts["once"] else opts["max_jobs"],
            max_time=opts["max_time"],
            once=opts["once"],
            sleep=opts["sleep"],
            on_result=self.report,
        )
        pool.install_signal_handlers()
        self.stdout.write(
            f"django-jobs worker started: backend={backend} queues={','.join(queues)} concurrency={opts['concurrency']}"
        )
        self.stdout.flush()
        if pool.run():
            raise CommandError("worker processes keep dying at start-up (see the errors logged above); giving up")

    def report(self, result: WorkerResult) -> None:
        error = f"  {result.error.splitlines()[0]}" if result.error else ""
        self.stdout.write(
            f"{result.status:<18} {result.job_id} {result.handler} queue={result.queue} "
            f"attempt={result.attempt} {result.seconds:.3f}s{error}"
        )
        self.stdout.flush()
