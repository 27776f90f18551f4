"""Job dependencies on the database backend: ``Dependency`` rows (edges) attached when a child
is dispatched and resolved in the transaction that finishes each parent.

A child waits as a ``waiting`` row (never claimed, never a run) until every edge has an
outcome. Whatever finishes a parent (an ack, a failure, a cancel, the reaper) resolves its
edges in the same transaction, so no crash can leave a finished parent with a waiting child;
:func:`sweep`, run by every reaper pass, is the safety net for paths outside the backend (a
row changed by hand, a parent deleted before it finished).

Locks are taken in one order everywhere: a parent's row (by its own settle, or by a dispatch,
``FOR UPDATE`` in id order), then its waiting children's rows in id order, then their edges. A
child's edges are read after its row is locked, so a parent resolved concurrently in another
transaction is seen once that transaction commits (PostgreSQL's READ COMMITTED reads with a new
snapshot per statement; MySQL/MariaDB read them with a locking read; SQLite has one writer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections, transaction
from django.utils import timezone

from . import rows, signing
from .envelope import Envelope
from .exceptions import BadSignature, InvalidPayload, UnknownJob
from .flows import EdgesVerdict, edges_verdict, record_settled
from .models import ENVELOPE_COLUMNS, FINISHED_STATUSES, Dependency, Job, JobStatus

if TYPE_CHECKING:
    from .backends.database import DatabaseBackend

FINISHED: tuple[str, ...] = tuple(str(status) for status in FINISHED_STATUSES)


@dataclass(frozen=True, slots=True)
class Settled:
    """A waiting job settled by a parent's outcome (it never runs)."""

    job_id: str
    attempt: int  # the run it will not have (its runs so far + 1), as a cancelled job records
    queue: str
    handler: str
    verdict: EdgesVerdict


@dataclass(slots=True)
class Resolution:
    """What resolving edges did: children made ready, and children settled."""

    released: list[str] = field(default_factory=list)
    settled: list[Settled] = field(default_factory=list)

    @property
    def moved(self) -> int:
        return len(self.released) + len(self.settled)


# -- dispatch --


def enqueue(backend: DatabaseBackend, envelopes: list[Envelope]) -> None:
    """Insert ``envelopes`` (some with parents) in one transaction: lock the parents outside the
    batch, attach the edges, and insert each child ``waiting``, or ``pending`` / ``failed`` /
    ``cancelled`` at once when its parents already decide it.

    Raises ``UnknownJob`` (and inserts nothing) when a parent is no job of this backend."""
    alias, now = backend.alias, timezone.now()
    batch = {envelope.id for envelope in envelopes}
    parents_of = {envelope.id: envelope.parents for envelope in envelopes}
    with_children = {parent for parents in parents_of.values() for parent in parents}
    resolution = Resolution()
    with transaction.atomic(using=alias):
        statuses = _lock_parents(backend, sorted(with_children - batch), envelopes)
        jobs, edges, settled_now = [], [], []
        for index, envelope in enumerate(envelopes):
            # One microsecond apart, so a batch keeps its order (FIFO) within a priority.
            row = backend.new_row(envelope, now + timedelta(microseconds=index))
            row["has_dependents"] = envelope.id in with_children
            pairs = [
                (parent, None if parent in batch else _outcome(statuses[parent])) for parent in parents_of[envelope.id]
            ]
            # Inserted in the order the child names its parents: the first failed one is reported.
            edges += [{"parent": p, "child": envelope.id, "outcome": o, "created_at": now} for p, o in pairs]
            if pairs:
                verdict = edges_verdict(pairs, bool(envelope.options.get("run_if_parent_fails")))
                if verdict.state == "waiting":
                    row["status"] = JobStatus.WAITING
                elif verdict.state != "ready":
                    row.update(status=verdict.state, finished_at=now, last_error=verdict.reason)
                    settled = Settled(envelope.id, envelope.attempts + 1, envelope.queue, envelope.handler, verdict)
                    settled_now.append(settled)
            jobs.append(row)
        rows.insert_many(connections[alias], Job, jobs)
        rows.insert_many(connections[alias], Dependency, edges)
        resolution.settled += settled_now
        for settled in settled_now:  # their own children in the batch: settled the same way
            if settled.job_id in with_children:
                _resolve(alias, [(settled.job_id, settled.verdict.state)], resolution)
    record(resolution, alias)


def _lock_parents(backend: DatabaseBackend, ids: list[str], envelopes: list[Envelope]) -> dict[str, str]:
    """Lock the parent rows ``ids`` (in id order, a chunk at a time) and mark the unfinished
    ones as having dependents; their statuses by id. SQLite writes first: its write lock is
    what keeps a parent from finishing between this read and the children's insert."""
    jobs = Job.objects.using(backend.alias)
    statuses: dict[str, str] = {}
    for chunk in rows.chunked(ids):
        chosen = jobs.filter(pk__in=chunk, backend=backend.name)
        if connections[backend.alias].vendor == "sqlite":
            chosen.exclude(status__in=FINISHED).update(has_dependents=True)
            statuses.update(chosen.values_list("pk", "status"))
            continue
        found = dict(chosen.select_for_update().order_by("pk").values_list("pk", "status"))
        unfinished = [pk for pk, status in found.items() if status not in FINISHED]
        if unfinished:
            jobs.filter(pk__in=unfinished, has_dependents=False).update(has_dependents=True)
        statuses.update(found)
    missing = next((job_id for job_id in ids if job_id not in statuses), None)
    if missing is not None:
        child = next(e.id for e in envelopes if missing in e.parents)
        raise UnknownJob(
            f"job {child} depends on {missing!r}, which is not a job of backend {backend.name!r} "
            "(a parent must be dispatched to the child's backend first)"
        )
    return statuses


def _outcome(status: str) -> str | None:
    return status if status in FINISHED else None


# -- resolution --


def resolve(alias: str, parent: str, outcome: str, into: Resolution | None = None) -> Resolution:
    """``parent`` just finished with ``outcome`` (a finished status), in the caller's
    transaction: its open edges get the outcome, and each waiting child it decides is made
    ready or settled (and those settled settle their own children in turn). The caller holds
    the parent's row (it just updated it) and calls :func:`record` after its transaction.
    Returns what it did (added to ``into`` when given)."""
    resolution = Resolution() if into is None else into
    _resolve(alias, [(parent, outcome)], resolution)
    return resolution


def _resolve(alias: str, todo: list[tuple[str, str]], resolution: Resolution) -> None:
    """Resolve the edges of finished parents, (id, outcome): the completed ones together, in
    one statement per :func:`rows.matching` (they only release children), a failed or
    cancelled one on its own (the children it settles that have children of their own are
    resolved next)."""
    connection = connections[alias]
    while todo:
        completed = [parent for parent, outcome in todo if outcome == "completed"]
        for chosen in rows.matching(connection, "parent", completed):
            _release_free(alias, _lock_children(alias, chosen, "completed"), resolution)
        cascade: list[tuple[str, str]] = []
        for parent, outcome in todo:
            if outcome != "completed":
                [chosen] = rows.matching(connection, "parent", [parent])
                cascade += _decide(alias, _lock_children(alias, chosen, outcome), resolution, (parent, outcome))
        todo = cascade


# The hot statements (one parent resolved per ack of a job with dependents) are written out:
# the ORM's compiler costs more than running them.
JOBS, EDGES = Job._meta.db_table, Dependency._meta.db_table


def _sql(alias: str, sql: str, params: Sequence[Any]) -> tuple[int, list[tuple[Any, ...]]]:
    """Run ``sql`` on ``alias``: the row count and the rows."""
    with connections[alias].cursor() as cursor:
        cursor.execute(sql, list(params))
        return cursor.rowcount, cursor.fetchall() if cursor.description else []


def _in(values: Sequence[str]) -> str:
    return ", ".join(["%s"] * len(values))


def _lock_children(alias: str, parents: tuple[str, list[Any]], outcome: str) -> list[dict[str, Any]]:
    """Lock the waiting children whose edge to one of ``parents`` (a condition on ``parent``
    and its parameters, from :func:`rows.matching`) is open, then give those edges the
    parents' ``outcome``; the children locked. Every path locks a child's row before it
    changes or (MySQL) locks its edges. PostgreSQL does both in one statement: no other
    transaction writes or locks these parents' edges, whatever order it takes them in."""
    chosen, params = parents
    open_edges = f"{chosen} AND outcome IS NULL"
    if connections[alias].vendor == "postgresql":
        _, found = _sql(
            alias,
            f"WITH edges AS (UPDATE {EDGES} SET outcome = %s WHERE {open_edges} RETURNING child) "
            f"SELECT {_LOCKED_COLUMNS} FROM {JOBS} WHERE id IN (SELECT child FROM edges) ORDER BY id FOR UPDATE",
            [outcome, *params],
        )
        return _waiting(found)
    locked = _lock_waiting(alias, f"id IN (SELECT child FROM {EDGES} WHERE {open_edges})", params)
    _sql(alias, f"UPDATE {EDGES} SET outcome = %s WHERE {open_edges}", [outcome, *params])
    return locked


# The rows are found by primary key and their status tested here, not in SQL: a status test
# could lead PostgreSQL's planner onto the status index (when its statistics say few rows are
# waiting), which walks every waiting row. (No other transaction changes a locked row.)
_LOCKED = ("id", "attempts", "queue", "handler", "has_dependents")
_LOCKED_COLUMNS = ", ".join((*_LOCKED, "status"))


def _waiting(found: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    return [dict(zip(_LOCKED, row[:-1], strict=True)) for row in found if row[-1] == JobStatus.WAITING]


def _lock_waiting(alias: str, chosen: str, params: Sequence[Any]) -> list[dict[str, Any]]:
    """Lock the rows that ``chosen`` (a condition on ``id``) picks, in id order; what a settle
    records of those still waiting."""
    lock = "" if connections[alias].vendor == "sqlite" else " FOR UPDATE"
    _, found = _sql(alias, f"SELECT {_LOCKED_COLUMNS} FROM {JOBS} WHERE {chosen} ORDER BY id{lock}", params)
    return _waiting(found)


def _lock_jobs(alias: str, ids: list[str]) -> list[dict[str, Any]]:
    """:func:`_lock_waiting` of the rows ``ids``, in id order (a chunk at a time but on PostgreSQL)."""
    return [
        row
        for chosen, params in rows.matching(connections[alias], "id", sorted(ids))
        for row in _lock_waiting(alias, chosen, params)
    ]


def _release_free(alias: str, children: list[dict[str, Any]], resolution: Resolution) -> None:
    """A parent of these locked waiting children completed: release those no open edge holds
    back any more. The statement that releases them looks for one open edge of each, whatever
    how many it has (a group's callback waits for every member)."""
    if children:
        resolution.released += _release(alias, [child["id"] for child in children], timezone.now(), unless_open=True)


def _decide(
    alias: str, children: list[dict[str, Any]], resolution: Resolution, resolved: tuple[str, str] | None = None
) -> list[tuple[str, str]]:
    """Release or settle each locked waiting child as its edges say; the children settled
    that have children of their own (to resolve next).

    ``resolved``: the failed or cancelled parent whose edges were just given their outcome. A
    waiting child has no other edge that settles it (the resolution of that edge would have
    settled it, under the child's lock), so that parent's outcome and whether an edge is still
    open decide: a child of many parents (a group's callback) costs one lookup per parent, not
    a read of all its edges. Without it (the sweep), every edge of each child is read."""
    if not children:
        return []
    ids, now = [child["id"] for child in children], timezone.now()
    edges = _open_edges(alias, ids) if resolved is not None else _all_edges(alias, ids)
    options = _trusted_options(alias, ids)
    ready: list[str] = []
    settled: dict[EdgesVerdict, list[str]] = {}
    cascade: list[tuple[str, str]] = []
    for child in children:
        pairs = edges.get(child["id"], [])
        verdict = edges_verdict(
            pairs if resolved is None else [resolved, *pairs],
            bool(options.get(child["id"], {}).get("run_if_parent_fails")),
        )
        if verdict.state == "ready":
            ready.append(child["id"])
        elif verdict.state != "waiting":
            settled.setdefault(verdict, []).append(child["id"])
            resolution.settled.append(
                Settled(child["id"], child["attempts"] + 1, child["queue"], child["handler"], verdict)
            )
            if child["has_dependents"]:
                cascade.append((child["id"], verdict.state))
    for verdict, chosen in settled.items():
        for chunk in rows.chunked(chosen):
            Job.objects.using(alias).filter(pk__in=chunk).update(  # locked, and waiting
                status=verdict.state, finished_at=now, last_error=verdict.reason, updated_at=now
            )
    resolution.released += _release(alias, ready, now)
    return cascade


def _edges_sql(alias: str, columns: str, ids: list[str], where: str = "", tail: str = "") -> list[tuple[Any, ...]]:
    """Edges of the children ``ids`` (a chunk of children at a time but on PostgreSQL), read
    after their rows were locked. MySQL/MariaDB (REPEATABLE READ) reads them with a locking
    read, which alone sees the latest commits."""
    lock = " FOR UPDATE" if connections[alias].vendor == "mysql" else ""
    found: list[tuple[Any, ...]] = []
    for chosen, params in rows.matching(connections[alias], "child", ids):
        found += _sql(alias, f"SELECT {columns} FROM {EDGES} WHERE {chosen}{where}{tail}{lock}", params)[1]
    return found


def _all_edges(alias: str, ids: list[str]) -> dict[str, list[tuple[str, str | None]]]:
    """Every edge of each child, in the order it named its parents (the order they were inserted)."""
    by_child: dict[str, list[tuple[str, str | None]]] = {}
    for child, parent, outcome in _edges_sql(alias, "child, parent, outcome", ids, tail=" ORDER BY child, id"):
        by_child.setdefault(child, []).append((parent, outcome))
    return by_child


def _open_edges(alias: str, ids: list[str]) -> dict[str, list[tuple[str, str | None]]]:
    """One open edge of each child that has any (grouped in the database, but in a locking
    read, which takes no aggregate)."""
    if connections[alias].vendor == "mysql":
        pairs = _edges_sql(alias, "child, parent", ids, " AND outcome IS NULL")
    else:
        pairs = _edges_sql(alias, "child, MIN(parent)", ids, " AND outcome IS NULL", " GROUP BY child")
    return {child: [(parent, None)] for child, parent in pairs}


def _release(alias: str, ids: list[str], now: datetime, *, unless_open: bool = False) -> list[str]:
    """Waiting -> pending, due at its own time or now (so it queues behind the jobs already
    ready), in one statement per :func:`rows.matching`; ``unless_open``: only those without an
    open edge (read by this statement, after their rows were locked). Idle PostgreSQL workers
    are woken when the transaction commits. Returns the ids released (all of ``ids`` unless
    ``unless_open``)."""
    connection = connections[alias]
    moment = connection.ops.adapt_datetimefield_value(now)
    free = f" AND NOT EXISTS (SELECT 1 FROM {EDGES} WHERE child = {JOBS}.id AND outcome IS NULL)" if unless_open else ""
    released: list[str] = []
    for chosen, chosen_params in rows.matching(connection, "id", ids):
        sql = (
            f"UPDATE {JOBS} SET status = 'pending', updated_at = %s, "
            f"available_at = CASE WHEN available_at < %s THEN %s ELSE available_at END "
            f"WHERE {chosen}{free}"  # locked, and waiting
        )
        params = [moment, moment, moment, *chosen_params]
        if connection.vendor == "postgresql":  # notifications of one transaction are merged
            _, freed = _sql(
                alias, f"WITH freed AS ({sql} RETURNING id) SELECT id, pg_notify('django_jobs', '') FROM freed", params
            )
            released += [row[0] for row in freed]
        elif unless_open and connection.vendor == "sqlite":
            released += [row[0] for row in _sql(alias, f"{sql} RETURNING id", params)[1]]
        elif unless_open:
            # MySQL/MariaDB has no UPDATE ... RETURNING: the rows are locked, so those pending
            # now are those it released. (InnoDB reads a subquery of an UPDATE with locks, so
            # it sees the edges other transactions resolved and committed.)
            _sql(alias, sql, params)
            released += [
                row[0]
                for row in _sql(alias, f"SELECT id FROM {JOBS} WHERE {chosen} AND status = 'pending'", chosen_params)[1]
            ]
        else:
            _sql(alias, sql, params)
            released += chosen_params
    return released


def _trusted_options(alias: str, ids: list[str]) -> dict[str, dict[str, Any]]:
    """The options of the waiting jobs ``ids`` whose signature verifies, by id: a row written
    without the signing key never gets ``run_if_parent_fails`` (a failed parent settles it)."""
    trusted: dict[str, dict[str, Any]] = {}
    for chunk in rows.chunked(ids):
        for row in Job.objects.using(alias).filter(pk__in=chunk).values("id", *ENVELOPE_COLUMNS):
            columns = {column: row[column] for column in ENVELOPE_COLUMNS}
            envelope = Envelope(id=row["id"], **{**columns, "options": row["options"] or {}})
            try:
                signing.verify_delivery(envelope, row["queue"])
            except (BadSignature, InvalidPayload):
                continue
            if isinstance(envelope.options, dict):
                trusted[row["id"]] = envelope.options
    return trusted


def record(resolution: Resolution, alias: str) -> None:
    """After the transaction that settled them: each settled child's history entry (the run it
    will not have, by the ``flow`` worker) and its log record."""
    for settled in resolution.settled:
        record_settled(settled.job_id, settled.queue, settled.handler, settled.attempt, settled.verdict, alias)


# -- the safety net --


def sweep(alias: str) -> int:
    """Resolve what no settle resolved: open edges whose parent finished (or no longer exists:
    a parent deleted before it finished counts as cancelled), and waiting jobs none of whose
    edges is open. Idempotent; returns how many waiting jobs it released or settled."""
    resolution = Resolution()
    with transaction.atomic(using=alias):
        _, finished = _sql(
            alias,
            f"SELECT DISTINCT edge.parent, parent.status FROM {EDGES} edge LEFT JOIN {JOBS} parent "
            f"ON parent.id = edge.parent WHERE edge.outcome IS NULL "
            f"AND (parent.id IS NULL OR parent.status IN ({_in(FINISHED)})) ORDER BY edge.parent",
            FINISHED,
        )
        _resolve(alias, [(parent, status or str(JobStatus.CANCELLED)) for parent, status in finished], resolution)
        open_edges = Dependency.objects.using(alias).filter(outcome__isnull=True)
        waiting = Job.objects.using(alias).filter(status=JobStatus.WAITING)
        stuck = waiting.exclude(pk__in=open_edges.values("child")).values_list("pk", flat=True)
        _resolve(alias, _decide(alias, _lock_jobs(alias, list(stuck)), resolution), resolution)
    record(resolution, alias)
    return resolution.moved
