from __future__ import annotations

import signal
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_jobs.reaper import Reaper

from . import _validate


class Command(BaseCommand):
    help = "Recover the leases of crashed or stalled workers (each counts as a failed run)."

    def add_arguments(self, parser: CommandParser) -> None:
        _validate.add_target_arguments(parser, "queues to reap (default: every queue)")
        parser.add_argument("--loop", action="store_true", help="keep reaping until SIGTERM/SIGINT")
        parser.add_argument("--interval", type=float, default=30.0, help="seconds between passes with --loop")

    def handle(self, *args: Any, **opts: Any) -> None:
        _validate.positive_seconds("--interval", opts["interval"])
        reaper = Reaper(_validate.backend(opts["backend"]), _validate.queues(opts["queues"]))
        if not opts["loop"]:
            self.stdout.write(f"reaped {reaper.reap_once()} expired lease(s)")
            return
        stop = []
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.append(True))
        self.stdout.write(f"reaping every {opts['interval']:g}s")
        reaper.run(opts["interval"], should_stop=lambda: bool(stop))
