"""A batch's settles in one UPDATE (PostgreSQL and SQLite): the acks of its successes, the
recorded starts of the runs claimed ahead that began, and the requeues of its failed runs.

Each row is fenced on its own (id, owner token) pair, as a single settle is, and by the same
extra condition: an ack only where no job waits for the row (a row with dependents is acked on
the transactional path, which resolves its edges), a requeue only where nobody asked to abort
the job. The rows reach the statement as one JSON text (PostgreSQL ``jsonb_array_elements``,
SQLite ``json_each``), so its parameters are the same two whatever the batch's size.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from ..models import Job
from .base import Lease, Requeue

TABLE = Job._meta.db_table
ACK, BEGUN, REQUEUE = "a", "b", "r"  # what a row of the batch does

# Every column of the row written from the batch's row ``s`` (id, owner, kind, runs, due, error):
# ``due`` is the finish time of an ack and the new ``available_at`` of a requeue; a start only
# ends the claim ahead (it keeps its lease). Parameter: updated_at.
ASSIGNMENTS = (
    f"status = CASE s.kind WHEN '{ACK}' THEN 'completed' WHEN '{REQUEUE}' THEN 'pending' ELSE {TABLE}.status END, "
    f"attempts = {TABLE}.attempts + s.runs, "
    f"finished_at = CASE s.kind WHEN '{ACK}' THEN s.due ELSE {TABLE}.finished_at END, "
    f"available_at = CASE s.kind WHEN '{REQUEUE}' THEN s.due ELSE {TABLE}.available_at END, "
    # A delivery that did not run brings no new error: the last one is kept.
    f"last_error = CASE WHEN s.error <> '' THEN s.error ELSE {TABLE}.last_error END, "
    f"owner_token = CASE s.kind WHEN '{BEGUN}' THEN {TABLE}.owner_token END, "
    f"leased_until = CASE s.kind WHEN '{BEGUN}' THEN {TABLE}.leased_until END, "
    "claimed_ahead = 0, "
    f"updated_at = CASE s.kind WHEN '{BEGUN}' THEN {TABLE}.updated_at ELSE %s END"
)
FENCE = (
    f"{TABLE}.id = s.id AND {TABLE}.owner_token = s.owner AND CASE s.kind "
    f"WHEN '{ACK}' THEN NOT {TABLE}.has_dependents WHEN '{REQUEUE}' THEN {TABLE}.abort_requested IS NULL ELSE TRUE END"
)
# PostgreSQL. Parameters: updated_at, then the rows as one JSON array of arrays (one text to
# send, where an array per column had each of its elements quoted by the driver), read as jsonb:
# parsed once, where each ``->>`` on a json value parses its text again. The rows are
# found by primary key whatever the table's size and statistics: the ids reach the planner as
# ``ARRAY(SELECT …)``, whose length it cannot see, so it looks them up in the index (joined to
# the rows alone, it may scan a table of a few thousand rows).
SETTLE_PG = (
    f"UPDATE {TABLE} SET {ASSIGNMENTS} FROM (SELECT %s::jsonb AS rows) AS b, "
    "LATERAL (SELECT r->>0 AS id, r->>1 AS owner, r->>2 AS kind, (r->>3)::int AS runs, "
    "(r->>4)::timestamptz AS due, r->>5 AS error FROM jsonb_array_elements(b.rows) AS r) AS s "
    f"WHERE {TABLE}.id = ANY(ARRAY(SELECT r->>0 FROM jsonb_array_elements(b.rows) AS r)) AND {FENCE} "
    f"RETURNING {TABLE}.id"
)
# SQLite. Parameters: updated_at, then the rows as one JSON array of arrays.
SETTLE_SQLITE = (
    f"UPDATE {TABLE} SET {ASSIGNMENTS} FROM (SELECT json_extract(value, '$[0]') AS id, "
    "json_extract(value, '$[1]') AS owner, json_extract(value, '$[2]') AS kind, json_extract(value, '$[3]') AS runs, "
    "json_extract(value, '$[4]') AS due, json_extract(value, '$[5]') AS error FROM json_each(%s)) AS s "
    f"WHERE {FENCE} RETURNING {TABLE}.id"
)


class Batch(NamedTuple):
    """A batch's settles, one row each: its columns, in the order of ``SETTLE_*``'s rows."""

    ids: list[str]
    owners: list[str]
    kinds: list[str]
    runs: list[int]
    dues: list[Any]
    errors: list[str]

    @classmethod
    def of(
        cls,
        acks: Sequence[Lease],
        begun: Sequence[Lease],
        requeues: Sequence[Requeue],
        now: datetime,
        adapt: Callable[[datetime], Any],
        clock: float,
    ) -> Batch:
        """The rows of ``acks``, ``begun`` and ``requeues`` (``now``: the finish time of the acks;
        ``clock``: ``time.time()`` then, against which a requeue's ``due`` is measured;
        ``adapt``: a datetime as the connection takes it)."""
        batch = cls([], [], [], [], [], [])
        finished = adapt(now)
        for lease in acks:
            batch.add(lease, ACK, 1, finished, "")
        for lease in begun:
            batch.add(lease, BEGUN, 0, finished, "")
        for requeue in requeues:
            due = adapt(now + timedelta(seconds=max(requeue.due - clock, 0.0)))
            batch.add(requeue.lease, REQUEUE, int(requeue.count_run), due, requeue.error)
        return batch

    def add(self, lease: Lease, kind: str, runs: int, due: Any, error: str) -> None:
        self.ids.append(lease.token)
        self.owners.append(lease.owner_token)
        self.kinds.append(kind)
        self.runs.append(runs)
        self.dues.append(due)
        self.errors.append(error)

    def params(self) -> list[Any]:
        """The row parameter of ``SETTLE_PG`` and ``SETTLE_SQLITE``: the rows as JSON."""
        return [json.dumps(list(zip(*self, strict=True)), ensure_ascii=False, default=datetime.isoformat)]


def settle_sql(vendor: str) -> str:
    """The batch's UPDATE on ``vendor`` (postgresql or sqlite), returning the ids it settled."""
    return SETTLE_PG if vendor == "postgresql" else SETTLE_SQLITE


def outcomes(
    acks: Sequence[Lease], requeues: Sequence[Requeue], settled: set[str]
) -> tuple[list[Lease], list[Requeue]]:
    """What the UPDATE left alone (``settled``: the ids it wrote): the acks (lost, or a job
    waits for them) and the requeues (lost, or asked to abort)."""
    return (
        [lease for lease in acks if lease.token not in settled],
        [requeue for requeue in requeues if requeue.lease.token not in settled],
    )
