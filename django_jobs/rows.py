"""Raw SQL helpers for the hot writes (a dispatch, an attempt-history row), through Django's
connection: the ORM's compiler costs more than these statements themselves."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from django.db import models

T = TypeVar("T")

# The most ids one statement lists (``id IN (...)``): a longer list is sent in chunks, so no
# statement's parameters grow with a flow's size (SQLite may take as few as 999 of them, and
# PostgreSQL's protocol, which server-side binding obeys, 65,535).
IDS_PER_STATEMENT = 500
# The most rows one INSERT of :func:`insert_many` writes on PostgreSQL.
ROWS_PER_STATEMENT = 1000

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
        cursor.execute(sql, _prepared(fields, values, connection))


def insert_many(connection: Any, model: type[models.Model], values: Sequence[dict[str, Any]]) -> None:
    """INSERT rows of ``model``, each from a dict as :func:`insert` takes it (all with the same
    attribute names), with a fixed number of parameters per statement whatever their number:
    on PostgreSQL one array per column (``UNNEST``), :data:`ROWS_PER_STATEMENT` rows at a
    time; elsewhere the one-row INSERT run for each (the driver batches it: MySQL's into
    multi-row INSERTs, SQLite's in one call)."""
    if not values:
        return
    fields = [f for f in model._meta.concrete_fields if f.attname in values[0]]
    quote = connection.ops.quote_name
    head = f"INSERT INTO {quote(model._meta.db_table)} ({', '.join(quote(f.column) for f in fields)})"
    with connection.cursor() as cursor:
        if connection.vendor != "postgresql":
            row = f"({', '.join(['%s'] * len(fields))})"
            cursor.executemany(f"{head} VALUES {row}", [_prepared(fields, one, connection) for one in values])
            return
        # The types without their length (varchar[], not varchar(64)[]), as Django's bulk_create.
        arrays = ", ".join(f"(%s)::{f.db_type(connection).split('(')[0]}[]" for f in fields)
        for batch in chunked(values, ROWS_PER_STATEMENT):
            columns = zip(*(_prepared(fields, one, connection) for one in batch), strict=True)
            cursor.execute(f"{head} SELECT * FROM UNNEST({arrays})", [list(column) for column in columns])


def _prepared(fields: list[Any], values: dict[str, Any], connection: Any) -> list[Any]:
    """A row's values as its fields prepare them for ``connection``."""
    return [f.get_db_prep_save(values[f.attname], connection) for f in fields]


def chunked(values: Sequence[T], size: int = IDS_PER_STATEMENT) -> Iterator[Sequence[T]]:
    """``values`` in consecutive slices of at most ``size``, in order."""
    for start in range(0, len(values), size):
        yield values[start : start + size]


# (database alias, model, attribute names) -> the INSERT statement and its fields, in order.
_INSERTS: dict[tuple[str, str, tuple[str, ...]], tuple[str, list[Any]]] = {}
