"""Raw SQL helpers for the hot writes (a dispatch, an attempt-history row), through Django's
connection: the ORM's compiler costs more than these statements themselves."""

from __future__ import annotations

from typing import Any

from django.db import models

# Appended to a statement sent in autocommit on PostgreSQL (one simple-protocol query, so one
# round trip): that statement's implicit transaction commits without waiting for the WAL flush.
ASYNC_COMMIT = "; SET LOCAL synchronous_commit = off"


def simple_protocol(connection: Any) -> bool:
    """PostgreSQL with client-side binding: one query may carry several statements (and so a
    ``PREPARE``/``EXECUTE`` or ``ASYNC_COMMIT`` rides along in the same round trip)."""
    return connection.vendor == "postgresql" and not connection.settings_dict.get("OPTIONS", {}).get(
        "server_side_binding"
    )


def commits_async(connection: Any) -> bool:
    """Can ``ASYNC_COMMIT`` ride on a statement sent now? :func:`simple_protocol`, in autocommit
    (never inside the caller's transaction)."""
    return simple_protocol(connection) and not connection.in_atomic_block


def insert(connection: Any, model: type[models.Model], values: dict[str, Any], *, async_commit: bool = False) -> None:
    """INSERT one row of ``model`` from ``values`` (by attribute name; every concrete field but
    an auto primary key), prepared by each field as the ORM would. ``async_commit``: without
    waiting for the disk where :func:`commits_async` allows it."""
    key = (connection.alias, model._meta.label, tuple(values))
    if key not in _INSERTS:  # worked out once: a dispatch and a history row each send one
        quote = connection.ops.quote_name
        fields = [f for f in model._meta.concrete_fields if f.attname in values]
        columns = ", ".join(quote(f.column) for f in fields)
        placeholders = ", ".join(["%s"] * len(fields))
        _INSERTS[key] = (f"INSERT INTO {quote(model._meta.db_table)} ({columns}) VALUES ({placeholders})", fields)
    sql, fields = _INSERTS[key]
    if async_commit and commits_async(connection):
        sql += ASYNC_COMMIT
    with connection.cursor() as cursor:
        cursor.execute(sql, [f.get_db_prep_save(values[f.attname], connection) for f in fields])


# (database alias, model, attribute names) -> the INSERT statement and its fields, in order.
_INSERTS: dict[tuple[str, str, tuple[str, ...]], tuple[str, list[Any]]] = {}
