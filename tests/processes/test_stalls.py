"""A worker frozen in the middle of a batch (SIGSTOP of its whole process group: a paused VM, a
long GIL-holding C call, a network partition) past its lease, on PostgreSQL and Redis.

The job it was running started its handler: once its start is recorded (with the next batched
write, within one ack interval) its lost lease counts as a run, so a ``max_retries=0`` job ends
``failed`` after that one run and never runs again. The jobs it had claimed ahead and not
started go back uncounted and run once elsewhere. Runs are counted by their side effects (one
``SideEffect`` row per handler call, in PostgreSQL).
"""

from __future__ import annotations

import signal
import uuid

import pytest
from django.utils import timezone

from django_jobs.backends import get_backend
from django_jobs.backends.redis import RedisBackend
from django_jobs.models import ClaimedAhead, Job
from tests.procs import processes, wait_until, worker_env
from tests.testapp.jobs import scripted
from tests.testapp.models import SideEffect

PG = "postgres"
LEASE = 2.0
pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.django_db(databases=["default", PG], transaction=True),
    pytest.mark.usefixtures("postgres_up"),
]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def effects(key: str) -> int:
    return SideEffect.objects.using(PG).filter(key=key).count()


class Pg:
    """The ``pg`` backend, observed through its rows."""

    name = "pg"

    def start_recorded(self, job_id: str) -> bool:
        row = Job.objects.using(PG).get(pk=job_id)
        return row.status == "in_progress" and row.claimed_ahead == ClaimedAhead.NO

    def lease_expired(self, job_id: str) -> bool:
        leased_until = Job.objects.using(PG).get(pk=job_id).leased_until
        return leased_until is not None and leased_until < timezone.now()

    def state(self, job_id: str) -> tuple[str, int, str]:
        row = Job.objects.using(PG).get(pk=job_id)
        return row.status, row.attempts, row.last_error.partition(":")[0]


class Redis:
    """The ``redis`` backend, observed through its keys (a failure also has a ``Job`` row)."""

    name = "redis"

    def __init__(self) -> None:
        backend = get_backend("redis")
        assert isinstance(backend, RedisBackend)
        self.backend, self.keys = backend, backend.keys("default")

    def start_recorded(self, job_id: str) -> bool:
        client = self.backend.client
        return client.zscore(self.keys.processing, job_id) is not None and not client.hexists(self.keys.ahead, job_id)

    def lease_expired(self, job_id: str) -> bool:
        deadline = self.backend.client.zscore(self.keys.processing, job_id)
        return deadline is not None and deadline / 1000 < timezone.now().timestamp()

    def state(self, job_id: str) -> tuple[str, int, str]:
        row = Job.objects.filter(pk=job_id).first()  # a failure's audit row, in the default database
        if row is not None:
            return row.status, row.attempts, row.last_error.partition(":")[0]
        if self.backend.client.hexists(self.keys.bodies, job_id):
            return "pending", -1, ""
        return "completed", -1, ""  # Redis forgets completed jobs


@pytest.fixture(params=["pg", "redis"])
def backend(request: pytest.FixtureRequest) -> Pg | Redis:
    if request.param == "pg":
        return Pg()
    request.getfixturevalue("redis_up")
    return Redis()


def test_a_frozen_workers_batched_job_counts_its_run_and_never_runs_again(backend: Pg | Redis) -> None:
    """The batched job in hand was started: its lost lease is a counted run (``max_retries=0``:
    failed, ``WorkerLost``), even after the frozen worker wakes up; the jobs it held ahead and
    never started run once elsewhere."""
    env = worker_env(lease_timeout=LEASE)
    frozen_key, keys = unique("frozen"), [unique("ahead") for _ in range(2)]
    options = {"backend": backend.name, "max_retries": 0, "backoff": {"strategy": "none"}}
    frozen = scripted.using(priority=10, **options).dispatch(action="sleep", seconds=4, key=frozen_key, db=PG)
    others = [scripted.using(**options).dispatch(action="ok", key=key, db=PG) for key in keys]
    with processes() as procs:
        first = procs.worker("--backend", backend.name, env=env)
        wait_until(lambda: effects(frozen_key), 30, "the first job to start")
        wait_until(lambda: backend.start_recorded(frozen), 10, "its start to be recorded")
        first.send(signal.SIGSTOP, group=True)  # the supervisor and its worker process alike
        try:
            wait_until(lambda: backend.lease_expired(frozen), 10, "the frozen worker's lease to expire")
            code, reap = procs.run("jobs_reap", "--backend", backend.name, env=env)
            assert code == 0, reap.output()
            assert backend.state(frozen) == ("failed", 1, "WorkerLost"), "its one run, lost, is counted"

            second = procs.worker("--backend", backend.name, env=env)
            wait_until(lambda: all(effects(key) for key in keys), 30, "the jobs held ahead to run elsewhere")
        finally:
            first.send(signal.SIGCONT, group=True)
        # The frozen run goes on and ends; its settle finds the lease lost and runs nothing more.
        try:
            wait_until(lambda: first.job_lines("lost"), 30, "the woken worker's line for its lost job")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{first.output()}") from None
        assert first.stop() == 0, first.output()
        assert second.stop() == 0, second.output()

    assert backend.state(frozen) == ("failed", 1, "WorkerLost")
    assert effects(frozen_key) == 1, "the handler was called once: a started run is never run again uncounted"
    assert [effects(key) for key in keys] == [1, 1]
    assert [backend.state(i)[0] for i in others] == ["completed", "completed"]
