"""The Job admin, driven through the Django test client as a logged-in superuser."""

from __future__ import annotations

import html
import re

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_jobs import Jobs
from django_jobs.admin import SUMMARY_CHARS, duration_text, retry_message
from django_jobs.models import Job, JobAttempt
from django_jobs.worker import QueueWorker
from tests.api_support import drain, runs
from tests.testapp.jobs import scripted

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("clean_state")]

CHANGELIST = "admin:django_jobs_job_changelist"
SECONDS = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}$")


@pytest.fixture
def superuser_client(client, django_user_model):
    django_user_model.objects.create_superuser("boss", "boss@example.com", "pw-for-tests-only")
    assert client.login(username="boss", password="pw-for-tests-only")
    return client


@pytest.fixture
def staff_client(client, django_user_model):
    """Logs a staff user (not a superuser) in with the given ``django_jobs`` permissions."""

    def login(*codenames: str):
        user = django_user_model.objects.create_user("staff", "staff@example.com", "pw-for-tests-only", is_staff=True)
        user.user_permissions.set(
            Permission.objects.filter(content_type__app_label="django_jobs", codename__in=codenames)
        )
        assert client.login(username="staff", password="pw-for-tests-only")
        return client

    return login


def job_page(client, job_id: str) -> str:
    response = client.get(reverse("admin:django_jobs_job_change", args=[job_id]))
    assert response.status_code == 200
    return response.content.decode()


def history_rows(page: str) -> list[dict[str, str]]:
    """The attempt history table of a job page: one dict per attempt, its cells by column and
    ``error``, the text of the row below it that holds the error (empty when there is none)."""
    section = re.search(r'<fieldset class="module" id="attempt-history".*?</fieldset>', page, re.DOTALL)
    assert section, "the job page has no attempt history section"
    columns = ["attempt", "outcome", "worker", "started", "finished", "duration", "error_class"]

    def text(fragment: str) -> str:
        return html.unescape(re.sub(r"<[^>]+>", "", fragment)).strip()

    rows = []
    for css, body in re.findall(r'<tbody class="attempt outcome-(\w+)">(.*?)</tbody>', section.group(0), re.DOTALL):
        lines = re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.DOTALL)
        cells = [text(cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", lines[0], re.DOTALL)]
        error = text(lines[1]) if len(lines) > 1 else ""
        rows.append({"css": css, **dict(zip(columns, cells, strict=True)), "error": error})
    return rows


def retry_in_changelist(client, *job_ids: str):
    return client.post(reverse(CHANGELIST), {"action": "retry", "_selected_action": list(job_ids)}, follow=True)


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


# -- the attempt history and the retry's admin log ----------------------------------------------


def test_job_page_lists_the_attempt_history_oldest_first(superuser_client, failed_job):
    job_id = failed_job(runs=3)

    rows = history_rows(job_page(superuser_client, job_id))

    kept = JobAttempt.objects.filter(job_id=job_id).order_by("attempt")
    assert [row["attempt"] for row in rows] == ["1", "2", "3"]
    assert [row["css"] for row in rows] == ["retrying", "retrying", "failed"]
    assert [row["outcome"] for row in rows] == ["Retrying", "Retrying", "Failed"]
    for row, attempt in zip(rows, kept, strict=True):
        assert row["worker"] == attempt.worker_id and ":" in row["worker"]  # host:pid
        assert SECONDS.match(row["started"]) and SECONDS.match(row["finished"])
        assert row["started"] == attempt.started_at.strftime("%Y-%m-%d %H:%M:%S")
        assert row["duration"].endswith(" s")
        assert row["error_class"] == "builtins.RuntimeError"
        # The first line shows; the traceback is the expandable rest.
        assert row["error"].startswith("RuntimeError: scripted failure")
        assert "Traceback (most recent call last)" in row["error"]


def test_the_traceback_is_folded_in_a_details_element(superuser_client, failed_job):
    page = job_page(superuser_client, failed_job(runs=1))
    assert re.search(
        r"<details><summary>RuntimeError: scripted failure</summary><pre>RuntimeError: scripted failure\s+Traceback",
        page,
    )


def test_a_job_without_history_shows_an_empty_state(superuser_client):
    job_id = scripted.dispatch(action="ok")
    page = job_page(superuser_client, job_id)
    assert history_rows(page) == []
    assert "No attempts recorded." in page


def test_the_history_costs_one_query_whatever_its_length(superuser_client, failed_job):
    def history_queries(job_id: str) -> int:
        with CaptureQueriesContext(connection) as queries:
            job_page(superuser_client, job_id)
        return sum(JobAttempt._meta.db_table in query["sql"] for query in queries.captured_queries)

    assert history_queries(failed_job(runs=1)) == 1
    assert history_queries(failed_job(runs=4)) == 1


def test_a_retry_keeps_the_history_and_logs_who_retried(superuser_client, failed_job):
    job_id = failed_job(runs=3)
    before = list(JobAttempt.objects.filter(job_id=job_id).values_list("pk", flat=True))

    response = retry_in_changelist(superuser_client, job_id)

    assert "Requeued 1 job(s)." in [str(m) for m in response.context["messages"]]
    assert Job.objects.get(pk=job_id).status == "pending"
    assert list(JobAttempt.objects.filter(job_id=job_id).values_list("pk", flat=True)) == before
    # The run after the retry is attempt 1 again, listed after the three before it.
    assert QueueWorker("default").process_once().job_id == job_id
    rows = history_rows(job_page(superuser_client, job_id))
    assert [(row["attempt"], row["css"]) for row in rows] == [
        ("1", "retrying"),
        ("2", "retrying"),
        ("3", "failed"),
        ("1", "retrying"),
    ]

    entry = LogEntry.objects.get(object_id=job_id)
    assert entry.user.username == "boss"
    assert entry.action_flag == CHANGE
    assert entry.get_change_message() == "Retried (was failed after 3 runs: RuntimeError: scripted failure)"

    # The job page links to the admin's History page, which lists the retry.
    history_url = reverse("admin:django_jobs_job_history", args=[job_id])
    assert f'href="{history_url}"' in job_page(superuser_client, job_id)
    history = superuser_client.get(history_url).content.decode()
    assert "Retried (was failed after 3 runs: RuntimeError: scripted failure)" in history
    assert "boss" in history


def test_a_retry_of_a_broker_jobs_audit_row_keeps_its_history(superuser_client, django_capture_on_commit_callbacks):
    # A job that failed on Service Bus (faked in tests) has an audit Job row; the retry
    # re-dispatches it and deletes that row, and the history stays.
    with django_capture_on_commit_callbacks(execute=True):  # a broker's dispatch waits for the commit
        job_id = scripted.using(backend="servicebus", max_retries=0).dispatch(action="raise")
    worker = QueueWorker("servicebus")
    assert worker.process_once().status == "dead-lettered"
    assert Job.objects.get(pk=job_id).backend == "servicebus"
    assert [a.outcome for a in JobAttempt.objects.filter(job_id=job_id)] == ["failed"]

    retry_in_changelist(superuser_client, job_id)

    assert not Job.objects.filter(pk=job_id).exists()
    assert [a.outcome for a in JobAttempt.objects.filter(job_id=job_id)] == ["failed"]
    entry = LogEntry.objects.get(object_id=job_id)
    assert entry.user.username == "boss"
    assert entry.get_change_message() == "Retried (was failed after 1 run: RuntimeError: scripted failure)"

    # The re-dispatched job fails again: a new audit row, whose page shows both attempts.
    assert worker.process_once().status == "dead-lettered"
    rows = history_rows(job_page(superuser_client, job_id))
    assert [(row["attempt"], row["css"]) for row in rows] == [("1", "failed"), ("1", "failed")]


def test_only_the_retried_jobs_are_logged(superuser_client, failed_job):
    failed = failed_job(runs=1)
    done = scripted.dispatch(action="ok")
    QueueWorker("default").process_once()
    retry_in_changelist(superuser_client, failed, done)
    assert list(LogEntry.objects.values_list("object_id", flat=True)) == [failed]


def test_a_staff_user_with_change_permission_retries(staff_client, failed_job):
    job_id = failed_job(runs=2)
    client = staff_client("change_job")
    assert 'value="retry"' in client.get(reverse(CHANGELIST)).content.decode()

    retry_in_changelist(client, job_id)

    assert Job.objects.get(pk=job_id).status == "pending"
    entry = LogEntry.objects.get(object_id=job_id)
    assert (entry.user.username, entry.action_flag) == ("staff", CHANGE)


def test_a_view_only_staff_user_cannot_retry(staff_client, failed_job):
    job_id = failed_job(runs=1)
    client = staff_client("view_job")

    changelist = client.get(reverse(CHANGELIST))
    assert changelist.status_code == 200
    assert 'value="retry"' not in changelist.content.decode()
    assert len(history_rows(job_page(client, job_id))) == 1  # the history is there to read

    # Posting the action anyway changes nothing: the user has no action to run.
    response = retry_in_changelist(client, job_id)

    assert response.status_code == 200
    assert not any("Requeued" in str(m) for m in response.context["messages"])
    assert Job.objects.get(pk=job_id).status == "failed"
    assert not LogEntry.objects.exists()


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0421, "0.042 s"), (12.46, "12.5 s"), (200.4, "3 min 20 s"), (7500, "2 h 5 min")],
)
def test_durations_read_at_a_glance(seconds, text):
    assert duration_text(seconds) == text


def test_a_retry_message_quotes_only_the_errors_first_line():
    long = Job(attempts=2, last_error="\nValueError: " + "x" * 500 + "\nTraceback (most recent call last):\n")
    message = retry_message(long)
    assert message.startswith("Retried (was failed after 2 runs: ValueError: xxx") and message.endswith("…)")
    assert len(message) == len("Retried (was failed after 2 runs: )") + SUMMARY_CHARS
    assert retry_message(Job(attempts=1, last_error="")) == "Retried (was failed after 1 run)"
