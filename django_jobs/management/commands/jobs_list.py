from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.core.serializers.json import DjangoJSONEncoder

from django_jobs import operations
from django_jobs.models import JobStatus

from . import _validate

ERROR_CHARS = 60


class Command(BaseCommand):
    help = "List jobs (newest change first): find failed jobs and their errors without the admin."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--status", choices=JobStatus.values, help="only jobs in this status")
        parser.add_argument("--queue", help="only jobs of this queue")
        parser.add_argument("--backend", help="only jobs dispatched to this backend (a JOBS['BACKENDS'] name)")
        parser.add_argument("--limit", type=int, default=20, help="at most N jobs (default 20)")
        parser.add_argument("--json", action="store_true", help="JSON: every listed field and the whole last error")

    def handle(self, *args: Any, **opts: Any) -> None:
        _validate.at_least_one("--limit", opts["limit"])
        backend = _validate.backend(opts["backend"]) if opts["backend"] else None
        try:
            rows = operations.list_jobs(opts["status"], opts["queue"], backend, opts["limit"])
        except Exception as exc:  # the database is unreachable or not migrated
            raise CommandError(f"could not read the jobs: {_validate.one_line(exc)}") from exc
        if opts["json"]:
            self.stdout.write(json.dumps(rows, indent=2, cls=DjangoJSONEncoder))
            return
        if not rows:
            self.stdout.write("no jobs")
            return
        self.stdout.write(
            f"{'id':<32}  {'status':<11}  {'queue':<12}  {'runs':>7}  {'changed (UTC)':<19}  job / last error"
        )
        for row in rows:
            runs = f"{row['attempts']}/{row['max_retries'] + 1}"
            changed = row["updated_at"].strftime("%Y-%m-%d %H:%M:%S")
            error = (row["last_error"] or "").partition("\n")[0]
            error = error if len(error) <= ERROR_CHARS else error[: ERROR_CHARS - 1] + "…"
            what = row["name"] or row["handler"]
            asked = operations.running_abort(row["status"], row["abort_requested"], row["abort_requested_at"])
            self.stdout.write(
                f"{row['id']:<32}  {row['status']:<11}  {row['queue']:<12}  {runs:>7}  {changed:<19}  {what}"
                + (f"  abort {operations.requested_text(asked)}" if asked else "")
                + (f"  {error}" if error else "")
            )
