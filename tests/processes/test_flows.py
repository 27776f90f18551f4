"""Groups and chains run by several real ``manage.py jobs_work`` processes on PostgreSQL, Redis and a Redis Cluster.

Each run of a step records a ``SideEffect`` row (its key and the pid of the process that ran
it), so a test sees what ran, in which order, by which process, and how often.
"""

from __future__ import annotations

import os
import signal
import uuid

import pytest
from django.db.models import Max, QuerySet

from django_jobs import chain, group
from django_jobs.history import attempts_of
from django_jobs.models import Job
from tests.procs import processes, wait_until, worker_env
from tests.testapp.jobs import flow_step, scripted
from tests.testapp.models import SideEffect

PG = "postgres"
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    # (pgbouncer: the postgres database through the pooler, a connection of its own.)
    pytest.mark.django_db(databases=["default", PG, "pgbouncer"], transaction=True),
    pytest.mark.usefixtures("postgres_up"),
]
# The backends whose dependencies these tests exercise (their SideEffect rows are in PostgreSQL):
# the database backend direct and through PgBouncer in transaction mode, and Redis.
BACKENDS = [
    pytest.param("pg", id="database-postgres"),
    pytest.param("pgbouncer", id="database-pgbouncer"),
    pytest.param("redis", id="redis"),
    pytest.param("redis_cluster", id="redis-cluster"),
    pytest.param("redis_sentinel", id="redis-sentinel"),
]
# The fixture that brings each service up (the cluster's, Sentinel's and PgBouncer's backends join
# the settings, here and in the workers).
SERVICES = {
    "redis": "redis_up",
    "redis_cluster": "redis_cluster_in_settings",
    "redis_sentinel": "sentinel_backend",
    "pgbouncer": "pgbouncer_backend",
}
# The database backend's: direct and through the pooler (their rows are in PostgreSQL).
DATABASE = {"pg", "pgbouncer"}
LEASE = 2.0
MEMBERS = 1000
WORKERS = 3
# A group's members and its callback spread over these (three slots on different primaries of
# the test Redis Cluster: each release crosses from one queue's slot to another's).
QUEUES = ["default", "other", "emails"]


@pytest.fixture
def env(backend: str, request: pytest.FixtureRequest) -> dict[str, str]:
    """The backend's service is up and the backend known here and to the workers: their environment."""
    if backend in SERVICES:
        request.getfixturevalue(SERVICES[backend])
    return worker_env(LEASE)


def effects(prefix: str) -> list[SideEffect]:
    return list(SideEffect.objects.using(PG).filter(key__startswith=prefix).order_by("id"))


def kept(backend: str) -> dict[str, bool]:
    """Options that leave a ``Job`` row of each completed job: a database job's row is its own; a
    broker keeps one (in the ``default`` database) only of a job that keeps its result."""
    return {} if backend in DATABASE else {"keep_result": True}


def job_rows(backend: str) -> QuerySet[Job]:
    return Job.objects.using(PG if backend in DATABASE else "default")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_group_callback_runs_once_after_every_member(backend, env):
    tag = f"group-{uuid.uuid4().hex[:10]}"
    members = [
        flow_step.using(backend=backend, queue=QUEUES[i % 3], **kept(backend)).prepare(None, f"{tag}-m{i}", PG)
        for i in range(MEMBERS)
    ]
    callback = flow_step.using(backend=backend, queue="other", keep_result=True).prepare(None, f"{tag}-done", PG)
    *member_ids, callback_id = group(*members).then(callback).dispatch()
    jobs = job_rows(backend)

    with processes() as procs:
        for _ in range(WORKERS):
            procs.worker(*QUEUES, "--backend", backend, "--verbosity", "0", env=env)
        wait_until(
            lambda: jobs.filter(pk=callback_id, status="completed").exists(), 120, "the group's callback to complete"
        )
        # Whatever is still running would show now: give the workers another beat to misbehave.
        wait_until(lambda: not jobs.filter(status__in=["pending", "in_progress", "waiting"]).exists(), 10, "idle")

    runs = effects(tag)
    done = [run for run in runs if run.key == f"{tag}-done"]
    assert len(done) == 1, f"the callback ran {len(done)} times"
    assert len(runs) == MEMBERS + 1  # every member once
    assert {run.key for run in runs} == {f"{tag}-m{i}" for i in range(MEMBERS)} | {f"{tag}-done"}
    last_member_finished = jobs.filter(pk__in=member_ids).aggregate(last=Max("finished_at"))["last"]
    assert done[0].created_at >= last_member_finished  # it started after the last member finished
    assert runs[-1] == done[0]
    assert len({run.pid for run in runs}) > 1, "a single process ran every job"
    assert jobs.get(pk=callback_id).attempts == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_chain_survives_the_worker_of_a_step_being_killed(backend, env):
    tag = f"chain-{uuid.uuid4().hex[:10]}"
    quick = scripted.using(backend=backend, max_retries=2, backoff={"strategy": "none"}, **kept(backend))
    steps = [quick.prepare(action="ok", key=f"{tag}-{n}", db=PG) for n in (1, 2)]
    # Long enough that the kill lands inside the step on a loaded machine (a test process
    # scheduled seconds late once killed the worker after step 3 had completed).
    steps.append(quick.prepare(action="sleep", key=f"{tag}-3", db=PG, seconds=8))
    steps += [quick.prepare(action="ok", key=f"{tag}-{n}", db=PG) for n in (4, 5)]
    ids = chain(*steps).dispatch()
    jobs = job_rows(backend)

    with processes() as procs:
        for _ in range(2):
            procs.worker("--backend", backend, "--prefetch", "1", env=env)
        running = wait_until(lambda: effects(f"{tag}-3"), 60, "step 3 to start")[0]
        os.kill(running.pid, signal.SIGKILL)  # the process running step 3, mid-step
        assert not effects(f"{tag}-4"), "the kill came after step 3 had ended"
        wait_until(lambda: jobs.filter(pk=ids[-1], status="completed").exists(), 90, "the chain's last step")

    keys = [run.key.rsplit("-", 1)[1] for run in effects(tag)]
    assert keys == ["1", "2", "3", "3", "4", "5"], keys  # in order; step 3 ran again after the kill
    assert [jobs.get(pk=job_id).status for job_id in ids] == ["completed"] * 5
    step3 = jobs.get(pk=ids[2])
    assert step3.attempts == 2  # the lost run counts
    runs = [attempt.outcome for attempt in attempts_of(ids[2], using=jobs.db)]
    assert runs == ["lost"] + (["completed"] if kept(backend) else [])  # a kept result records its run
