"""Argument checks shared by the commands: every bad value is a one-line ``CommandError``.

(The leading underscore keeps Django from listing this module as a command.)
"""

from __future__ import annotations

import math
import sys
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, CommandParser
from django.db import connections

from django_jobs import conf
from django_jobs.checks import did_you_mean


def add_target_arguments(parser: CommandParser, queues_help: str) -> None:
    """The positional QUEUE list and ``--backend`` that every command acting on queues takes."""
    parser.add_argument("queues", nargs="*", help=queues_help)
    parser.add_argument("--backend", help="backend name (default: DEFAULT_BACKEND)")


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def backend(name: str | None) -> str:
    """The backend ``name`` (``DEFAULT_BACKEND`` when ``None``), if it is configured and its
    ENGINE imports; checked before anything starts, so a typo never reaches a worker process."""
    from django_jobs.backends import backend_config, engine_class

    name = name or conf.get("DEFAULT_BACKEND")
    backends = conf.get("BACKENDS")
    if not isinstance(backends, dict) or name not in backends:
        known = ", ".join(map(str, backends)) if isinstance(backends, dict) else "none"
        hint = did_you_mean(name, backends) if isinstance(backends, dict) else None
        raise CommandError(f"unknown backend {name!r}{f' ({hint})' if hint else ''}: JOBS['BACKENDS'] has {known}")
    try:
        engine_class(backend_config(name).get("ENGINE", "database"))
    except (ImproperlyConfigured, ImportError) as exc:
        raise CommandError(one_line(f"backend {name!r}: {exc}")) from exc
    return name


def known_queues() -> list[str]:
    try:
        return conf.queues()
    except ImproperlyConfigured as exc:
        raise CommandError(one_line(exc)) from exc


def queues(names: list[str]) -> list[str]:
    """``names``, refused (CommandError) if one is not in ``QUEUES``."""
    known = known_queues()
    unknown = [q for q in names if q not in known]
    if unknown:
        hints = [f"{q!r}: {hint}" for q in unknown if (hint := did_you_mean(q, known))]
        raise CommandError(
            f"unknown queue(s) {', '.join(unknown)}: add them to JOBS['QUEUES']"
            + (f" ({'; '.join(hints)})" if hints else "")
        )
    return names


def at_least_one(option: str, value: Any) -> None:
    """``--max``, ``--concurrency``: None (not given) or an integer >= 1."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise CommandError(f"{option} must be at least 1, not {value!r}")


def positive_seconds(option: str, value: Any) -> None:
    """``--sleep``, ``--interval``, ``--max-time``: None (not given) or a finite number > 0.
    Zero or a negative value would make a loop spin without waiting."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise CommandError(f"{option} must be a positive number of seconds, not {value!r}")


def migrated(name: str) -> None:
    """Refuse to start a worker on a database that lacks django-jobs' migrations: every claim or
    settle would fail, and the worker would take it for an outage and retry without end. A
    database that cannot be reached now is left to the worker, which waits for it."""
    from importlib.resources import files

    from django.db import DEFAULT_DB_ALIAS, DatabaseError, router

    from django_jobs.backends import backend_config, engine_class
    from django_jobs.models import Job

    found = files("django_jobs") / "migrations"
    known = {entry.name[:-3] for entry in found.iterdir() if entry.name[:4].isdigit() and entry.name.endswith(".py")}
    aliases = {router.db_for_write(Job)}
    config = backend_config(name)  # not built here: a backend that fails to build fails in its worker
    engine = engine_class(config.get("ENGINE", "database"))
    # A subclass of DatabaseBackend has imported its module: a broker's worker never does.
    database = sys.modules.get("django_jobs.backends.database")
    if database is not None and issubclass(engine, database.DatabaseBackend):
        aliases.add((config.get("OPTIONS") or {}).get("DATABASE", DEFAULT_DB_ALIAS))
    for alias in sorted(aliases):
        if alias not in connections.settings:
            raise CommandError(f"backend {name!r} uses database {alias!r}, which is not in DATABASES")
        try:
            applied = _recorded(alias)
        except DatabaseError:
            continue  # unreachable (no django_migrations table yet is reported as missing below)
        missing = sorted(known - applied)
        if missing:
            raise CommandError(
                f"database {alias!r} lacks django-jobs' migrations {', '.join(missing)}: run `manage.py migrate`"
            )


def _recorded(alias: str) -> set[str]:
    """The names of django-jobs' migrations recorded as applied on database ``alias``: one
    query on a connection outside a transaction. Django's recorder answers when that query
    fails on a live connection (no ``django_migrations`` table: none applied) or a transaction
    is open (a failed statement would spoil it); it first asks whether its table exists, a
    query more. ``DatabaseError`` when the database cannot be reached."""
    from django.db import DatabaseError
    from django.db.migrations.recorder import MigrationRecorder

    connection = connections[alias]
    if not connection.in_atomic_block:
        table = connection.ops.quote_name(MigrationRecorder.Migration._meta.db_table)
        try:
            with connection.cursor() as cursor:
                cursor.execute(f"SELECT name FROM {table} WHERE app = %s", ["django_jobs"])
                return {name for (name,) in cursor.fetchall()}
        except DatabaseError:
            if connection.connection is None:
                raise  # never connected: unreachable
    recorder = MigrationRecorder(connection)
    return {migration for app, migration in recorder.applied_migrations() if app == "django_jobs"}
