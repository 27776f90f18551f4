"""Large fan-outs: one parent with tens of thousands of dependents, a group of 100,000 members
with a callback. No statement's parameters, Lua call or message grows with a flow's size.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from django_jobs import Jobs
from django_jobs.backends.base import QueueBackend
from django_jobs.models import Job, JobStatus
from django_jobs.reaper import Reaper
from django_jobs.worker import QueueWorker
from tests.backend_params import PG_SERVER_SIDE_BINDING, BackendCase, backend_of, ready_case
from tests.testapp.jobs import noop

# More than 65,535: a statement with one parameter per dependent cannot be sent with
# server-side binding (psycopg refuses it before it reaches PostgreSQL).
WEDGE = 66_000

pytestmark = pytest.mark.slow


@pytest.fixture(params=[PG_SERVER_SIDE_BINDING])
def ssb_backend(request: pytest.FixtureRequest) -> Iterator[QueueBackend]:
    case: BackendCase = ready_case(request)
    with backend_of(case) as built:
        yield built


def test_a_parent_of_66000_dependents_is_acked_and_releases_them_all(ssb_backend):
    parent = noop.using(backend="pg_ssb").dispatch()
    children = Jobs.bulk((noop.using(depends_on=[parent]).builder() for _ in range(WEDGE)), backend="pg_ssb")
    jobs = Job.objects.using(ssb_backend.alias)
    assert jobs.filter(status=JobStatus.WAITING).count() == WEDGE

    result = QueueWorker(ssb_backend, ["default"]).process_once()

    assert (result.status, result.job_id) == ("acked", parent)
    assert jobs.get(pk=parent).status == JobStatus.COMPLETED
    assert jobs.filter(pk__in=children[:10], status=JobStatus.PENDING).count() == 10
    assert jobs.filter(status=JobStatus.PENDING).count() == WEDGE
    assert Reaper(ssb_backend).reap_once() == 0  # nothing expired, nothing left to resolve
