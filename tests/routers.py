"""Database routers for tests (importable before Django is set up: no model imports)."""

from __future__ import annotations

from typing import Any


class SchedulesOnPostgres:
    """The schedule tables (``Schedule``, ``ScheduleTick``) on PostgreSQL, where the test settings
    keep them in the SQLite ``default``: schedulers claim ticks on a server that takes concurrent
    writers."""

    alias = "postgres"

    def db_for_write(self, model: type[Any], **hints: Any) -> str | None:
        return self.alias if model._meta.model_name in ("schedule", "scheduletick") else None

    db_for_read = db_for_write


class SchedulesThroughPgBouncer(SchedulesOnPostgres):
    """The schedule tables on the same PostgreSQL database, through PgBouncer in transaction mode."""

    alias = "pgbouncer"
