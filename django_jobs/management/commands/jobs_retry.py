from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_jobs import operations


class Command(BaseCommand):
    help = "Re-dispatch failed or cancelled jobs (the admin's 'retry' action)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "ids", nargs="*", help="ids of failed or cancelled jobs (jobs_list --status failed shows them)"
        )
        parser.add_argument("--all-failed", action="store_true", help="every failed job")
        parser.add_argument("--queue", help="with --all-failed: only this queue")

    def handle(self, *args: Any, **opts: Any) -> None:
        if bool(opts["ids"]) == opts["all_failed"]:
            raise CommandError("give job ids or --all-failed (not both)")
        outcome = operations.retry_by_id(opts["ids"] or None, opts["queue"])
        for error in outcome.errors:
            self.stderr.write(error)
        for job_id in outcome.unknown:
            self.stderr.write(f"{job_id}: no such job")
        for job_id, status in outcome.not_retryable.items():
            self.stderr.write(f"{job_id}: not failed or cancelled (it is {status}); left alone")
        for note in outcome.notes:
            self.stdout.write(f"note: {note}")
        self.stdout.write(f"retried {outcome.retried} job(s)")
        if opts["ids"] and not outcome.retried:
            raise CommandError("none of the given jobs was retried")
