"""The database backend: ``Job`` rows claimed with one statement, settled with one more.

PostgreSQL claims with ``UPDATE … WHERE id = (SELECT … FOR UPDATE SKIP LOCKED) RETURNING``;
SQLite runs the same statement without the locking clause, which is race-free because SQLite
serialises writers. Other databases claim inside a transaction with the ORM's
``select_for_update(skip_locked=True)``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, cast
from weakref import WeakKeyDictionary

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, InterfaceError, OperationalError, ProgrammingError, connections, transaction
from django.db.models import NOT_PROVIDED, Count, Min, Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from .. import conf, rows
from ..envelope import Envelope, dumps_payload
from ..exceptions import (
    AbortRequested,
    BackendUnavailable,
    InvalidPayload,
    JobAborted,
    JobsError,
    LeaseLost,
    WorkerLost,
    summary,
)
from ..models import ENVELOPE_COLUMNS, ClaimedAhead, Dependency, Job, JobStatus, envelope_columns, envelope_of
from ..retry import after_lost_run
from . import db_settle
from .base import NO_RESULT, Lease, LimitedBackend, Requeue, Requeued
from .db_listen import Listener

if TYPE_CHECKING:
    from .db_limits import DatabaseLimits

# ``dependencies`` (and the flows code it imports) is imported where a job has parents or
# dependents, a failure or a cancel: a worker of plain jobs never loads it before its first job.

TABLE = Job._meta.db_table
# Whether the dependents' sweep has anything to look at: an open edge (its partial index) or a
# waiting job (the status index).
_ANY_DEPENDENTS = (
    f"SELECT EXISTS (SELECT 1 FROM {Dependency._meta.db_table} WHERE outcome IS NULL) "
    f"OR EXISTS (SELECT 1 FROM {TABLE} WHERE status = %s)"
)
# The statements prepared on each PostgreSQL connection (the driver's connection -> names).
_PREPARED: WeakKeyDictionary[Any, set[str]] = WeakKeyDictionary()
UNKNOWN_PREPARED_STATEMENT = "26000"  # SQLSTATE invalid_sql_statement_name
DUPLICATE_PREPARED_STATEMENT = "42P05"  # SQLSTATE duplicate_prepared_statement
QUERY_CANCELED = "57014"  # SQLSTATE query_canceled: statement_timeout, a cancel
LOCK_NOT_AVAILABLE = "55P03"  # SQLSTATE lock_not_available: lock_timeout
READ_ONLY_SQL_TRANSACTION = "25006"  # SQLSTATE read_only_sql_transaction: a standby, a read-only transaction
logger = logging.getLogger("django_jobs.backends.database")
_RESULT = Job._meta.get_field("result")


# Every settle: the row is no longer leased, nor claimed ahead.
RELEASED = "owner_token = NULL, leased_until = NULL, claimed_ahead = 0"
# The fence of every fast ack: a row some job waits for is acked on the transactional path,
# which resolves its edges in the same transaction (see ``_finish``).
NO_DEPENDENTS = "NOT has_dependents"
# The columns of a new row that its job sets (``DatabaseBackend.columns``).
_PER_JOB = ("id", *ENVELOPE_COLUMNS, "attempts", "available_at", "created_at", "updated_at", "backend")
# The others: every new row of a dispatch holds the model's defaults there, written into its
# INSERT as constants (fewer parameters to adapt and send); ``has_dependents`` has a database
# default, and a job with parents is inserted by ``dependencies.enqueue`` with its own.
_FRESH = {
    field.attname: field.get_default()
    for field in Job._meta.concrete_fields
    if field.attname not in _PER_JOB and field.db_default is NOT_PROVIDED
}
# How much longer than the JSON a dispatch measured a row's JSON columns may come back: jsonb
# writes 5e-324 as 328 characters of decimal (with its ", " about 47 times "5e-324,"), and the
# columns' encoder writes 1e308 as 310 (52 times "1e+308,").
JSON_TEXT_GROWTH = 64
RETURNED = (
    "id, handler, {payload}, {options}, signature, name, attempts, max_retries, "
    "priority, available_at, timeout, idempotency_key"
)


def _dt(value: Any) -> datetime | None:
    """A datetime column from a raw cursor (SQLite hands back strings)."""
    if isinstance(value, str):
        value = parse_datetime(value)
    if value is not None and timezone.is_naive(value):
        value = timezone.make_aware(value, UTC)
    return cast("datetime | None", value)


def _row_fields(row: tuple[Any, ...], queue: str, limit: int) -> dict[str, Any]:
    """Envelope fields of a claimed row, treating every column as untrusted."""
    (
        job_id,
        handler,
        payload,
        options,
        signature,
        name,
        attempts,
        max_retries,
        priority,
        available_at,
        timeout,
        idempotency_key,
    ) = row
    try:
        payload, options = _row_json(payload, options, limit)
        data = {
            "id": job_id,
            "handler": handler,
            "payload": payload,
            "options": options,
            "signature": signature,
            "name": name,
            "attempts": attempts,
            "max_retries": max_retries,
            "priority": priority,
            "timeout": timeout,
            "idempotency_key": idempotency_key,
            "queue": queue,
        }
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidPayload(f"job {job_id!r} has an undecodable payload: {exc}") from exc
    data["available_at"] = _dt(available_at)
    return data


def _row_json(payload: str, options: str, limit: int) -> tuple[Any, Any]:
    """A row's payload and options, parsed, if their JSON fits ``limit`` as a dispatch measures
    it. The database hands a JSON column back as its own text, which may be far longer than what
    was dispatched (PostgreSQL's ``jsonb``: a space after each ``,`` and ``:``, every number in
    full decimal); text past ``limit`` is parsed, up to :data:`JSON_TEXT_GROWTH` times it, and
    measured again. ``InvalidPayload`` past the cap."""
    size = len(payload) + len(options)
    if size > limit * JSON_TEXT_GROWTH:
        raise InvalidPayload(f"row of {size} payload bytes exceeds the {limit}-byte cap")
    parsed = json.loads(payload), json.loads(options)
    if size > limit and sum(len(dumps_payload(value)) for value in parsed) > limit:
        raise InvalidPayload(f"row of {size} payload bytes exceeds the {limit}-byte cap")
    return parsed


def _new_lease() -> tuple[datetime, str, datetime]:
    """Now, a fresh owner token, and the lease's expiry."""
    now = timezone.now()
    return now, secrets.token_hex(16), now + timedelta(seconds=conf.get("LEASE_TIMEOUT"))


class DatabaseBackend(LimitedBackend):
    """Jobs as rows of ``django_jobs_job`` in the database ``OPTIONS["DATABASE"]``."""

    unavailable_errors = (OperationalError, InterfaceError)

    supports_priority = True
    supports_dependencies = True
    transactional = True
    audit_failures = False  # a failed job keeps its own row

    @classmethod
    def options_problem(cls, options: dict[str, Any]) -> str | None:
        """``LISTEN_DATABASE``, when given, must be a PostgreSQL alias of ``DATABASES``."""
        alias = options.get("DATABASE", DEFAULT_DB_ALIAS)
        listen = options.get("LISTEN_DATABASE", alias)
        if listen != alias and (listen not in connections or connections[listen].vendor != "postgresql"):
            return f"needs OPTIONS['LISTEN_DATABASE'] to name a PostgreSQL database of DATABASES, not {listen!r}"
        return None

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        super().__init__(name, options)
        self.alias = self.history_alias = options.get("DATABASE", DEFAULT_DB_ALIAS)
        # One statement (PostgreSQL) or one transaction (SQLite) acks a job and claims the next.
        # A batch is claimed with one statement, and its acks, recorded starts and requeues are
        # written with one more (``db_settle``). (The connection's vendor is known without connecting.)
        batched = connections[self.alias].vendor in ("postgresql", "sqlite")
        self.pipelines_ack_fetch = self.supports_prefetch = self.batches_requeues = batched
        # PostgreSQL: the worker's own statements (claims, settles, lease renewals) commit without
        # waiting for the WAL flush. Dispatches stay durable. A database crash may undo the
        # settles of its last moments; those jobs are then recovered as lost runs.
        self.async_commit = bool(options.get("ASYNC_COMMIT", True))
        # PostgreSQL: the ack-and-claim statement is prepared once per connection, so the server
        # plans it once (its planning costs about as much as running it). Off by itself after a
        # failed EXECUTE (a pooler in transaction mode, which loses prepared statements).
        self.prepare = bool(options.get("PREPARE", True))
        # PostgreSQL: idle workers LISTEN on this alias (a direct connection where DATABASE is
        # a pooler in transaction mode, which does not hold a LISTEN).
        problem = self.options_problem(options)
        if problem:
            raise ImproperlyConfigured(f"database backend {name!r} {problem}")
        self.listener = Listener(name, options.get("LISTEN_DATABASE", self.alias), self.alias)

    def dispatch_error(self, exc: Exception) -> JobsError | None:
        """PostgreSQL answered, and did not store the job, with some errors the driver raises as
        it raises a lost connection's. Class 54, *program limit exceeded* (a ``jsonb`` value past
        256 MB, one nested past ``max_stack_depth``): the job is refused, as a payload too large
        is. A statement cancelled (``statement_timeout``, ``lock_timeout``, a cancel) or a
        read-only server or transaction (a standby): ``BackendUnavailable``, saying so."""
        state = _sqlstate(exc)
        if state is None:
            return super().dispatch_error(exc)
        if state.startswith("54"):
            return InvalidPayload(f"{self.where()} refused the job: {summary(exc)}")
        if state in (QUERY_CANCELED, LOCK_NOT_AVAILABLE):
            return BackendUnavailable(f"{self.where()} did not store the job in time: {summary(exc)}")
        if state == READ_ONLY_SQL_TRANSACTION:
            return BackendUnavailable(f"{self.where()} is read-only here: {summary(exc)}")
        return super().dispatch_error(exc)

    @functools.cached_property
    def limits(self) -> DatabaseLimits:
        """The limits' code (``db_limits``), loaded at the first job that has a limit."""
        from .db_limits import DatabaseLimits

        return DatabaseLimits(self.alias)

    # -- helpers --

    @property
    def _conn(self) -> Any:
        return connections[self.alias]

    def _adapt(self, value: datetime) -> Any:
        return self._conn.ops.adapt_datetimefield_value(value)

    def _execute(
        self, sql: str, params: list[Any], *, every_row: bool = False, after_first: bool = False
    ) -> tuple[int, Any]:
        """Run ``sql``: the row count, and the first row (``every_row``: the list of rows) of
        its first statement (``after_first``: of its second, after a ``PREPARE``)."""
        with self._conn.cursor() as cursor:
            cursor.execute(sql, params)
            if after_first:
                cursor.nextset()
            if not cursor.description:
                return cursor.rowcount, [] if every_row else None
            return cursor.rowcount, (cursor.fetchall() if every_row else cursor.fetchone())

    def where(self) -> str:
        db = connections[self.alias].settings_dict
        vendor = connections[self.alias].vendor
        at = (
            db.get("NAME")
            if vendor == "sqlite"
            else f"{db.get('HOST') or 'localhost'}:{db.get('PORT') or 'default port'}"
        )
        return f"backend {self.name!r} (database {self.alias!r}: {vendor} at {at})"

    def _execute_queue(
        self, sql: str, params: list[Any], *, prepare: bool = False, every_row: bool = False, own: bool = False
    ) -> tuple[int, Any]:
        """A claim, settle or renewal: on PostgreSQL in autocommit, its implicit transaction
        commits asynchronously (``SET LOCAL`` after it, in the same simple-protocol query, so
        it is still one round trip; never inside the caller's transaction: ``own`` says the
        transaction open is the backend's own, which then commits asynchronously too).
        ``prepare``: run it as a statement prepared on this connection."""
        conn = self._conn
        if not rows.simple_protocol(conn):
            return self._execute(sql, params, every_row=every_row)
        suffix = rows.ASYNC_COMMIT if self.async_commit and (own or not conn.in_atomic_block) else ""
        if not (prepare and self.prepare) or conn.in_atomic_block:
            return self._execute(sql + suffix, params, every_row=every_row)
        name, prepare_first = self._prepared(sql, len(params))
        execute = f"EXECUTE {name}({', '.join(['%s'] * len(params))}){suffix}"
        try:
            if prepare_first:  # in the same query: one round trip
                try:
                    result = self._execute(prepare_first + execute, params, every_row=every_row, after_first=True)
                except ProgrammingError as exc:
                    # The server session has it already (the name is the statement's hash): a
                    # pooler handed this connection a session an earlier client prepared it on.
                    # Nothing ran: the query's statements share one implicit transaction.
                    if _sqlstate(exc) != DUPLICATE_PREPARED_STATEMENT:
                        raise
                    result = self._execute(execute, params, every_row=every_row)
                _PREPARED.setdefault(conn.connection, set()).add(name)
                return result
            return self._execute(execute, params, every_row=every_row)
        except ProgrammingError as exc:
            if _sqlstate(exc) != UNKNOWN_PREPARED_STATEMENT:
                raise
            # The session lost it: a pooler in transaction mode hands out other sessions.
            logger.warning("prepared statement %s is gone on %r; no longer preparing", name, self.alias)
            self.prepare = False
            _PREPARED.pop(conn.connection, None)
            return self._execute(sql + suffix, params, every_row=every_row)

    def _prepared(self, sql: str, count: int) -> tuple[str, str]:
        """The name of ``sql`` as a statement prepared on this thread's connection, and the
        ``PREPARE`` to send in front of its first ``EXECUTE`` there (``""`` once prepared)."""
        conn = self._conn
        conn.ensure_connection()
        name = "django_jobs_" + hashlib.sha1(sql.encode(), usedforsecurity=False).hexdigest()[:16]
        if name in _PREPARED.get(conn.connection, ()):
            return name, ""
        numbered = sql
        for number in range(1, count + 1):
            numbered = numbered.replace("%s", f"${number}", 1)
        return name, f"PREPARE {name} AS {numbered}; "

    def _settle(
        self,
        lease: Lease,
        assignments: str,
        params: list[Any],
        *,
        also: str = "",
        own: bool = False,
        requeue: bool = False,
    ) -> None:
        """One fenced UPDATE: touches the row only while this lease still owns it.

        The fence is the owner token: a row has one only while it is ``in_progress`` (every
        settle, the reaper and a retry clear it), so the statement tests the id and the token
        alone and PostgreSQL finds the row by its primary key, never by the status index.
        ``also``: one more condition (an ack's ``NO_DEPENDENTS``); ``own``: see ``_execute_queue``.
        A ``requeue`` also needs the job not asked to abort (else ``AbortRequested``)."""
        now = timezone.now()
        where = f"id = %s AND owner_token = %s AND {also}" if also else "id = %s AND owner_token = %s"
        if requeue:
            where += " AND abort_requested IS NULL"
        sql = f"UPDATE {TABLE} SET {assignments}, {RELEASED}, updated_at = %s WHERE {where}"
        count, _ = self._execute_queue(sql, [*params, self._adapt(now), lease.token, lease.owner_token], own=own)
        if count == 1:
            return
        if requeue:  # rare: a second statement tells an abort from a lost lease
            asked = self._abort_requested_of(lease)
            if asked is not None:
                raise AbortRequested(asked)
        raise LeaseLost(f"job {lease.token} is no longer leased by this worker")

    def _finish(self, lease: Lease, assignments: str, params: list[Any], outcome: str) -> None:
        """The transactional settle: the fenced UPDATE of a job that ends (``outcome``: its
        finished status) and the resolution of the edges of the jobs waiting for it, committed
        together. Every failure and cancel takes it (they are rare), and an ack whose fast
        statement found the row has dependents."""
        if self._finish_all([(lease, assignments, params, outcome)]):
            raise LeaseLost(f"job {lease.token} is no longer leased by this worker")

    def _finish_all(self, settles: list[tuple[Lease, str, list[Any], str]]) -> list[Lease]:
        """``_finish`` for many leases in one transaction (one commit; on PostgreSQL it commits
        asynchronously, as the worker's other settles do, unless it runs in the caller's
        transaction). A lease found lost changed nothing and leaves the others to commit: the
        leases found lost."""
        from .. import dependencies

        lost, resolution = [], dependencies.Resolution()
        own = not self._conn.in_atomic_block
        with transaction.atomic(using=self.alias):
            for lease, assignments, params, outcome in settles:
                first, own = own, False  # SET LOCAL rides on the transaction's first statement
                try:
                    self._settle(lease, assignments, params, own=first)
                except LeaseLost:
                    lost.append(lease)
                    continue
                dependencies.resolve(self.alias, lease.token, outcome, resolution)
        dependencies.record(resolution, self.alias)
        return lost

    def _ack_slowly(self, lost: list[Lease]) -> list[Lease]:
        """The leases a fenced ack did not settle: acked on the transactional path, all in one
        transaction, if they are still ours (their rows have dependents); those truly lost."""
        if not lost:
            return []
        return self._finish_all([(lease, *self._ack_assignments(lease), "completed") for lease in lost])

    def new_row(self, envelope: Envelope, now: datetime) -> dict[str, Any]:
        """A new row's column values (by attribute name), defaults included."""
        return {**_FRESH, "has_dependents": False, **self.columns(envelope, now)}

    def columns(self, envelope: Envelope, now: datetime) -> dict[str, Any]:
        """The values of a new row's ``_PER_JOB`` columns, by attribute name."""
        return {
            "id": envelope.id,
            **envelope_columns(envelope),
            "attempts": envelope.attempts,
            "available_at": envelope.available_at or now,
            "created_at": now,
            "updated_at": now,
            "backend": self.name,
        }

    # -- protocol --

    def enqueue(self, envelope: Envelope) -> str:
        if envelope.parents:
            from .. import dependencies

            dependencies.enqueue(self, [envelope])
            return envelope.id
        # One statement, built once; durable: never async.
        rows.insert(self._conn, Job, self.columns(envelope, timezone.now()), fixed=_FRESH)
        return envelope.id

    def enqueue_many(self, envelopes: list[Envelope]) -> list[str]:
        if any(envelope.parents for envelope in envelopes):  # a chain or group: one transaction
            from .. import dependencies

            dependencies.enqueue(self, envelopes)
            return [e.id for e in envelopes]
        now = timezone.now()
        # One microsecond apart, so a batch keeps its order (FIFO) within a priority.
        new = [self.columns(e, now + timedelta(microseconds=i)) for i, e in enumerate(envelopes)]
        with transaction.atomic(using=self.alias, savepoint=False):  # all or none; 1,000 rows a statement
            rows.insert_many(self._conn, Job, new, fixed=_FRESH)
        return [e.id for e in envelopes]

    def fetch(self, queue: str) -> Lease | None:
        now, owner, expires = _new_lease()
        vendor = self._conn.vendor
        if vendor in ("postgresql", "sqlite"):
            row = self.claim_one(queue, owner, lambda: self._claim_returning(queue, owner, now, expires, vendor))
        else:
            row = self.claim_one(queue, owner, lambda: self._claim_orm(queue, owner, now, expires))
        return self._leased(row, owner, expires, queue)

    def ack_and_fetch(self, lease: Lease, queue: str) -> Lease | None:
        """Ack ``lease`` and claim the next job of ``queue``: one statement on PostgreSQL, one
        transaction (one commit) on SQLite. A lost lease raises ``LeaseLost`` and claims nothing."""
        vendor = self._conn.vendor
        if vendor == "sqlite":
            with transaction.atomic(using=self.alias):
                self.ack(lease)
                now, owner, expires = _new_lease()
                row = self._claim_returning(queue, owner, now, expires, vendor)
            return self._leased(row, owner, expires, queue)
        if vendor != "postgresql":
            return super().ack_and_fetch(lease, queue)
        now, owner, expires = _new_lease()
        done, params = self._ack_assignments(lease)
        sql = (
            f"WITH done AS (UPDATE {TABLE} SET {done}, {RELEASED}, updated_at = %s "
            f"WHERE id = %s AND owner_token = %s AND {NO_DEPENDENTS} RETURNING 1), "
            f"next AS ({self._claim_sql(vendor, only_if='EXISTS (SELECT 1 FROM done)')}) "
            f"SELECT (SELECT count(*) FROM done), next.* FROM (SELECT 1) AS one LEFT JOIN next ON TRUE"
        )
        claim = self._claim_params(queue, owner, now, expires)
        _, reply = self.claim_one(
            queue,
            owner,
            lambda: self._execute_queue(
                sql, [*params, self._adapt(now), lease.token, lease.owner_token, *claim], prepare=True
            ),
        )
        if not reply[0]:  # lost, or some job waits for it: then acked on the transactional path
            self._finish(lease, done, params, "completed")
            return self.fetch(queue)
        row = reply[1:] if reply[1] is not None else None
        return self._leased(row, owner, expires, queue)

    def _leased(self, row: Any, owner: str, expires: datetime, queue: str, limit: int = 0) -> Lease | None:
        """The Lease of a claimed row; ``limit``: the message size cap (read now if not given)."""
        if row is None:
            return None
        lease = Lease(token=row[0], owner_token=owner, expires_at=expires, queue=queue, raw=row)
        try:
            lease.envelope = Envelope.from_dict(_row_fields(row, queue, limit or conf.get("MAX_MESSAGE_BYTES")))
        except InvalidPayload as exc:
            lease.error = exc
        return lease

    @staticmethod
    def _claim_sql(vendor: str, only_if: str = "TRUE", *, batch: bool = False) -> str:
        """The claim: one UPDATE of the next due row (``batch``: of up to N rows, each claimed
        ahead of its run), returning its envelope columns (``batch``: after ``claimed_ahead``).
        Parameters: owner, leased_until, updated_at, queue, now (``batch``: then N)."""
        if vendor == "postgresql":
            lock, returned = "FOR UPDATE SKIP LOCKED", RETURNED.format(payload="payload::text", options="options::text")
            # The rows are locked and re-checked by the subquery: the outer UPDATE finds them by
            # id alone (a status test there could lead the planner onto the status index, which
            # walks every pending row when the table's statistics are stale).
            pending = ""
        else:
            lock, returned = "", RETURNED.format(payload="payload", options="options")
            pending = "status = 'pending' AND "
        # Statuses are literals, not parameters, so the planner matches the partial index.
        due = (
            f"SELECT id FROM {TABLE} WHERE status = 'pending' AND queue = %s AND available_at <= %s "
            f"ORDER BY priority DESC, available_at, id LIMIT {'%s' if batch else 1} {lock}"
        )
        claimed = "status = 'in_progress', owner_token = %s, leased_until = %s, updated_at = %s"
        if not batch:
            return f"UPDATE {TABLE} SET {claimed}, claimed_ahead = 0 WHERE {pending}{only_if} AND id = ({due}) RETURNING {returned}"
        # A row that was lost while claimed ahead stays marked: its start is recorded before it runs.
        ahead = f"claimed_ahead = CASE WHEN claimed_ahead = {ClaimedAhead.NO} THEN {ClaimedAhead.YES} ELSE {ClaimedAhead.LOST} END"
        rows = f"= ANY(ARRAY({due}))" if vendor == "postgresql" else f"IN ({due})"
        return f"UPDATE {TABLE} SET {claimed}, {ahead} WHERE {pending}id {rows} RETURNING claimed_ahead, {returned}"

    def _claim_params(self, queue: str, owner: str, now: datetime, expires: datetime) -> list[Any]:
        adapted_now = self._adapt(now)
        return [owner, self._adapt(expires), adapted_now, queue, adapted_now]

    def _claim_returning(self, queue: str, owner: str, now: datetime, expires: datetime, vendor: str) -> Any:
        _, row = self._execute_queue(self._claim_sql(vendor), self._claim_params(queue, owner, now, expires))
        return row

    # -- batches --

    def fetch_many(self, queue: str, limit: int) -> list[Lease]:
        if not self.supports_prefetch:  # one at a time (the base class's ack_many_and_fetch calls back here)
            return super().fetch_many(queue, limit)
        return self.ack_many_and_fetch([], queue, limit)[1]

    def can_prefetch(self) -> bool:
        """Not inside the caller's transaction (a test's, or a worker run in ``atomic``): the
        heartbeat thread, which writes waiting acks, could not touch rows claimed in it."""
        return self.supports_prefetch and not self._conn.in_atomic_block

    def ack_many(self, leases: list[Lease], begun: Sequence[Lease] = ()) -> list[Lease]:
        if not self.batches_requeues:
            return super().ack_many(leases, begun)
        return self.settle_many(leases, begun)[0]

    def settle_many(
        self, acks: list[Lease], begun: Sequence[Lease] = (), requeues: Sequence[Requeue] = ()
    ) -> tuple[list[Lease], list[Requeued]]:
        """One UPDATE on PostgreSQL and SQLite (``db_settle``), whatever the batch holds."""
        if not self.batches_requeues:
            return super().settle_many(acks, begun, requeues)
        if not acks and not begun and not requeues:
            return [], []
        vendor = self._conn.vendor
        sql, params = self._settle_batch(vendor, timezone.now(), acks, begun, requeues)
        _, rows = self._execute_queue(sql, params, prepare=True, every_row=True)
        return self._settled(acks, requeues, {row[0] for row in rows})

    def ack_many_and_fetch(self, leases: list[Lease], queue: str, limit: int) -> tuple[list[Lease], list[Lease]]:
        if not self.batches_requeues:
            return super().ack_many_and_fetch(leases, queue, limit)
        lost, _, claimed = self.settle_many_and_fetch(leases, (), queue, limit)
        return lost, claimed

    def settle_many_and_fetch(
        self, acks: list[Lease], requeues: Sequence[Requeue], queue: str, limit: int
    ) -> tuple[list[Lease], list[Requeued], list[Lease]]:
        """One statement on PostgreSQL, one transaction on SQLite: the batch's settles (as
        :meth:`settle_many`) and the claim of the next batch, which is made whatever the
        settles found. On PostgreSQL the claim cannot see the runs requeued by its own
        statement: when some were due at once and the claim came back short, a second claim,
        under the same owner token, takes them."""
        if not self.batches_requeues:
            return super().settle_many_and_fetch(acks, requeues, queue, limit)
        vendor = self._conn.vendor
        now, owner, expires = _new_lease()
        claim_sql, claim = self._claim_sql(vendor, batch=True), self._claim_params(queue, owner, now, expires) + [limit]
        sql, params = self._settle_batch(vendor, now, acks, (), requeues)
        if vendor == "sqlite":
            with transaction.atomic(using=self.alias):
                _, settled = self._execute(sql, params, every_row=True)
                _, claimed = self._execute(claim_sql, claim, every_row=True)
            lost, done = self._settled(acks, requeues, {row[0] for row in settled})
            return lost, done, self._batch(claimed, owner, expires, queue)
        sql = (
            # The settled ids come back once, in a row of their own (not in every claimed row).
            f"WITH done AS ({sql}), next AS ({claim_sql}) "
            f"SELECT settled.ids, next.* FROM next FULL JOIN (SELECT array_agg(id) AS ids FROM done) AS settled ON FALSE"
        )
        _, rows = self._execute_queue(sql, params + claim, prepare=True, every_row=True)
        claimed = [row[1:] for row in rows if row[1] is not None]
        settled = next(row[0] for row in rows if row[1] is None)
        lost, done = self._settled(acks, requeues, set(settled or ()))
        if len(claimed) < limit and any(
            o is True and r.due <= time.time() for r, o in zip(requeues, done, strict=True)
        ):
            claim[-1] = limit - len(claimed)
            _, more = self._execute_queue(claim_sql, claim, prepare=True, every_row=True)
            claimed += more
        return lost, done, self._batch(claimed, owner, expires, queue)

    def _settle_batch(
        self, vendor: str, now: datetime, acks: Sequence[Lease], begun: Sequence[Lease], requeues: Sequence[Requeue]
    ) -> tuple[str, list[Any]]:
        """The UPDATE of a batch's settles at ``now`` and its parameters (a requeue due by
        then is ready from ``now``)."""
        batch = db_settle.Batch.of(acks, begun, requeues, now, self._adapt, time.time())
        return db_settle.settle_sql(vendor), [self._adapt(now), *batch.params()]

    def _settled(
        self, acks: list[Lease], requeues: Sequence[Requeue], settled: set[str]
    ) -> tuple[list[Lease], list[Requeued]]:
        """After a batch's UPDATE (``settled``: the ids it wrote): the acks it left alone are
        acked on the transactional path if still ours (a job waits for them), the others are
        lost; a requeue it left alone was refused (asked to abort) or is lost."""
        left, again = db_settle.outcomes(acks, requeues, settled)
        refused = {requeue.lease.token: self._abort_requested_of(requeue.lease) for requeue in again}
        done: list[Requeued] = [
            True if r.lease.token not in refused else (refused[r.lease.token] or False) for r in requeues
        ]
        return self._ack_slowly(left), done

    def _abort_requested_of(self, lease: Lease) -> str | None:
        """Who asked to abort the job of ``lease``, if the lease is still ours (a requeue was
        refused), else ``None`` (the lease is lost)."""
        _, row = self._execute(
            f"SELECT abort_requested FROM {TABLE} WHERE id = %s AND owner_token = %s",
            [lease.token, lease.owner_token],
        )
        return None if row is None else cast("str | None", row[0])

    def _batch(self, rows: list[Any], owner: str, expires: datetime, queue: str) -> list[Lease]:
        """Leases for a claimed batch, in the order the claim chose them (RETURNING has none)."""
        leases, limit = [], conf.get("MAX_MESSAGE_BYTES")
        for row in rows:
            lease = self._leased(row[1:], owner, expires, queue, limit)
            assert lease is not None
            lease.ahead, lease.must_begin = True, row[0] == ClaimedAhead.LOST
            leases.append(lease)
        # priority DESC, available_at, id: the columns of RETURNED (after claimed_ahead).
        leases.sort(key=lambda lease: (-lease.raw[8], _dt(lease.raw[9]) or timezone.now(), lease.raw[0]))
        return leases

    def begin(self, lease: Lease, seconds: float) -> str | None:
        aborted_by = self._prolong(lease, seconds, "claimed_ahead = 0, ")
        lease.must_begin = False
        return aborted_by

    def _claim_orm(self, queue: str, owner: str, now: datetime, expires: datetime) -> Any:
        jobs = Job.objects.using(self.alias)
        with transaction.atomic(using=self.alias):
            job = (
                jobs.select_for_update(skip_locked=self._conn.features.has_select_for_update_skip_locked)
                .filter(status=JobStatus.PENDING, queue=queue, available_at__lte=now)
                .order_by("-priority", "available_at", "id")
                .first()
            )
            if job is None:
                return None
            jobs.filter(pk=job.pk).update(
                status=JobStatus.IN_PROGRESS, owner_token=owner, leased_until=expires, updated_at=now
            )
        return (
            job.id,
            job.handler,
            json.dumps(job.payload),
            json.dumps(job.options),
            job.signature,
            job.name,
            job.attempts,
            job.max_retries,
            job.priority,
            job.available_at,
            job.timeout,
            job.idempotency_key,
        )

    def ack(self, lease: Lease, *, count_run: bool = True) -> None:
        assignments, params = self._ack_assignments(lease, count_run)
        try:
            self._settle(lease, assignments, params, also=NO_DEPENDENTS)
        except LeaseLost:  # or some job waits for it: acked on the transactional path
            self._finish(lease, assignments, params, "completed")

    def _ack_assignments(self, lease: Lease, count_run: bool = True) -> tuple[str, list[Any]]:
        assignments = "status = 'completed', attempts = attempts + %s, finished_at = %s"
        params = [int(count_run), self._adapt(timezone.now())]
        if lease.result is not NO_RESULT:  # a keep_result job's value: kept in the same statement
            assignments += ", result = %s"
            params.append(_RESULT.get_db_prep_save(lease.result, self._conn))
        return assignments, params

    def nack(self, lease: Lease, delay: float, *, error: str = "", count_run: bool = True) -> None:
        available = timezone.now() + timedelta(seconds=max(delay, 0))
        # A delivery that did not run (count_run=False) brings no new error: keep the last one.
        self._settle(
            lease,
            "status = 'pending', attempts = attempts + %s, available_at = %s, "
            "last_error = CASE WHEN %s THEN %s ELSE last_error END",
            [int(count_run), self._adapt(available), bool(error), error],
            requeue=True,
        )

    def release(self, lease: Lease) -> None:
        """Pending again with its own ``available_at``: it keeps its place (FIFO)."""
        self._settle(lease, "status = 'pending'", [], requeue=True)

    def dead_letter(self, lease: Lease, error: str, *, count_run: bool = True) -> None:
        self._finish(
            lease,
            "status = 'failed', attempts = attempts + %s, finished_at = %s, last_error = %s",
            [int(count_run), self._adapt(timezone.now()), error],
            "failed",
        )

    def cancel(self, lease: Lease, reason: str, *, count_run: bool = True) -> None:
        self._finish(
            lease,
            "status = 'cancelled', attempts = attempts + %s, finished_at = %s, last_error = %s",
            [int(count_run), self._adapt(timezone.now()), reason],
            "cancelled",
        )

    def keep_result(self, lease: Lease, value: Any) -> None:
        """Nothing to do: the ack writes the result into the job's own row, in the same statement."""

    def extend(self, lease: Lease, seconds: float) -> str | None:
        return self._prolong(lease, seconds)

    def _prolong(self, lease: Lease, seconds: float, also: str = "") -> str | None:
        """Push the lease's expiry (fenced); ``also``: more assignments in the same UPDATE.
        Returns the row's ``abort_requested``: read by the same statement on PostgreSQL and
        SQLite (``RETURNING``), by a second one elsewhere."""
        expires = timezone.now() + timedelta(seconds=seconds)
        sql = f"UPDATE {TABLE} SET {also}leased_until = %s WHERE id = %s AND owner_token = %s"
        params = [self._adapt(expires), lease.token, lease.owner_token]
        if self._conn.vendor in ("postgresql", "sqlite"):
            _, row = self._execute_queue(f"{sql} RETURNING abort_requested", params)
        else:
            count, _ = self._execute_queue(sql, params)
            row = (
                self._execute(f"SELECT abort_requested FROM {TABLE} WHERE id = %s", [lease.token])[1] if count else None
            )
        if row is None:
            raise LeaseLost(f"job {lease.token} is no longer leased by this worker")
        lease.expires_at = expires
        return cast("str | None", row[0])

    def extend_ahead(self, leases: Sequence[Lease], seconds: float) -> None:
        """PostgreSQL: one UPDATE for them all, which skips the rows another transaction holds
        locked (a dispatch in a long transaction that made one of them a parent): this beat
        never waits for that transaction while the running job's lease is due."""
        if self._conn.vendor != "postgresql":
            return super().extend_ahead(leases, seconds)
        expires = timezone.now() + timedelta(seconds=seconds)
        _, rows = self._execute_queue(
            f"UPDATE {TABLE} SET leased_until = %s WHERE id IN (SELECT id FROM {TABLE} WHERE id = ANY(%s) "
            "AND owner_token = ANY(%s) FOR UPDATE SKIP LOCKED) RETURNING id",
            [self._adapt(expires), [lease.token for lease in leases], list({lease.owner_token for lease in leases})],
            every_row=True,
        )
        extended = {row[0] for row in rows}
        for lease in leases:
            if lease.token in extended:
                lease.expires_at = expires

    def abort_requested(self, lease: Lease) -> str | None:
        """The row's ``abort_requested``, read by its primary key."""
        _, row = self._execute(f"SELECT abort_requested FROM {TABLE} WHERE id = %s", [lease.token])
        return None if row is None else cast("str | None", row[0])

    def ping(self) -> None:
        with self._conn.cursor() as cursor:
            cursor.execute("SELECT 1")

    def reap_expired(self, queue: str | None = None) -> int:
        """Each expired lease counts as a failed run: requeued with backoff, or failed.

        A row's own backoff (``options``) is used only when its signature verifies; any other
        row is recovered with the global policy. One row's error is logged and counted
        (``jobs_reap_errors``) and never stops the pass.
        """
        from ..reaper import lost_run
        from ..retry import reaping, trusted_options

        now = timezone.now()
        jobs = Job.objects.using(self.alias)
        expired = jobs.filter(status=JobStatus.IN_PROGRESS, leased_until__lt=now)
        if queue is not None:
            expired = expired.filter(queue=queue)
        fields = (
            "id",
            "queue",
            "handler",
            "payload",
            "options",
            "signature",
            "name",
            "priority",
            "max_retries",
            "timeout",
            "idempotency_key",
            "owner_token",
            "attempts",
            "leased_until",
            "claimed_ahead",
            "abort_requested",
        )
        reaped = 0
        for job in expired.only(*fields):
            if job.abort_requested is not None:
                with reaping(job.pk, job.queue, fatal=(OperationalError, InterfaceError)):
                    reaped += self._reap_aborted(job, now)
                continue
            if job.claimed_ahead != ClaimedAhead.NO:
                with transaction.atomic(using=self.alias):
                    if self._locked(job):
                        reaped += self._hand_back(job, now)
                continue
            from .. import dependencies  # an expired lease: a row to recover

            done, resolution = 0, dependencies.Resolution()
            # A lost connection ends the pass (every later row would fail the same way).
            with (
                reaping(job.pk, job.queue, fatal=(OperationalError, InterfaceError)),
                transaction.atomic(using=self.alias),
            ):  # a savepoint: a failed row leaves the others usable
                if not self._locked(job):
                    continue
                error = WorkerLost.describe(job.leased_until)
                options = trusted_options(envelope_of(job), job.queue)
                delay = after_lost_run(job.attempts, job.max_retries, options)
                if delay is None:
                    changes = {"status": JobStatus.FAILED, "finished_at": now}
                else:
                    # Its next claim records its start before it runs: a job that crashes its
                    # worker within an ack interval of every start has each later crash counted.
                    changes = {
                        "status": JobStatus.PENDING,
                        "available_at": now + timedelta(seconds=delay),
                        "claimed_ahead": ClaimedAhead.LOST,
                    }
                # Fenced on the owner token we read: a concurrent reaper or a late ack wins cleanly.
                done = jobs.filter(pk=job.pk, owner_token=job.owner_token, status=JobStatus.IN_PROGRESS).update(
                    attempts=job.attempts + 1,
                    owner_token=None,
                    leased_until=None,
                    last_error=error,
                    updated_at=now,
                    **changes,
                )
                if done and delay is None:  # failed for good: the jobs waiting for it are decided with it
                    resolution = dependencies.resolve(self.alias, job.pk, "failed")
            if done:  # outside the savepoint: the history's own errors cannot undo the reap
                reaped += 1
                lost_run(self, job.pk, job.queue, job.attempts + 1, error, retry_in=delay, handler=job.handler)
                dependencies.record(resolution, self.alias)
        return reaped

    def _reap_aborted(self, job: Job, now: datetime) -> int:
        """An expired lease of a job asked to abort: it ends cancelled, never requeued. Its lost
        run counts, unless it was only claimed ahead (it may never have started)."""
        from .. import dependencies
        from ..reaper import aborted_lost_run  # the reaper imports the backends

        who, counted = str(job.abort_requested), job.claimed_ahead == ClaimedAhead.NO
        error = f"{JobAborted.describe(who)}\n{WorkerLost.describe(job.leased_until)}"
        resolution = dependencies.Resolution()
        done = 0
        with transaction.atomic(using=self.alias):  # the jobs waiting for it are decided with it
            if self._locked(job):  # else left to a later pass
                done = (
                    Job.objects.using(self.alias)
                    .filter(pk=job.pk, owner_token=job.owner_token, status=JobStatus.IN_PROGRESS)
                    .update(
                        status=JobStatus.CANCELLED,
                        attempts=job.attempts + int(counted),
                        finished_at=now,
                        owner_token=None,
                        leased_until=None,
                        claimed_ahead=ClaimedAhead.NO,
                        last_error=error,
                        updated_at=now,
                    )
                )
            if done:
                dependencies.resolve(self.alias, job.pk, "cancelled", resolution)
        if done:
            aborted_lost_run(self, job.pk, job.queue, job.attempts + 1, who, error, handler=job.handler)
            dependencies.record(resolution, self.alias)
        return done

    def lose_claims(self, queue: str, owner_token: str, counted: Sequence[str], *, unrun: bool = False) -> None:
        # The in-progress rows are few, and the lease index holds only them.
        tokens = list(counted) or [""]
        unrun_ahead = f"WHEN claimed_ahead = {ClaimedAhead.NO} THEN {ClaimedAhead.YES} " if unrun else ""
        self._execute_queue(
            f"UPDATE {TABLE} SET leased_until = %s, claimed_ahead = CASE {unrun_ahead}WHEN id IN "
            f"({', '.join(['%s'] * len(tokens))}) THEN 0 ELSE claimed_ahead END "
            f"WHERE status = 'in_progress' AND queue = %s AND owner_token = %s",
            [self._adapt(timezone.now() - timedelta(seconds=1)), *tokens, queue, owner_token],
        )

    def _locked(self, job: Job) -> bool:
        """In the caller's transaction, lock the row of ``job``, an expired lease the reaper read,
        if it is still as read and no other transaction holds it. A row held (a worker stopped
        inside its settle's transaction, a transaction left open) is left to a later pass rather
        than holding up this one, and every row after it."""
        return (
            Job.objects.using(self.alias)
            .select_for_update(skip_locked=self._conn.features.has_select_for_update_skip_locked)
            .filter(pk=job.pk, owner_token=job.owner_token, status=JobStatus.IN_PROGRESS)
            .values_list("pk", flat=True)
            .first()
            is not None
        )

    def _hand_back(self, job: Job, now: datetime) -> int:
        """An expired lease of a job claimed ahead that never started: no run was lost. It is
        ready again at once, its attempts unchanged, and marked so that its start is recorded
        before it runs (its worker died with it in hand; a job that kills its worker is counted
        from its next crash on)."""
        handed_back: int = (
            Job.objects.using(self.alias)
            .filter(pk=job.pk, owner_token=job.owner_token, status=JobStatus.IN_PROGRESS)
            .update(
                status=JobStatus.PENDING,
                owner_token=None,
                leased_until=None,
                available_at=now,
                claimed_ahead=ClaimedAhead.LOST,
                updated_at=now,
            )
        )
        return handed_back

    def resolve_dependents(self) -> int:
        """The dependents' sweep (``dependencies.sweep``), where an edge is open or a job waits:
        one query finds out, and most passes need nothing more (nor the dependencies' code)."""
        if not self._execute(_ANY_DEPENDENTS, [str(JobStatus.WAITING)])[1][0]:
            return 0
        from .. import dependencies

        return dependencies.sweep(self.alias)

    def wait_for_work(self, queues: list[str], timeout: float) -> bool:
        """PostgreSQL: block until a job is inserted (``NOTIFY django_jobs``, sent by a trigger
        when the inserting transaction commits) or ``timeout`` passes, where a ``LISTEN`` is
        held (see ``db_listen``). Other databases poll."""
        return self._conn.vendor == "postgresql" and self.listener.wait(timeout)

    def prepare_to_wait(self) -> None:
        """PostgreSQL: whether a ``LISTEN`` is held (see ``db_listen``), found out and logged now."""
        if self._conn.vendor == "postgresql":
            self.listener.held()

    def reset_connection(self) -> None:
        self.listener.close()
        super().reset_connection()

    def close(self) -> None:
        self.listener.close()
        self._conn.close()

    def size(self, queue: str) -> int:
        """One status at a time, OR-ed: on PostgreSQL each reads its own partial index (the
        claim's, the lease's, the status index's), where an ``IN`` list of three would scan."""
        unsettled = Q(status=JobStatus.WAITING) | Q(status=JobStatus.PENDING) | Q(status=JobStatus.IN_PROGRESS)
        count: int = Job.objects.using(self.alias).filter(unsettled, queue=queue).count()
        return count

    def oldest_ready_age(self, queue: str) -> float | None:
        """The oldest ``available_at`` of the queue's ready rows, as a claim sees them: one
        query on the claim's partial index (pending rows by queue)."""
        now = timezone.now()
        oldest = (
            Job.objects.using(self.alias)
            .filter(status=JobStatus.PENDING, queue=queue, available_at__lte=now)
            .aggregate(oldest=Min("available_at"))["oldest"]
        )
        return None if oldest is None else max((now - oldest).total_seconds(), 0.0)

    def stats(self, queue: str) -> dict[str, int]:
        now = timezone.now()
        pending = Q(status=JobStatus.PENDING)
        counts: dict[str, int] = (
            Job.objects.using(self.alias)
            .filter(queue=queue, backend=self.name)
            .aggregate(
                pending=Count("id", filter=pending & Q(available_at__lte=now)),
                delayed=Count("id", filter=pending & Q(available_at__gt=now)),
                in_progress=Count("id", filter=Q(status=JobStatus.IN_PROGRESS)),
                failed=Count("id", filter=Q(status=JobStatus.FAILED)),
                waiting=Count("id", filter=Q(status=JobStatus.WAITING)),
            )
        )
        return counts


def _sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of the driver's error Django wrapped in ``exc`` (psycopg 3, psycopg2), if any."""
    state = getattr(exc.__cause__, "sqlstate", None) or getattr(exc.__cause__, "pgcode", None)
    return state if isinstance(state, str) else None
