"""The Job admin, driven through the Django test client as a logged-in superuser."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from django_jobs import Jobs
from django_jobs.models import Job
from django_jobs.worker import QueueWorker
from tests.api_support import drain, runs
from tests.testapp.jobs import scripted

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("clean_state")]

CHANGELIST = "admin:django_jobs_job_changelist"


@pytest.fixture
def superuser_client(client, django_user_model):
    django_user_model.objects.create_superuser("boss", "boss@example.com", "pw-for-tests-only")
    assert client.login(username="boss", password="pw-for-tests-only")
    return client


def listed_ids(response) -> set[str]:
    assert response.status_code == 200
    return {job.pk for job in response.context["cl"].result_list}


def test_failed_job_round_trip_through_the_admin(superuser_client):
    # flaky with fail_times=1: the first run fails (max_retries 0: failed for good), a retry succeeds.
    failed = scripted.using(max_retries=0).dispatch(action="flaky", key="adm", fail_times=1)
    done = scripted.dispatch(action="ok", key="adm-ok")
    worker = QueueWorker("default")
    drain(worker)
    assert Job.objects.get(pk=failed).status == "failed"
    assert runs("adm") == 1

    # The changelist filtered by status=failed shows the failed job and not the completed one.
    response = superuser_client.get(reverse(CHANGELIST), {"status__exact": "failed"})
    assert listed_ids(response) == {failed}
    assert failed in response.content.decode()
    assert done not in response.content.decode()

    # Its page shows attempts, the last error and the payload.
    page = superuser_client.get(reverse("admin:django_jobs_job_change", args=[failed]))
    assert page.status_code == 200
    html = page.content.decode()
    assert "RuntimeError: flaky failure" in html
    assert "Traceback" in html
    assert "&quot;adm&quot;" in html or '"adm"' in html  # the payload, JSON-rendered
    assert "&quot;flaky&quot;" in html or '"flaky"' in html
    attempts = re.search(r'field-attempts".*?<div class="readonly">([^<]*)</div>', html, re.DOTALL)
    assert attempts and attempts.group(1).strip() == "1"
    max_retries = re.search(r'field-max_retries".*?<div class="readonly">([^<]*)</div>', html, re.DOTALL)
    assert max_retries and max_retries.group(1).strip() == "0"

    # The retry action puts it back: pending, attempts 0.
    response = superuser_client.post(reverse(CHANGELIST), {"action": "retry", "_selected_action": [failed]})
    assert response.status_code == 302
    job = Job.objects.get(pk=failed)
    assert (job.status, job.attempts, job.last_error, job.finished_at) == ("pending", 0, "", None)
    messages = [str(m) for m in superuser_client.get(reverse(CHANGELIST)).context["messages"]]
    assert "Requeued 1 job(s)." in messages

    # A worker runs it again.
    result = worker.process_once()
    assert (result.status, result.job_id) == ("acked", failed)
    assert runs("adm") == 2
    assert Job.objects.get(pk=failed).status == "completed"


def test_retry_action_leaves_jobs_that_are_not_failed_alone(superuser_client):
    done = scripted.dispatch(action="ok")
    QueueWorker("default").process_once()
    response = superuser_client.post(reverse(CHANGELIST), {"action": "retry", "_selected_action": [done]}, follow=True)
    assert Job.objects.get(pk=done).status == "completed"
    texts = [str(m) for m in response.context["messages"]]
    assert "Requeued 0 job(s)." in texts
    assert any("not failed" in t for t in texts)


def test_retry_action_on_a_job_of_a_removed_backend_reports_an_error(superuser_client):
    job_id = scripted.using(max_retries=0).dispatch(action="raise")
    QueueWorker("default").process_once()
    Job.objects.filter(pk=job_id).update(backend="removed")  # its backend was since removed from settings
    response = superuser_client.post(
        reverse(CHANGELIST), {"action": "retry", "_selected_action": [job_id]}, follow=True
    )
    assert response.status_code == 200
    assert Job.objects.get(pk=job_id).status == "failed"
    assert any("removed" in str(m) for m in response.context["messages"])


def test_delete_action(superuser_client):
    keep = scripted.dispatch(action="ok")
    gone = scripted.dispatch(action="ok")
    response = superuser_client.post(
        reverse(CHANGELIST), {"action": "delete_selected", "_selected_action": [gone], "post": "yes"}
    )
    assert response.status_code == 302
    assert list(Job.objects.values_list("pk", flat=True)) == [keep]


def test_filters_for_status_queue_handler_and_backend(superuser_client):
    on_other = scripted.using(queue="other").dispatch(action="ok")
    command = Jobs.define("command", "clearsessions").dispatch()
    plain = scripted.dispatch(action="ok")
    Job.objects.filter(pk=plain).update(backend="elsewhere")  # an audit copy from another backend

    response = superuser_client.get(reverse(CHANGELIST))
    filter_params = {spec.field_path for spec in response.context["cl"].filter_specs}
    assert {"status", "queue", "handler", "backend"} <= filter_params

    assert listed_ids(superuser_client.get(reverse(CHANGELIST), {"queue__exact": "other"})) == {on_other}
    assert listed_ids(superuser_client.get(reverse(CHANGELIST), {"handler__exact": "command"})) == {command}
    assert listed_ids(superuser_client.get(reverse(CHANGELIST), {"backend__exact": "elsewhere"})) == {plain}
    assert listed_ids(superuser_client.get(reverse(CHANGELIST), {"status__exact": "pending"})) == {
        on_other,
        command,
        plain,
    }


def test_search_finds_a_job_by_id(superuser_client):
    wanted = scripted.dispatch(action="ok")
    scripted.dispatch(action="ok")
    assert listed_ids(superuser_client.get(reverse(CHANGELIST), {"q": wanted})) == {wanted}


def test_jobs_are_read_only_records(superuser_client):
    job_id = scripted.dispatch(action="ok")
    # No add form; the change page renders read-only and a POST to it changes nothing.
    assert superuser_client.get(reverse("admin:django_jobs_job_add")).status_code == 403
    url = reverse("admin:django_jobs_job_change", args=[job_id])
    superuser_client.post(url, {"status": "completed", "attempts": "9"})
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.attempts) == ("pending", 0)


def test_anonymous_users_are_sent_to_the_login_page(client):
    response = client.get(reverse(CHANGELIST))
    assert response.status_code == 302 and "/login/" in response["Location"]
