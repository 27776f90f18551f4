from __future__ import annotations

import signal
import threading
from typing import Any, TextIO

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_jobs import signing
from django_jobs.pool import STOP_SIGNALS
from django_jobs.scheduler import POLL, Scheduler
from django_jobs.schedules import ScheduleError

from . import _validate

START_LINE = "django-jobs scheduler started"
STOP_LINE = "django-jobs scheduler stopped"


class Command(BaseCommand):
    help = "Dispatch the periodic jobs of JOBS['SCHEDULE'] when they fall due, until SIGTERM/SIGINT (or --once)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="one pass (dispatch what is due now), then exit")
        parser.add_argument(
            "--interval", type=float, default=POLL, help=f"seconds between passes at most (default {POLL:g})"
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        _validate.positive_seconds("--interval", opts["interval"])
        scheduler = build(opts["interval"], self.stdout, opts["verbosity"])
        announce(scheduler, self.stdout)
        if opts["once"]:
            scheduler.run_pass()
            stopped(scheduler, self.stdout)
            return
        stop = threading.Event()
        for signum in STOP_SIGNALS:
            signal.signal(signum, lambda *_: stop.set())
        serve(scheduler, self.stdout, stop)


def build(interval: float, out: TextIO, verbosity: int) -> Scheduler:
    """A scheduler of ``JOBS["SCHEDULE"]`` that prints a line per dispatch (verbosity >= 1);
    bad settings are a one-line ``CommandError``, before anything starts."""
    try:
        signing.signing_keys()
        return Scheduler(poll=interval, on_dispatch=(lambda d: _line(out, f"scheduled {d}")) if verbosity else None)
    except (ScheduleError, ImproperlyConfigured) as exc:
        raise CommandError(_validate.one_line(exc)) from exc


def announce(scheduler: Scheduler, out: TextIO) -> None:
    """The start line, then one line per entry: its schedule in words and its next run."""
    now = scheduler.clock()
    entries = scheduler.entries.values()
    count = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
    _line(out, f"{START_LINE}: {count}, a pass every {scheduler.poll:g}s at most")
    for entry in entries:
        when = f"next run {entry.next_tick(now).isoformat()}" if entry.enabled else "disabled"
        _line(out, f"  {entry.name}: {entry.describe()}, {when}")


def serve(scheduler: Scheduler, out: TextIO, stop: threading.Event) -> None:
    """Run ``scheduler`` until ``stop`` is set, then print the stop line."""
    scheduler.run(stop)
    stopped(scheduler, out)


def stopped(scheduler: Scheduler, out: TextIO) -> None:
    _line(out, f"{STOP_LINE}: {scheduler.dispatched} job(s) dispatched")


def _line(out: TextIO, text: str) -> None:
    out.write(text + "\n")
    out.flush()
