from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_jobs import operations

from . import _validate

# waiting: held until their parents finish ("-" for a backend without dependencies).
COLUMNS = ("backend", "queue", "pending", "delayed", "in_progress", "failed", "waiting")


class Command(BaseCommand):
    help = "Pending, delayed, in-progress, failed and waiting jobs per backend and queue."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--backend", action="append", help="only this backend (repeatable)")
        parser.add_argument("--json", action="store_true", help="print JSON, one object per backend and queue")

    def handle(self, *args: Any, **opts: Any) -> None:
        names = [_validate.backend(name) for name in opts["backend"]] if opts["backend"] else None
        rows = operations.stats(names)
        if opts["json"]:
            self.stdout.write(json.dumps(rows, indent=2))
            return
        self.stdout.write("".join(f"{c:<14}" for c in COLUMNS).rstrip())
        for row in rows:
            if "error" in row:
                self.stdout.write(f"{row['backend']:<14}{row['queue']:<14}unavailable: {row['error']}")
            else:
                self.stdout.write("".join(f"{row.get(c, '-')!s:<14}" for c in COLUMNS).rstrip())
