"""Raw SQL helpers for the hot writes (a dispatch, an attempt-history row), through Django's
connection: the ORM's compiler costs more than these statements themselves. And the ids a
statement lists, bounded however many there are (:func:`matching`, :func:`chunked`)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from types import MappingProxyType
from typing import Any, TypeVar

from django.db import models

from .jsoncolumns import FloatKeepingEncoder

T = TypeVar("T")

# The most ids one statement lists (``id IN (...)``): a longer list is sent in chunks, so no
# statement's parameters grow with a flow's size (SQLite may take as few as 999 of them, and
# PostgreSQL's protocol, which server-side binding obeys, 65,535).
IDS_PER_STATEMENT = 500
# The most rows one INSERT of :func:`insert_many` writes on PostgreSQL.
ROWS_PER_STATEMENT = 1000
# The most characters of JSON one INSERT of :func:`insert_many` sends on PostgreSQL (its rows are
# one jsonb value, which holds at most 256 MB; a row of small numbers takes up to about five times
# its text there, and a character up to 4 bytes): more rows are split into several INSERTs.
JSON_CHARS_PER_STATEMENT = 32 * 1024 * 1024

# No columns (``fixed``'s default).
NOTHING: Mapping[str, Any] = MappingProxyType({})
# A str :func:`literal` writes as it is, quoted.
_WORD = re.compile(r"[A-Za-z0-9_]*")

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


def insert(
    connection: Any,
    model: type[models.Model],
    values: dict[str, Any],
    *,
    async_commit: bool = False,
    fixed: Mapping[str, Any] = NOTHING,
) -> None:
    """INSERT one row of ``model`` from ``values`` (by attribute name; every concrete field but
    an auto primary key), prepared by each field as the ORM would.
    ``fixed``: more columns, written into the statement as constants (see :func:`literal`).
    ``async_commit``: without waiting for the disk where :func:`commits_async` allows it."""
    key = (connection.alias, model._meta.label, tuple(values), tuple(fixed.items()))
    if key not in _INSERTS:  # worked out once: a dispatch and a history row each send one
        fields = [f for f in model._meta.concrete_fields if f.attname in values]
        row = ", ".join(["%s"] * len(fields) + [literal(value) for value in fixed.values()])
        _INSERTS[key] = (f"{_head(connection, model, fields, fixed)} VALUES ({row})", _typed(fields))
    sql, columns = _INSERTS[key]
    if async_commit and commits_async(connection):
        sql += ASYNC_COMMIT
    with connection.cursor() as cursor:
        cursor.execute(sql, [_prepare(f, kind, values[f.attname], connection) for f, kind in columns])


def insert_many(
    connection: Any,
    model: type[models.Model],
    values: Sequence[dict[str, Any]],
    *,
    async_commit: bool = False,
    fixed: Mapping[str, Any] = NOTHING,
) -> None:
    """INSERT rows of ``model``, each from a dict as :func:`insert` takes it (all with the same
    attribute names, and the same ``fixed``), with a bounded number of parameters per statement
    whatever their number: on PostgreSQL :data:`ROWS_PER_STATEMENT` rows at a time, in one JSON
    text (:func:`_json_insert`); elsewhere the one-row INSERT run for each (the driver batches
    it: MySQL's into multi-row INSERTs, SQLite's in one call). ``async_commit``: as
    :func:`insert` takes it."""
    if not values:
        return
    fields = [f for f in model._meta.concrete_fields if f.attname in values[0]]
    head = _head(connection, model, fields, fixed)
    literals = [literal(value) for value in fixed.values()]
    with connection.cursor() as cursor:
        if connection.vendor != "postgresql":
            row = f"({', '.join(['%s'] * len(fields) + literals)})"
            columns = _typed(fields)
            rows = [[_prepare(f, kind, one[f.attname], connection) for f, kind in columns] for one in values]
            cursor.executemany(f"{head} VALUES {row}", rows)
            return
        tail = ASYNC_COMMIT if async_commit and commits_async(connection) else ""
        for batch in chunked(values, ROWS_PER_STATEMENT):
            sql, rows = _json_insert(head, fields, literals, batch, connection)
            for text in _json_texts(rows):
                cursor.execute(sql + tail, [text])


def _head(connection: Any, model: type[models.Model], fields: list[Any], fixed: Mapping[str, Any]) -> str:
    """``INSERT INTO table (columns)``: those of ``fields``, then those of ``fixed``."""
    quote = connection.ops.quote_name
    columns = [quote(f.column) for f in fields] + [quote(model._meta.get_field(name).column) for name in fixed]
    return f"INSERT INTO {quote(model._meta.db_table)} ({', '.join(columns)})"


def literal(value: Any) -> str:
    """``value`` as an SQL constant every database reads alike: ``NULL``, an int, or a str of
    letters, digits and ``_`` (quoted). Anything else is a parameter's business: ValueError."""
    if value is None:
        return "NULL"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(int(value))
    if isinstance(value, str) and _WORD.fullmatch(value):
        return f"'{value}'"
    raise ValueError(f"{value!r} is not written as an SQL constant; pass it as a parameter")


def _json_insert(
    head: str, fields: list[Any], literals: list[str], batch: Sequence[dict[str, Any]], connection: Any
) -> tuple[str, list[list[Any]]]:
    """PostgreSQL's INSERT of rows sent as one JSON array of arrays (its one parameter, see
    :func:`_json_texts`), read back with a cast per column, then the ``literals``; and the rows
    of ``batch``, each value prepared by its field (a date as ISO 8601 text, a JSON column's
    value as JSON). The driver quotes one text, where it quoted every element of an array per
    column in Python; a JSON ``null`` is ``NULL``."""
    selected: list[str] = []
    columns: list[tuple[Any, type | None, bool]] = []  # a value goes as it is when None, of this type, or JSON
    for index, (f, kind) in enumerate(_typed(fields)):
        as_json = isinstance(f, models.JSONField)
        # The type without its length (varchar, not varchar(64)), as Django's bulk_create.
        selected.append(
            f"NULLIF(r->{index}, 'null')" if as_json else f"(r->>{index})::{f.db_type(connection).split('(')[0]}"
        )
        columns.append((f, kind, as_json))
    rows = [
        [
            value
            if (value := one[f.attname]) is None or as_json or type(value) is kind
            else _json_value(f, value, connection)
            for f, kind, as_json in columns
        ]
        for one in batch
    ]
    sql = f"{head} SELECT {', '.join(selected + literals)} FROM jsonb_array_elements(%s::jsonb) AS r"
    return sql, rows


def _json_texts(rows: list[list[Any]]) -> Iterator[str]:
    """``rows`` as JSON texts of at most :data:`JSON_CHARS_PER_STATEMENT` characters each (a
    row longer than that alone), written as :class:`~django_jobs.jsoncolumns.FloatKeepingEncoder`
    writes the job table's JSON columns: halved until they fit."""
    text = _ROWS.encode(rows)
    if len(text) <= JSON_CHARS_PER_STATEMENT or len(rows) == 1:
        yield text
        return
    half = len(rows) // 2
    yield from _json_texts(rows[:half])
    yield from _json_texts(rows[half:])


def _json_value(field: Any, value: Any, connection: Any) -> Any:
    """``value`` of ``field`` prepared as the ORM would, as :func:`_json_insert` writes it."""
    if type(value) is datetime and value.utcoffset() is not None and isinstance(field, models.DateTimeField):
        return value.isoformat()  # PostgreSQL takes an aware datetime as it is, whatever USE_TZ
    value = field.get_db_prep_save(value, connection)
    return value.isoformat() if isinstance(value, datetime) else value


def _typed(fields: list[Any]) -> list[tuple[Any, type | None]]:
    """Each field with its plain type (:func:`_plain_type`), looked up once per statement."""
    return [(f, _plain_type(f)) for f in fields]


def _prepare(field: Any, kind: type | None, value: Any, connection: Any) -> Any:
    """``value`` as ``field`` prepares it for ``connection``: ``None``, or a value of the very
    type the field stores as it is (a str of a text field, an int of an integer field, ...),
    needs no field to tell so."""
    if value is None or type(value) is kind:
        return value
    return field.get_db_prep_save(value, connection)


def _plain_type(field: Any) -> type | None:
    """The Python type whose values ``field`` stores unchanged (``None``: prepare every value: a
    JSON field encodes even a str, a datetime field makes a naive value aware)."""
    if field not in _PLAIN_TYPES:
        _PLAIN_TYPES[field] = next((kind for fields, kind in _STORED_AS_IS if isinstance(field, fields)), None)
    return _PLAIN_TYPES[field]


_STORED_AS_IS: tuple[tuple[tuple[type, ...], type], ...] = (
    ((models.CharField, models.TextField), str),
    ((models.IntegerField,), int),
    ((models.BooleanField,), bool),
    ((models.FloatField,), float),
)
# The rows of a PostgreSQL INSERT of several (:func:`_json_insert`): a float as the job table's
# JSON columns keep it, so as every float column does.
_ROWS = FloatKeepingEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
# Each field's plain type, worked out once.
_PLAIN_TYPES: dict[Any, type | None] = {}


def matching(connection: Any, column: str, values: Sequence[str]) -> Iterator[tuple[str, list[Any]]]:
    """``column`` among ``values``, as SQL conditions and their parameters, one per statement to
    send: on PostgreSQL one array parameter (``= ANY``) whatever their number, so one statement
    (the planner looks the rows up once even when the table's statistics are stale); elsewhere
    an ``IN`` list of at most :data:`IDS_PER_STATEMENT`. Nothing for no values."""
    if not values:
        return
    if connection.vendor == "postgresql":
        yield f"{column} = ANY(%s)", [list(values)]
        return
    for chunk in chunked(values):
        yield f"{column} IN ({', '.join(['%s'] * len(chunk))})", list(chunk)


def chunked(values: Sequence[T], size: int = IDS_PER_STATEMENT) -> Iterator[Sequence[T]]:
    """``values`` in consecutive slices of at most ``size``, in order."""
    for start in range(0, len(values), size):
        yield values[start : start + size]


# (database alias, model, attribute names, fixed columns) -> the INSERT statement and its
# fields, in order.
_INSERTS: dict[
    tuple[str, str, tuple[str, ...], tuple[tuple[str, Any], ...]], tuple[str, list[tuple[Any, type | None]]]
] = {}
