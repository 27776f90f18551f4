"""The admin dashboard: counts per queue and status, and the hourly chart, from real rows."""

import pytest
from django.urls import reverse

from django_jobs.models import Job
from django_jobs.worker import QueueWorker
from tests.testapp.jobs import scripted


@pytest.mark.django_db
def test_dashboard_counts_rows_per_queue_and_status(admin_client):
    scripted.dispatch(action="ok")
    scripted.using(max_retries=0).dispatch(action="raise")
    scripted.using(queue="other").dispatch(action="ok")
    worker = QueueWorker("default")
    assert [worker.process_once().status for _ in range(2)] == ["acked", "dead-lettered"]

    response = admin_client.get(reverse("admin:django_jobs_jobdashboard_changelist"))

    assert response.status_code == 200
    rows = {row["queue"]: row for row in response.context["queues"]}
    assert rows["default"]["completed"] == 1 and rows["default"]["failed"] == 1
    assert rows["other"]["pending"] == 1
    last_hour = response.context["hours"][-1]
    assert (last_hour["completed"], last_hour["failed"]) == (1, 1)
    assert len(response.context["hours"]) == 24


@pytest.mark.django_db
def test_changelist_links_to_dashboard_and_anonymous_users_are_refused(admin_client, client):
    url = reverse("admin:django_jobs_jobdashboard_changelist")
    assert url.encode() in admin_client.get(reverse("admin:django_jobs_job_changelist")).content
    assert client.get(url).status_code == 302  # to the login page
    assert Job.objects.count() == 0
