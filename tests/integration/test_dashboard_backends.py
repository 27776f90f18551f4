"""The admin dashboard over real servers: jobs waiting on the database, Redis and beanstalkd
backends show in their rows, and a job that failed on any of them links to its Job row."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from django_jobs.worker import QueueWorker
from tests.testapp.jobs import scripted

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("clean_state")]

URL = "admin:django_jobs_jobdashboard_changelist"
DATABASE = {"ENGINE": "database", "OPTIONS": {"DATABASE": "default"}}
AGE = re.compile(r"^(—|\d+ s|\d+ min \d+ s|\d+ h \d+ min)$")
CASES = [
    pytest.param("default", (), id="database"),
    pytest.param("redis", ("redis_up",), id="redis"),
    pytest.param("beanstalk", ("beanstalk_up",), id="beanstalk"),
]


def configure(settings, *names: str) -> None:
    """The database backend (where failed rows are kept) and the shared settings' ``names``."""
    shared = settings.JOBS["BACKENDS"]
    settings.JOBS = {**settings.JOBS, "BACKENDS": {"default": DATABASE, **{name: shared[name] for name in names}}}


def dashboard(client):
    response = client.get(reverse(URL))
    assert response.status_code == 200
    return response, {(row.backend, row.queue): (row, cells, age) for row, cells, age in response.context["queue_rows"]}


@pytest.mark.parametrize(("name", "services"), CASES)
def test_waiting_and_failed_jobs_show_on_every_backend(
    name, services, request, settings, admin_client, django_capture_on_commit_callbacks
):
    for service in services:
        request.getfixturevalue(service)
    configure(settings, name)
    with django_capture_on_commit_callbacks(execute=True):
        for _ in range(2):
            scripted.using(backend=name, queue="emails").dispatch(action="ok")
        scripted.using(backend=name, queue="emails", delay=3600).dispatch(action="ok")
        failed = scripted.using(backend=name, queue="other", max_retries=0).dispatch(action="raise")
    assert QueueWorker(name, ["other"]).process_once().status == "dead-lettered"

    response, rows = dashboard(admin_client)

    emails, cells, age = rows[name, "emails"]
    assert not emails.error
    assert (emails.pending, emails.delayed, emails.in_progress) == (2, 1, 0)
    assert AGE.match(age)
    assert bool(cells[0].url) == (name == "default")  # a broker's waiting jobs have no Job row to list
    other, cells, _ = rows[name, "other"]
    assert other.failed == 1
    assert f"status__exact=failed&queue=other&backend={name}" in cells[3].url
    assert {job.pk for job in admin_client.get(cells[3].url).context["cl"].result_list} == {failed}
    assert f"<title>{name} / emails: 2 pending, 1 delayed, 0 in progress</title>" in response.content.decode()


def test_the_page_renders_with_jobs_on_all_three_backends(
    settings, admin_client, redis_up, beanstalk_up, django_capture_on_commit_callbacks
):
    configure(settings, "redis", "beanstalk")
    with django_capture_on_commit_callbacks(execute=True):
        for name in ("default", "redis", "beanstalk"):
            scripted.using(backend=name, queue="emails").dispatch(action="ok")

    response, rows = dashboard(admin_client)

    assert [(backend, queue) for backend, queue in rows if queue == "emails"] == [
        ("default", "emails"),
        ("redis", "emails"),
        ("beanstalk", "emails"),
    ]
    assert all(not row.error and row.pending == (queue == "emails") for (_, queue), (row, _, _) in rows.items())
    content = response.content.decode()
    assert 'id="jobs-hourly"' in content and 'id="jobs-depth"' in content
