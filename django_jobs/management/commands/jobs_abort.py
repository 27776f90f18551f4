from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_jobs import operations


class Command(BaseCommand):
    help = "Abort jobs: cancel waiting ones, stop running ones (the admin's 'abort' action)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("ids", nargs="+", help="ids of pending or running jobs")
        parser.add_argument("--by", default="command", help="who asks, recorded with the attempt (default: command)")

    def handle(self, *args: Any, **opts: Any) -> None:
        try:
            outcome = operations.abort_jobs(opts["ids"], opts["by"])
        except ValueError as exc:  # a --by that names nobody, or too long a name
            raise CommandError(str(exc)) from exc
        for error in outcome.errors:
            self.stderr.write(error)
        for job_id in outcome.unknown:
            self.stderr.write(f"{job_id}: no such job")
        for job_id, status in outcome.finished.items():
            self.stderr.write(f"{job_id}: already finished (it is {status}); left alone")
        for name in outcome.unsupported:
            self.stdout.write(f"note: backend {name!r} cannot abort a job by its id")
        for job_id in outcome.cancelled:
            self.stdout.write(f"{job_id}: cancelled")
        within = operations.abort_within()
        for job_id in outcome.asked:
            self.stdout.write(f"{job_id}: running; asked to abort: its worker stops it within about {within} s")
        for job_id, asked in outcome.already.items():
            self.stdout.write(f"{job_id}: running; abort already {operations.requested_text(asked)}; left as it is")
        already = f", {len(outcome.already)} already asked" if outcome.already else ""
        self.stdout.write(f"cancelled {len(outcome.cancelled)}, asked {len(outcome.asked)} to abort{already}")
        if not outcome.stopped and not outcome.already:
            raise CommandError("none of the given jobs was aborted or cancelled")
