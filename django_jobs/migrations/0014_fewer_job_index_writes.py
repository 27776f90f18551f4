"""PostgreSQL only: fewer index entries written by each claim, settle and dispatch.

Every status change of a ``Job`` row is a new row version with an entry in each index whose
condition it meets. Two of those indexes served no query of the hot path:

- the ``varchar_pattern_ops`` copies Django adds beside the indexes of ``Job.id`` and
  ``JobAttempt.job_id`` (for ``LIKE 'prefix%'``; ids are only ever looked up whole): dropped;
- ``django_jobs_status_idx`` on ``(status, queue)``: kept for the statuses few rows have
  (``waiting``, ``failed``, ``cancelled``: the admin's lists, the dashboard, the sweep). Pending
  and in-progress rows are found by the claim and lease indexes, and completed rows, most of
  the table, by a scan in any case.

Other databases keep Django's indexes: MariaDB and MySQL have no partial indexes (the claim
reads ``django_jobs_status_idx`` there).
"""

from typing import Any

from django.db import migrations

JOB, ATTEMPT = "django_jobs_job", "django_jobs_jobattempt"
STATUS_INDEX = "django_jobs_status_idx"
# The statuses django_jobs_status_idx keeps on PostgreSQL.
RARE = "('waiting', 'failed', 'cancelled')"
# The pattern-ops indexes: of (table, column).
PATTERN_INDEXED = ((JOB, "id"), (ATTEMPT, "job_id"))


def _pattern_indexes(cursor: Any, table: str, column: str) -> list[str]:
    """The names of the one-column ``varchar_pattern_ops`` indexes of ``table.column``."""
    cursor.execute(
        "SELECT i.relname FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
        "JOIN pg_class t ON t.oid = x.indrelid JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = x.indkey[0] "
        "JOIN pg_opclass o ON o.oid = x.indclass[0] "
        "WHERE t.relname = %s AND a.attname = %s AND x.indnatts = 1 AND o.opcname = 'varchar_pattern_ops' "
        "AND t.relnamespace = to_regnamespace(current_schema())::oid",
        [table, column],
    )
    return [row[0] for row in cursor.fetchall()]


def narrow(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    quote = schema_editor.quote_name
    with schema_editor.connection.cursor() as cursor:
        for table, column in PATTERN_INDEXED:
            for name in _pattern_indexes(cursor, table, column):
                schema_editor.execute(f"DROP INDEX {quote(name)}")
    schema_editor.execute(f"DROP INDEX IF EXISTS {quote(STATUS_INDEX)}")
    schema_editor.execute(f"CREATE INDEX {quote(STATUS_INDEX)} ON {JOB} (status, queue) WHERE status IN {RARE}")


def widen(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    quote = schema_editor.quote_name
    schema_editor.execute(f"DROP INDEX IF EXISTS {quote(STATUS_INDEX)}")
    schema_editor.execute(f"CREATE INDEX {quote(STATUS_INDEX)} ON {JOB} (status, queue)")
    for table, column in PATTERN_INDEXED:
        name = schema_editor._create_index_name(table, [column], suffix="_like")
        schema_editor.execute(f"CREATE INDEX {quote(name)} ON {table} ({column} varchar_pattern_ops)")


class Migration(migrations.Migration):
    dependencies = [("django_jobs", "0013_schedule_last_pass")]

    operations = [migrations.RunPython(narrow, widen, elidable=False)]
