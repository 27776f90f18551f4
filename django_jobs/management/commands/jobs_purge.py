from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_jobs import operations


class Command(BaseCommand):
    help = "Delete completed, failed or cancelled job rows."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--status",
            required=True,
            choices=["completed", "failed", "cancelled"],
            help="which finished jobs to delete",
        )
        parser.add_argument("--queue", help="only jobs of this queue")
        parser.add_argument("--before", help="only jobs finished longer ago than AGE (3600, 15m, 12h, 7d, 2w)")
        parser.add_argument("--dry-run", action="store_true", help="count, do not delete")

    def handle(self, *args: Any, **opts: Any) -> None:
        try:
            before = operations.parse_age(opts["before"]) if opts["before"] else None
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        count = operations.purge(opts["status"], opts["queue"], before, opts["dry_run"])
        verb = "would delete" if opts["dry_run"] else "deleted"
        self.stdout.write(f"{verb} {count} {opts['status']} job(s)")
