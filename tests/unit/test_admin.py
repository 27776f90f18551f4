"""The Job admin, driven through the Django test client as a logged-in superuser."""

from __future__ import annotations

import html
import re
from datetime import timedelta

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_jobs import Jobs
from django_jobs.admin import SUMMARY_CHARS, duration_text, retry_message
from django_jobs.ids import short
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
    error = "\nValueError: " + "x" * 500 + "\nTraceback (most recent call last):\n"
    message = retry_message(Job(status="failed", attempts=2, last_error=error))
    assert message.startswith("Retried (was failed after 2 runs: ValueError: xxx") and message.endswith("…)")
    assert len(message) == len("Retried (was failed after 2 runs: )") + SUMMARY_CHARS
    assert retry_message(Job(status="failed", attempts=1, last_error="")) == "Retried (was failed after 1 run)"
    cancelled = Job(status="cancelled", attempts=0, last_error="Cancelled by boss in the admin")
    assert retry_message(cancelled) == "Retried (was cancelled after 0 runs: Cancelled by boss in the admin)"


# -- the job list: badges, short ids, times to the second, durations, errors ---------------------


def cell(page: str, job_id: str, column: str) -> str:
    """The HTML inside the ``column`` cell of ``job_id``'s row of the job list."""
    row = re.search(rf'<tr>(?:(?!</tr>).)*?value="{job_id}".*?</tr>', page, re.DOTALL)
    assert row, f"job {job_id} is not listed"
    found = re.search(rf'<t[dh] class="field-{column}">(.*?)</t[dh]>', row.group(0), re.DOTALL)
    assert found, f"no {column} column"
    return found.group(1)


def test_the_list_shows_badges_short_ids_and_one_line_cells(superuser_client, failed_job):
    failed = failed_job(runs=1)
    pending = scripted.dispatch(action="ok")
    yesterday = scripted.dispatch(action="ok")
    Job.objects.filter(pk=yesterday).update(created_at=timezone.now() - timedelta(days=1))

    page = superuser_client.get(reverse(CHANGELIST)).content.decode()

    assert cell(page, failed, "status_and_runs") == (
        '<span class="job-status status-failed">Failed</span> <span class="job-meta" title="1 run of 1 allowed">1/1</span>'
    )
    assert cell(page, pending, "status_and_runs") == (
        '<span class="job-status status-pending">Pending</span> '
        '<span class="job-meta" title="0 runs of 1 allowed">0/1</span>'
    )
    handler = "tests.testapp.jobs.scripted"
    assert cell(page, failed, "label") == f'<span class="one-line" title="{handler}">{handler}</span>'
    assert cell(page, failed, "queue_and_backend") == (
        '<span class="one-line" title="default · default">default · default</span>'
    )
    url = reverse("admin:django_jobs_job_change", args=[failed])
    assert cell(page, failed, "short_id") == f'<a href="{url}"><span title="{failed}">{short(failed)}</span></a>'
    # Created today: its time; before: its day; to the second in its tooltip either way.
    created = timezone.localtime(Job.objects.get(pk=failed).created_at)
    assert cell(page, failed, "created_on") == f'<span title="{created:%Y-%m-%d %H:%M:%S}">{created:%H:%M:%S}</span>'
    before = timezone.localtime(Job.objects.get(pk=yesterday).created_at)
    assert cell(page, yesterday, "created_on") == f'<span title="{before:%Y-%m-%d %H:%M:%S}">{before:%Y-%m-%d}</span>'
    assert cell(page, failed, "error_summary") == (
        '<span class="one-line" title="RuntimeError: scripted failure">RuntimeError: scripted failure</span>'
    )
    assert cell(page, pending, "error_summary") == "—"


def test_a_completed_job_shows_no_error_from_a_run_before(superuser_client):
    retried = scripted.using(max_retries=1).dispatch(action="flaky", key="twice", fail_times=1)
    worker = QueueWorker("default")
    for _ in range(2):
        Job.objects.filter(pk=retried).update(available_at=timezone.now())
        assert worker.process_once().job_id == retried
    assert Job.objects.get(pk=retried).status == "completed"
    assert Job.objects.get(pk=retried).last_error.startswith("RuntimeError: flaky failure")
    retrying = scripted.dispatch(action="ok")
    Job.objects.filter(pk=retrying).update(attempts=1, last_error="ValueError: first run")

    page = superuser_client.get(reverse(CHANGELIST)).content.decode()

    assert cell(page, retried, "error_summary") == "—"
    assert "ValueError: first run" in cell(page, retrying, "error_summary")  # pending a retry: shown


def test_the_last_error_column_shows_the_start_of_its_first_line(superuser_client):
    job_id = scripted.dispatch(action="ok")
    first = "ValueError: " + "bad value " * 20
    Job.objects.filter(pk=job_id).update(status="failed", last_error=f"\n{first}\nTraceback (most recent call last):")

    shown = cell(superuser_client.get(reverse(CHANGELIST)).content.decode(), job_id, "error_summary")

    title, text = re.fullmatch(r'<span class="one-line" title="([^"]*)">([^<]*)</span>', shown).groups()
    assert title == first.strip()
    assert len(text) == 60 and text.endswith("…") and first.startswith(text[:-1])


def test_the_time_to_finish_of_a_finished_job_and_the_running_time_of_one_in_progress(superuser_client):
    finished = scripted.dispatch(action="ok")
    running = scripted.dispatch(action="ok")
    waiting = scripted.dispatch(action="ok")
    now = timezone.now()
    Job.objects.filter(pk=finished).update(
        status="completed", created_at=now - timedelta(seconds=200), finished_at=now - timedelta(seconds=75)
    )
    claimed = now - timedelta(hours=2, minutes=5)  # the claim sets updated_at
    Job.objects.filter(pk=running).update(status="in_progress", updated_at=claimed)

    page = superuser_client.get(reverse(CHANGELIST)).content.decode()

    assert cell(page, finished, "duration") == (
        '<span title="Completed 2 min 5 s after it was dispatched (waits and retries included)">2 min 5 s</span>'
    )
    assert re.fullmatch(
        rf'<span class="job-meta" title="running: claimed by a worker 2 h 5 min ago, '
        rf'at {claimed:%Y-%m-%d %H:%M:%S}">2 h 5 min</span>',
        cell(page, running, "duration"),
    )
    assert cell(page, waiting, "duration") == "—"


def test_the_list_links_to_the_dashboard_and_the_workers(superuser_client):
    page = superuser_client.get(reverse(CHANGELIST)).content.decode()
    tools = re.search(r'<ul class="object-tools">(.*?)</ul>', page, re.DOTALL).group(1)
    assert f'<a href="{reverse("admin:django_jobs_jobdashboard_changelist")}">Dashboard</a>' in tools
    assert f'<a href="{reverse("admin:django_jobs_worker_changelist")}">Workers</a>' in tools


def test_the_job_page_shows_its_times_to_the_second(superuser_client, failed_job):
    job_id = failed_job(runs=1)
    page = job_page(superuser_client, job_id)
    job = Job.objects.get(pk=job_id)
    for column, value in [
        ("created", job.created_at),
        ("updated", job.updated_at),
        ("available", job.available_at),
        ("finished", job.finished_at),
    ]:
        shown = re.search(rf'field-{column}".*?<div class="readonly">([^<]*)</div>', page, re.DOTALL)
        assert shown and shown.group(1).strip() == f"{value:%Y-%m-%d %H:%M:%S}", column
    assert '<span class="job-status status-failed">Failed</span>' in page


# -- cancelling, and retrying a cancelled job --------------------------------------------------------


def run_action(client, action: str, *job_ids: str):
    return client.post(reverse(CHANGELIST), {"action": action, "_selected_action": list(job_ids)}, follow=True)


def texts(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def test_the_cancel_action_cancels_the_pending_jobs_selected(superuser_client):
    done = scripted.dispatch(action="ok")
    assert QueueWorker("default").process_once().job_id == done
    running = scripted.dispatch(action="ok")
    assert Jobs.backend("default").fetch("default").token == running  # a worker holds it
    waiting = scripted.dispatch(action="ok")
    unselected = scripted.dispatch(action="ok")

    response = run_action(superuser_client, "cancel", done, running, waiting)

    assert texts(response) == [
        "Cancelled 1 job(s).",
        "2 selected job(s) were not pending or waiting and were left alone.",
    ]
    statuses = dict(Job.objects.values_list("pk", "status"))
    assert statuses == {done: "completed", running: "in_progress", waiting: "cancelled", unselected: "pending"}
    job = Job.objects.get(pk=waiting)
    assert (job.last_error, job.finished_at is not None) == ("Cancelled by boss in the admin", True)
    [attempt] = JobAttempt.objects.filter(job_id=waiting)
    assert (attempt.outcome, attempt.worker_id, attempt.error) == (
        "cancelled",
        "admin:boss",
        "Cancelled by boss in the admin",
    )
    entry = LogEntry.objects.get()
    assert (entry.object_id, entry.user.username, entry.action_flag) == (waiting, "boss", CHANGE)
    assert entry.get_change_message() == "Cancelled (was pending, never run)"
    # The job page shows the cancellation in its history, and offers a retry.
    rows = history_rows(job_page(superuser_client, waiting))
    assert [(row["css"], row["outcome"], row["worker"]) for row in rows] == [("cancelled", "Cancelled", "admin:boss")]
    assert 'class="job-retry"' in job_page(superuser_client, waiting)


def test_the_cancel_action_says_why_nothing_was_cancelled(superuser_client, failed_job):
    failed = failed_job(runs=1)
    response = run_action(superuser_client, "cancel", failed)
    [message] = response.context["messages"]
    assert message.level_tag == "error"
    assert "No job was cancelled" in str(message) and "has no row here until it fails" in str(message)
    assert Job.objects.get(pk=failed).status == "failed"
    assert not LogEntry.objects.exists()


def test_the_retry_action_runs_a_cancelled_job_again(superuser_client):
    job_id = scripted.dispatch(action="ok", key="again")
    run_action(superuser_client, "cancel", job_id)

    response = run_action(superuser_client, "retry", job_id)

    assert "Requeued 1 job(s)." in texts(response)
    assert Job.objects.get(pk=job_id).status == "pending"
    entry = LogEntry.objects.order_by("-id").first()
    assert entry.get_change_message() == "Retried (was cancelled after 0 runs: Cancelled by boss in the admin)"
    assert QueueWorker("default").process_once().job_id == job_id
    assert runs("again") == 1


# -- the job page's Retry and Cancel buttons -------------------------------------------------------


def button_url(action: str, job_id: str) -> str:
    return reverse(f"admin:django_jobs_job_{action}", args=[job_id])


def buttons(page: str) -> list[tuple[str, str]]:
    """The job page's POST forms among its object tools: (action URL, button label)."""
    tools = re.search(r'<ul class="object-tools">(.*?)</ul>', page, re.DOTALL).group(1)
    forms = re.findall(r'<form method="post" action="([^"]+)">.*?<button[^>]*>([^<]+)</button>', tools, re.DOTALL)
    assert all("csrfmiddlewaretoken" in form for form in re.findall(r"<form.*?</form>", tools, re.DOTALL))
    return forms


def test_the_job_page_offers_retry_or_cancel_as_the_status_allows(superuser_client, failed_job):
    failed = failed_job(runs=1)
    pending = scripted.dispatch(action="ok")
    done = scripted.dispatch(action="ok")
    Job.objects.filter(pk=done).update(status="completed")

    assert buttons(job_page(superuser_client, failed)) == [(button_url("retry", failed), "Retry")]
    assert buttons(job_page(superuser_client, pending)) == [(button_url("cancel", pending), "Cancel")]
    assert buttons(job_page(superuser_client, done)) == []


def test_a_running_job_asked_to_abort_says_who_asked_and_when_instead_of_an_abort_button(superuser_client):
    job_id = scripted.dispatch(action="ok")
    assert Jobs.backend("default").fetch("default") is not None
    assert buttons(job_page(superuser_client, job_id)) == [(button_url("abort", job_id), "Abort")]

    response = superuser_client.post(button_url("abort", job_id), follow=True)

    asked_at = Job.objects.get(pk=job_id).abort_requested_at
    note = f"abort requested by admin:boss at {timezone.localtime(asked_at).strftime('%Y-%m-%d %H:%M:%S')}"
    assert texts(response) == [
        "Asked 1 running job(s) to abort: each ends cancelled, its worker stops it within about 11 s."
    ]
    page = response.content.decode()
    assert buttons(page) == []  # not offered again
    tools = re.search(r'<ul class="object-tools">(.*?)</ul>', page, re.DOTALL).group(1)
    assert re.search(rf'<span class="job-state job-aborting" title="{note}">Abort requested</span>', tools)
    status = re.search(
        r'<div class="readonly"><span class="job-status status-in_progress">.*?</div>\s*</div>', page, re.DOTALL
    )
    assert status and html.unescape(re.sub(r"<[^>]+>", " ", status.group(0))).split() == [
        "In",
        "progress",
        *note.split(),
    ]
    listed = superuser_client.get(reverse(CHANGELIST)).content.decode()
    assert note in listed  # the list says "aborting", who asked and when in its tooltip


def test_the_retry_button_requeues_the_job_and_logs_it(superuser_client, failed_job):
    job_id = failed_job(runs=2)

    response = superuser_client.post(button_url("retry", job_id))

    assert response.status_code == 302
    assert response["Location"] == reverse("admin:django_jobs_job_change", args=[job_id])
    assert Job.objects.get(pk=job_id).status == "pending"
    entry = LogEntry.objects.get(object_id=job_id)
    assert (entry.user.username, entry.get_change_message()) == (
        "boss",
        "Retried (was failed after 2 runs: RuntimeError: scripted failure)",
    )
    page = superuser_client.get(response["Location"])
    assert "Requeued 1 job(s)." in texts(page)
    assert buttons(page.content.decode()) == [(button_url("cancel", job_id), "Cancel")]


def test_the_cancel_button_cancels_the_job_and_logs_it(superuser_client):
    job_id = scripted.dispatch(action="ok")

    response = superuser_client.post(button_url("cancel", job_id), follow=True)

    assert response.redirect_chain == [(reverse("admin:django_jobs_job_change", args=[job_id]), 302)]
    assert texts(response) == ["Cancelled 1 job(s)."]
    assert Job.objects.get(pk=job_id).status == "cancelled"
    assert LogEntry.objects.get(object_id=job_id).get_change_message() == "Cancelled (was pending, never run)"


def test_a_button_pressed_too_late_says_so_and_changes_nothing(superuser_client):
    job_id = scripted.dispatch(action="ok")
    assert QueueWorker("default").process_once().job_id == job_id  # it ran while the page was open

    response = superuser_client.post(button_url("cancel", job_id), follow=True)

    assert [m.level_tag for m in response.context["messages"]] == ["error"]
    assert Job.objects.get(pk=job_id).status == "completed"
    assert not LogEntry.objects.exists()


@pytest.mark.parametrize("action", ["retry", "cancel"])
def test_the_buttons_refuse_a_get(superuser_client, failed_job, action):
    job_id = failed_job(runs=1) if action == "retry" else scripted.dispatch(action="ok")
    status = Job.objects.get(pk=job_id).status

    assert superuser_client.get(button_url(action, job_id)).status_code == 405

    assert Job.objects.get(pk=job_id).status == status
    assert not LogEntry.objects.exists()


def test_a_button_for_a_job_that_does_not_exist_goes_to_the_admin_index(superuser_client):
    response = superuser_client.post(button_url("retry", "gone"))
    assert response.status_code == 302 and response["Location"] == reverse("admin:index")


def test_a_view_only_staff_user_sees_no_buttons_and_no_actions_and_cannot_post(staff_client, failed_job):
    failed = failed_job(runs=1)
    pending = scripted.dispatch(action="ok")
    client = staff_client("view_job")

    changelist = client.get(reverse(CHANGELIST)).content.decode()
    assert 'name="action"' not in changelist and 'name="_selected_action"' not in changelist
    for job_id in (failed, pending):
        assert buttons(job_page(client, job_id)) == []
    assert client.post(button_url("retry", failed)).status_code == 403
    assert client.post(button_url("cancel", pending)).status_code == 403
    cancelled = run_action(client, "cancel", pending)
    assert not any("Cancelled" in text for text in texts(cancelled))

    assert dict(Job.objects.values_list("pk", "status")) == {failed: "failed", pending: "pending"}
    assert not LogEntry.objects.exists()


def test_a_staff_user_with_change_permission_gets_the_buttons(staff_client):
    job_id = scripted.dispatch(action="ok")
    client = staff_client("view_job", "change_job")
    assert buttons(job_page(client, job_id)) == [(button_url("cancel", job_id), "Cancel")]
    assert client.post(button_url("cancel", job_id)).status_code == 302
    assert Job.objects.get(pk=job_id).status == "cancelled"
