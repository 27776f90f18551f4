from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_jobs import conf, health

from . import _validate

DEFAULT_MAX_AGE = 300.0


class Command(BaseCommand):
    help = (
        "Check the job system for a container health check: exits 0 when healthy, 1 when a backend is "
        "unreachable, a queue's oldest ready job is older than --max-age, or no live worker serves a queue."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--backend",
            action="append",
            dest="backends",
            help="backend to check (repeatable; default: DEFAULT_BACKEND)",
        )
        parser.add_argument(
            "--queue",
            action="append",
            dest="queues",
            help="queue to check (repeatable; default: every queue of QUEUES)",
        )
        parser.add_argument(
            "--max-age",
            type=float,
            default=DEFAULT_MAX_AGE,
            help=f"seconds a ready job may wait before the queue is unhealthy (default {DEFAULT_MAX_AGE:g})",
        )
        parser.add_argument(
            "--no-age-check",
            action="store_true",
            help="do not check how long ready jobs have waited (e.g. a liveness probe: a backlog is no reason to restart)",
        )
        parser.add_argument(
            "--no-worker-check",
            action="store_false",
            dest="workers",
            help="do not require a live worker per queue (e.g. checking before the workers start)",
        )
        parser.add_argument(
            "--strict", action="store_true", help="warnings (a backend that keeps nothing on disk) fail too"
        )
        parser.add_argument("--json", action="store_true", help="print a JSON object instead of lines")

    def handle(self, *args: Any, **opts: Any) -> None:
        backends = [_validate.backend(name) for name in opts["backends"] or [conf.get("DEFAULT_BACKEND")]]
        queues = _validate.queues(opts["queues"] or _validate.known_queues())
        _validate.positive_seconds("--max-age", opts["max_age"])
        report = health.check(
            dict.fromkeys(backends),
            queues,
            max_age=None if opts["no_age_check"] else opts["max_age"],
            workers=opts["workers"],
            strict=opts["strict"],
        )
        if opts["json"]:
            self.stdout.write(json.dumps(report.as_dict(), indent=2))
        else:
            for check in report.checks:
                self.stdout.write(check.line())
        if not report.healthy:  # the summary is the error's one line (on stderr), and the exit status 1
            raise CommandError(report.summary(), returncode=1)
        if not opts["json"]:
            self.stdout.write(report.summary())
