import pytest

from django_jobs import Jobs
from django_jobs.models import Job
from django_jobs.worker import QueueWorker
from tests.testapp.jobs import scripted


@pytest.mark.django_db(databases=["default", "postgres"])
@pytest.mark.parametrize("backend", ["default", "pg"])
def test_dispatch_run_retry_fail(backend, postgres_up):
    ok = scripted.using(backend=backend).dispatch(action="ok")
    bad = scripted.using(backend=backend, max_retries=2).dispatch(action="raise")
    worker = QueueWorker(backend)
    statuses = []
    for _ in range(10):
        r = worker.process_once()
        if r.status == "empty":
            break
        statuses.append(r.status)
    assert statuses == ["acked", "requeued", "requeued", "dead-lettered"]
    alias = Jobs.backend(backend).alias
    assert Job.objects.using(alias).get(pk=ok).attempts == 1
    failed = Job.objects.using(alias).get(pk=bad)
    assert failed.status == "failed" and failed.attempts == 3
    assert failed.last_error.startswith("RuntimeError: scripted failure")
