"""The job page's dependencies (parents and children, linked), the waiting status in the
admin, and its count on the dashboard and in jobs_stats."""

from __future__ import annotations

import html
import json
import re

import pytest
from django.core.management import call_command
from django.urls import reverse

from django_jobs import Jobs, chain, group
from django_jobs.admin.dashboard_page import dashboard_context
from django_jobs.admin.jobs import RELATED_SHOWN
from django_jobs.models import Job
from django_jobs.testing import run_jobs
from tests.testapp.jobs import noop, scripted

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("clean_state")]
CHANGELIST = "admin:django_jobs_job_changelist"


@pytest.fixture
def superuser_client(client, django_user_model):
    django_user_model.objects.create_superuser("boss", "boss@example.com", "pw-for-tests-only")
    assert client.login(username="boss", password="pw-for-tests-only")
    return client


def page(client, job_id: str) -> str:
    response = client.get(reverse("admin:django_jobs_job_change", args=[job_id]))
    assert response.status_code == 200
    return response.content.decode()


def section(text: str) -> str:
    found = re.search(r'<fieldset class="module" id="job-dependencies".*?</fieldset>', text, re.DOTALL)
    return found.group(0) if found else ""


def tables(text: str) -> dict[str, list[list[str]]]:
    """The dependencies section's tables by caption: each row's cell texts, and links as ``->url``."""
    found = {}
    for caption, body in re.findall(r"<caption>(.*?)</caption>.*?<tbody>(.*?)</tbody>", section(text), re.DOTALL):
        rows = []
        for row in re.findall(r"<tr>(.*?)</tr>", body, re.DOTALL):
            cells = []
            for cell in re.findall(r"<td>(.*?)</td>", row, re.DOTALL):
                link = re.search(r'href="([^"]+)"', cell)
                words = " ".join(html.unescape(re.sub(r"<[^>]+>", "", cell)).split())
                cells.append(words + (f" ->{link.group(1)}" if link else ""))
            rows.append(cells)
        found[caption.split(" (")[0]] = rows
    return found


def change_url(job_id: str) -> str:
    return reverse("admin:django_jobs_job_change", args=[job_id])


def test_a_job_page_links_its_parents_and_children(superuser_client):
    first, second = noop.dispatch(), noop.dispatch()
    child = scripted.using(depends_on=[second, first]).dispatch()
    run_jobs()  # the parents complete, the child runs
    grandchild = noop.using(depends_on=[child]).dispatch()

    shown = tables(page(superuser_client, child))
    assert shown["Waits for"] == [
        [f"{second} ->{change_url(second)}", "tests.testapp.jobs.noop", "Completed", "completed"],
        [f"{first} ->{change_url(first)}", "tests.testapp.jobs.noop", "Completed", "completed"],
    ]
    assert shown["Waiting for it"] == [
        [f"{grandchild} ->{change_url(grandchild)}", "tests.testapp.jobs.noop", "Pending"]
    ]
    assert section(page(superuser_client, noop.dispatch())) == ""  # no dependencies: no section


def test_a_job_page_lists_the_first_parents_and_counts_the_others(superuser_client):
    members = [noop.prepare() for _ in range(RELATED_SHOWN + 5)]
    *member_ids, callback = group(*members).then(noop.prepare()).dispatch()
    text = page(superuser_client, callback)
    listed = [row[0].split(" ->")[0] for row in tables(text)["Waits for"]]
    assert listed == member_ids[:RELATED_SHOWN]  # the first ones, in the order the callback named them
    assert "and 5 more." in section(text)
    assert tables(page(superuser_client, member_ids[0]))["Waiting for it"][0][0].startswith(callback)


def test_a_waiting_job_shows_its_status_and_can_be_cancelled(superuser_client):
    parent = noop.dispatch()
    child = noop.using(depends_on=[parent], run_if_parent_fails=True).dispatch()
    text = page(superuser_client, child)
    assert 'class="job-status status-waiting">Waiting for parents<' in text
    assert "runs even if one of them fails or is cancelled" in text
    assert tables(text)["Waits for"][0][3] == "—"  # the parent has not finished
    listed = superuser_client.get(reverse(CHANGELIST), {"status__exact": "waiting"})
    assert [job.pk for job in listed.context["cl"].result_list] == [child]

    superuser_client.post(reverse("admin:django_jobs_job_cancel", args=[child]))
    row = Job.objects.get(pk=child)
    assert row.status == "cancelled"
    assert Job.objects.get(pk=parent).status == "pending"


def test_a_broker_record_shows_the_parents_its_message_named(superuser_client):
    env = noop.using(depends_on=["p" * 32]).builder().build()
    Job.objects.create(id=env.id, backend="redis", status="failed", queue="default", options=env.options)
    assert tables(page(superuser_client, env.id))["Waits for"] == [
        ["p" * 32, "no row here (purged, or kept by its broker)", "—", "—"]
    ]


def test_the_dashboard_and_jobs_stats_count_waiting_jobs(capsys):
    ids = chain(noop.prepare(), noop.prepare(), noop.prepare()).dispatch()
    group(noop.prepare()).then(noop.prepare()).dispatch()
    context = dashboard_context(Job.objects.get(pk=ids[0]).created_at)
    [row] = [row for row, _, _ in context["queue_rows"] if (row.backend, row.queue) == ("default", "default")]
    assert (row.pending, row.waiting) == (2, 3)
    assert "Waiting for parents" in context["count_headings"]

    call_command("jobs_stats", "--json", "--backend", "default")
    stats = {r["queue"]: r for r in json.loads(capsys.readouterr().out)}
    assert stats["default"]["waiting"] == 3
    Jobs.abort(ids[0])
    assert Job.objects.filter(status="cancelled").count() == 3  # the chain's first step and the two after it
