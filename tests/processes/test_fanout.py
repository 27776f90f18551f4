"""Large fan-outs, in this process: one parent with 66,000 dependents on PostgreSQL with
server-side binding, and on every backend that holds dependencies a parent with 100,000
dependents that are the members of a group, whose callback waits for all of them.

A backend battery, like the flow battery: it runs once, on the main entry of scripts/test. No
statement's parameters, Lua call, pipeline or message may grow with a flow's size.

The flow of 100,002 jobs is dispatched for real, once per backend: the parent and then the
group, each by the backend's ``submit`` (what ``dispatch()`` calls), from envelopes built once
by ``group(...).then(...).build()`` (a build does not depend on the backend). Then:

1. The parent runs through the worker: its settle releases its 100,000 dependents.
2. All members but one are settled by the backend's own paths in bulk. On Redis they are
   claimed and acked 1,000 at a time (``fetch_many``, ``ack_many``: what a prefetching worker
   does), each ack resolving the member's edge to the callback. On a database they are marked
   completed by one UPDATE, as their acks would mark them, and the backend's sweep
   (``resolve_dependents``, every reaper pass) resolves their 99,999 edges: the statements a
   flow's size could blow up are those that list its jobs, and the sweep lists every one of
   them, where an ack lists one.
3. The last member runs through the worker: its settle finds the callback's last open edge and
   releases it. The callback then runs through the worker, once.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace

import pytest
from django.utils import timezone

from django_jobs import group, signing
from django_jobs.backends.base import QueueBackend
from django_jobs.backends.database import DatabaseBackend
from django_jobs.envelope import Envelope, new_id
from django_jobs.models import Dependency, Job, JobStatus
from django_jobs.reaper import Reaper
from django_jobs.worker import QueueWorker
from tests.backend_params import (
    ALL_DATABASES,
    BACKEND_PARAMS,
    PG_SERVER_SIDE_BINDING,
    BackendCase,
    backend_of,
    ready_case,
)
from tests.testapp import jobs as testjobs
from tests.testapp.jobs import noop, remember

# More than 65,535: a statement with one parameter per dependent cannot be sent with
# server-side binding (psycopg refuses it before it reaches PostgreSQL).
WEDGE = 66_000
MEMBERS = 100_000
# How many members Redis claims and acks at a time.
BATCH = 1000

pytestmark = [
    pytest.mark.slow,
    # Every case's database, flushed after each test (a rollback of 300,000 changed rows costs
    # more); postgres_ssb is the postgres database, through a connection of its own.
    pytest.mark.django_db(databases=[*ALL_DATABASES, "postgres_ssb"], transaction=True),
]
FLOW_PARAMS = [
    # The cases' own django_db marks left out: the module's applies.
    pytest.param(*param.values, id=param.id, marks=[mark for mark in param.marks if mark.name != "django_db"])
    for param in [
        # (Through PgBouncer the statements are the same as direct: its conformance case suffices.)
        *(
            param
            for param in BACKEND_PARAMS
            if (str(param.id).startswith("database-") and param.id != "database-pgbouncer") or param.id == "redis"
        ),
        PG_SERVER_SIDE_BINDING,
    ]
]


@pytest.fixture
def case(request: pytest.FixtureRequest) -> BackendCase:
    return ready_case(request)


@pytest.fixture
def backend(case: BackendCase) -> Iterator[QueueBackend]:
    with backend_of(case) as built:
        yield built


@pytest.fixture(scope="module")
def flow() -> tuple[Envelope, list[Envelope], Envelope]:
    """The parent, the members of a group that each wait for it, and the group's callback."""
    parent = noop.prepare().build()
    members = [noop.prepare().depends_on(parent.id) for _ in range(MEMBERS)]
    *built, callback = group(*members).then(remember.prepare(f"callback-{uuid.uuid4().hex}")).build()
    return parent, built, callback


def waiting_and_ready(backend: QueueBackend) -> tuple[int, int]:
    counts = backend.stats("default")
    return counts["waiting"], counts["pending"]


def settle_all_but_one(backend: QueueBackend) -> None:
    """Step 2 of the module's docstring: every ready member but one settled completed."""
    if isinstance(backend, DatabaseBackend):
        jobs = Job.objects.using(backend.alias).filter(status=JobStatus.PENDING)
        spared = jobs.values_list("pk", flat=True).first()
        jobs.exclude(pk=spared).update(status=JobStatus.COMPLETED, attempts=1, finished_at=timezone.now())
        assert backend.resolve_dependents() == 0  # every edge but one resolved: the callback waits
        assert Dependency.objects.using(backend.alias).filter(outcome__isnull=True).count() == 1
        return
    left = MEMBERS - 1
    while left:
        claimed = backend.fetch_many("default", min(BATCH, left))
        assert claimed and backend.ack_many(claimed) == []
        left -= len(claimed)


@pytest.mark.parametrize("case", FLOW_PARAMS, indirect=True)
def test_a_parent_of_100000_dependents_and_a_group_of_100000_with_a_callback_complete(case, backend, flow):
    parent, members, callback = flow
    assert "parents" not in callback.options  # they are beside its message, kept by the backend
    testjobs.calls.clear()
    backend.submit([parent])
    backend.submit([*members, callback])
    assert waiting_and_ready(backend) == (MEMBERS + 1, 1)
    worker = QueueWorker(backend, ["default"])

    result = worker.process_once()
    assert (result.status, result.job_id) == ("acked", parent.id)
    assert waiting_and_ready(backend) == (1, MEMBERS)  # every dependent released, the callback waits

    settle_all_but_one(backend)
    assert waiting_and_ready(backend) == (1, 1)

    last = worker.process_once()
    assert last.status == "acked" and last.job_id in {member.id for member in members}
    assert waiting_and_ready(backend) == (0, 1)
    ran = worker.process_once()
    assert (ran.status, ran.job_id) == ("acked", callback.id)
    assert worker.process_once().status == "empty"
    assert testjobs.calls == [(tuple(callback.payload["args"]), {})]  # the callback ran once
    assert backend.resolve_dependents() == 0


@pytest.mark.parametrize("case", [PG_SERVER_SIDE_BINDING], indirect=True)
def test_a_parent_of_66000_dependents_is_acked_and_releases_them_all(case, backend):
    parent = noop.using(backend=case.name).dispatch()
    # Copies of one built child, each signed under its own id: build() does no more per job.
    child = noop.using(depends_on=[parent]).builder().build()
    children = [replace(child, id=new_id()) for _ in range(WEDGE)]
    for each in children:
        each.signature = signing.sign(each)
    backend.submit(children)
    jobs = Job.objects.using(backend.alias)
    assert jobs.filter(status=JobStatus.WAITING).count() == WEDGE

    result = QueueWorker(backend, ["default"]).process_once()

    assert (result.status, result.job_id) == ("acked", parent)
    assert jobs.get(pk=parent).status == JobStatus.COMPLETED
    assert jobs.filter(status=JobStatus.PENDING).count() == WEDGE
    assert Reaper(backend).reap_once() == 0  # nothing expired, nothing left to resolve
