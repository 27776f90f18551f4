"""Helpers for tests/processes/test_beanstalk.py: raw beanstalkd access.

Raw access (``raw_tube``) talks to beanstalkd with its own greenstalk connection, never through
the backend under test, so what a test reads back (``stats-tube``, ``stats-job``, ``peek``) is
beanstalkd's own view. Tube names always come from ``backend.tube_name(queue)``.

A test that kills and restarts beanstalkd uses the ``private_beanstalkd`` fixture
(tests/conftest.py): a beanstalkd of its own, never the shared one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import greenstalk

from bench.beanstalk_cost import Writes

# stats-tube fields, and the names the backend's stats() gives them.
TUBE_COUNTS = {
    "pending": "current-jobs-ready",
    "delayed": "current-jobs-delayed",
    "in_progress": "current-jobs-reserved",
    "failed": "current-jobs-buried",
}


@contextmanager
def raw_tube(address: tuple[str, int], tube: str) -> Iterator[greenstalk.Client]:
    """A plain greenstalk client that uses and watches ``tube`` (bytes bodies)."""
    client = greenstalk.Client(address, encoding=None, use=tube, watch=tube)
    try:
        yield client
    finally:
        client.close()


def tube_counts(client: greenstalk.Client, tube: str) -> dict[str, int]:
    """ready/delayed/reserved/buried of ``tube`` under the backend's names (0 for an unknown tube)."""
    try:
        raw = client.stats_tube(tube)
    except greenstalk.NotFoundError:
        raw = {}
    return {name: int(raw.get(field, 0)) for name, field in TUBE_COUNTS.items()}


def job_state(client: greenstalk.Client, job_id: int) -> dict[str, Any]:
    """``stats-job`` of a beanstalk job id, or ``{"state": "gone"}`` once it was deleted."""
    try:
        return dict(client.stats_job(job_id))
    except greenstalk.NotFoundError:
        return {"state": "gone"}


def count_writes(client: greenstalk.Client) -> Writes:
    """Count the round trips of ``client`` from now on (``.writes``: it reads every reply
    before it writes again)."""
    writes = client._sock = Writes(client._sock)
    return writes
