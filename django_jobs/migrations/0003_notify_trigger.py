"""PostgreSQL only: a statement trigger on ``django_jobs_job`` that sends ``NOTIFY django_jobs``
when jobs are inserted, so idle workers wake at once instead of at their next poll. The
notification is sent when the inserting transaction commits, never before."""

from typing import Any

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION django_jobs_notify() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('django_jobs', '');
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS django_jobs_notify ON django_jobs_job;
CREATE TRIGGER django_jobs_notify AFTER INSERT ON django_jobs_job
    FOR EACH STATEMENT EXECUTE FUNCTION django_jobs_notify();
"""
DROP = """
DROP TRIGGER IF EXISTS django_jobs_notify ON django_jobs_job;
DROP FUNCTION IF EXISTS django_jobs_notify();
"""


def create(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("django_jobs", "0002_attempt_history")]

    operations = [migrations.RunPython(create, drop, elidable=False)]
