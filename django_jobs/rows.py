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
    an auto primary key), prepared by each field as the ORM would: :func:`insert_many` of one.
    ``fixed``: more columns, written into the statement as constants (see :func:`literal`).
    ``async_commit``: without waiting for the disk where :func:`commits_async` allows it."""
    insert_many(connection, model, [values], async_commit=async_commit, fixed=fixed)


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
    text (:class:`_Insert`); elsewhere the one-row INSERT run for each (the driver batches
    it: MySQL's into multi-row INSERTs, SQLite's in one call). ``async_commit``: as
    :func:`insert` takes it."""
    if not values:
        return
    statement = _Insert.of(connection, model, tuple(values[0]), fixed)
    with connection.cursor() as cursor:
        if not statement.as_json:
            prepared = [statement.parameters(one, connection) for one in values]
            if len(prepared) == 1:
                cursor.execute(statement.sql, prepared[0])
            else:
                cursor.executemany(statement.sql, prepared)
            return
        tail = ASYNC_COMMIT if async_commit and commits_async(connection) else ""
        for batch in chunked(values, ROWS_PER_STATEMENT):
            for text in _json_texts(statement.json_rows(batch, connection)):
                cursor.execute(statement.sql + tail, [text])


class _Insert:
    """The INSERT of rows of one model with the same columns, worked out once per database,
    model, columns and ``fixed`` constants (a dispatch and a history row each send one). On
    PostgreSQL the rows go as one JSON array of arrays, its one parameter (:func:`_json_texts`),
    read back with a cast per column: the driver quotes one text, where it quoted each value
    in Python; a JSON ``null`` is ``NULL``. Elsewhere, one parameter per column."""

    def __init__(self, connection: Any, model: type[models.Model], names: tuple[str, ...], fixed: Mapping[str, Any]):
        fields = [f for f in model._meta.concrete_fields if f.attname in names]
        quote = connection.ops.quote_name
        columns = [quote(f.column) for f in fields] + [quote(model._meta.get_field(name).column) for name in fixed]
        head = f"INSERT INTO {quote(model._meta.db_table)} ({', '.join(columns)})"
        literals = [literal(value) for value in fixed.values()]
        # Each field with the Python type whose values it stores unchanged, and whether it is JSON.
        self.columns = [(f, _plain_type(f), isinstance(f, models.JSONField)) for f in fields]
        self.as_json = connection.vendor == "postgresql"
        if self.as_json:
            # The type without its length (varchar, not varchar(64)), as Django's bulk_create.
            selected = [
                f"NULLIF(r->{index}, 'null')" if as_json else f"(r->>{index})::{f.db_type(connection).split('(')[0]}"
                for index, (f, _, as_json) in enumerate(self.columns)
            ]
            self.sql = f"{head} SELECT {', '.join(selected + literals)} FROM jsonb_array_elements(%s::jsonb) AS r"
        else:
            self.sql = f"{head} VALUES ({', '.join(['%s'] * len(fields) + literals)})"

    @classmethod
    def of(
        cls, connection: Any, model: type[models.Model], names: tuple[str, ...], fixed: Mapping[str, Any]
    ) -> _Insert:
        key = (connection.alias, connection.vendor, model._meta.label, names, tuple(fixed.items()))
        if key not in _INSERTS:
            _INSERTS[key] = cls(connection, model, names, fixed)
        return _INSERTS[key]

    def parameters(self, values: Mapping[str, Any], connection: Any) -> list[Any]:
        """One row's parameters, each prepared by its field (:func:`_prepare`)."""
        return [_prepare(f, kind, values[f.attname], connection) for f, kind, _ in self.columns]

    def json_rows(self, batch: Sequence[Mapping[str, Any]], connection: Any) -> list[list[Any]]:
        """The rows of ``batch`` as the JSON text holds them: a date as ISO 8601 text, a JSON
        column's value as JSON, a plain value as it is."""
        return [
            [
                value
                if (value := one[f.attname]) is None or as_json or type(value) is kind
                else _json_value(f, value, connection)
                for f, kind, as_json in self.columns
            ]
            for one in batch
        ]


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
    """``value`` of ``field`` prepared as the ORM would, as :meth:`_Insert.json_rows` writes it."""
    if type(value) is datetime and value.utcoffset() is not None and isinstance(field, models.DateTimeField):
        return value.isoformat()  # PostgreSQL takes an aware datetime as it is, whatever USE_TZ
    value = field.get_db_prep_save(value, connection)
    return value.isoformat() if isinstance(value, datetime) else value


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
# The rows of a PostgreSQL INSERT (:class:`_Insert`): a float as the job table's
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


# (database alias, vendor, model, attribute names, fixed columns) -> its INSERT.
_INSERTS: dict[tuple[str, str, str, tuple[str, ...], tuple[tuple[str, Any], ...]], _Insert] = {}
