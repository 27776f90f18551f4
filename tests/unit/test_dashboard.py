"""The admin dashboard: its figures from rows made here (a fixed ``now`` for the windows), its
links into the job list, its charts, an unreachable backend, who may see it, and its cost."""

from __future__ import annotations

import html
import re
from datetime import UTC, datetime, timedelta
from itertools import count

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_jobs import Jobs, charts, dashboard, limits
from django_jobs.admin.dashboard_page import age_text, rate_text
from django_jobs.models import Job, Throughput
from tests.testapp.jobs import scripted

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("clean_state")]

URL = "admin:django_jobs_jobdashboard_changelist"
NOW = datetime(2026, 3, 10, 12, 30, 30, tzinfo=UTC)
DATABASE = {"ENGINE": "database", "OPTIONS": {"DATABASE": "default"}}
ids = count()


@pytest.fixture(autouse=True)
def one_database_backend(settings):
    """The database backend alone, on three queues (the shared settings name six backends)."""
    settings.JOBS = {**settings.JOBS, "BACKENDS": {"default": DATABASE}, "QUEUES": ["default", "emails", "reports"]}


def tick(minute: datetime, worker: str = "w1", backend: str = "default", queue: str = "default", **counts: int) -> None:
    Throughput.objects.create(minute=minute, worker=worker, backend=backend, queue=queue, **counts)


def make_job(status: str = "pending", queue: str = "default", backend: str = "default", **fields) -> str:
    job_id = f"job-{next(ids)}"
    Job.objects.create(
        id=job_id, status=status, queue=queue, backend=backend, handler=fields.pop("handler", "h"), **fields
    )
    return job_id


def page(client) -> str:
    response = client.get(reverse(URL))
    assert response.status_code == 200
    return response.content.decode()


# -- Throughput and failure rates ---------------------------------------------------------------


def test_throughput_sums_workers_and_minutes_within_each_window():
    minute = NOW.replace(second=0)  # 12:30, the current minute
    tick(minute, "w1", completed=5, failed=1, retried=2, rejected=1)
    tick(minute, "w2", completed=3, failed=1)  # another worker, the same minute
    tick(minute - timedelta(minutes=59), "w1", completed=2)  # 11:31: the oldest minute of the last hour
    tick(NOW - timedelta(hours=1), "w1", completed=100)  # 11:30:30 exactly: outside the last hour
    tick(minute - timedelta(hours=23, minutes=59), "w3", failed=4)  # inside the last day
    tick(NOW - timedelta(days=1), "w3", completed=1000)  # exactly a day before: outside
    tick(minute + timedelta(minutes=1), "w1", completed=7)  # after now
    tick(minute, "w9", backend="gone", completed=1)  # a backend no longer configured

    rows = {row.backend: row for row in dashboard.throughput(NOW)}

    assert rows["default"].hour == dashboard.Counts(completed=10, retried=2, failed=2, rejected=1)
    assert rows["default"].day == dashboard.Counts(completed=110, retried=2, failed=6, rejected=1)
    assert rows["default"].hour.failure_rate == pytest.approx(2 / 12)
    assert rows["gone"].day.completed == 1
    assert rows[""].day == dashboard.Counts(completed=111, retried=2, failed=6, rejected=1)  # the total
    assert list(rows)[-1] == ""


def test_failure_rate_is_unknown_when_nothing_finished():
    tick(NOW.replace(second=0), retried=3, rejected=2)
    (row, total) = dashboard.throughput(NOW)
    assert row.hour.failure_rate is None and total.day.failure_rate is None
    assert rate_text(None) == "—"
    assert rate_text(0.025) == "2.5 %"


def test_hourly_buckets_end_with_the_current_hour():
    tick(NOW.replace(minute=5, second=0), "w1", completed=4, failed=1)  # 12:05
    tick(NOW.replace(minute=0, second=0), "w2", completed=2)  # 12:00, another worker
    tick(datetime(2026, 3, 9, 13, 0, tzinfo=UTC), "w1", failed=3)  # the oldest hour shown
    tick(datetime(2026, 3, 9, 12, 59, tzinfo=UTC), "w1", completed=50)  # before it

    buckets = dashboard.hourly(NOW)

    assert len(buckets) == 24
    assert buckets[-1] == dashboard.HourBucket(datetime(2026, 3, 10, 12, tzinfo=UTC), 6, 1)
    assert buckets[0].start == datetime(2026, 3, 9, 13, tzinfo=UTC) and buckets[0].failed == 3
    assert sum(b.completed for b in buckets) == 6


def test_hourly_buckets_are_hours_of_the_current_time_zone():
    tick(datetime(2026, 3, 10, 12, 30, tzinfo=UTC), completed=2)  # 18:00 in India (UTC+5:30)
    tick(datetime(2026, 3, 10, 12, 25, tzinfo=UTC), completed=5)  # 17:55 there: the hour before

    with timezone.override("Asia/Kolkata"):
        buckets = dashboard.hourly(NOW)  # 18:00:30 there

    assert buckets[-1].start == datetime(2026, 3, 10, 12, 30, tzinfo=UTC) and buckets[-1].start.hour == 18
    assert (buckets[-1].completed, buckets[-2].completed) == (2, 5)


# -- Failing handlers ---------------------------------------------------------------------------


def test_failing_handlers_counts_failed_rows_of_every_backend_in_the_last_day():
    make_job("failed", handler="app.send", finished_at=NOW - timedelta(hours=2), last_error="Old\ntrace")
    make_job("failed", handler="app.send", finished_at=NOW - timedelta(minutes=5), last_error="\nSMTPError: down\nx")
    make_job("failed", handler="app.send", backend="redis", finished_at=NOW - timedelta(hours=3))  # audit row
    make_job("failed", handler="app.report", finished_at=NOW - timedelta(hours=1), last_error="KeyError")
    make_job("failed", handler="app.report", finished_at=NOW - timedelta(days=1))  # outside the day
    make_job("completed", handler="app.report", finished_at=NOW - timedelta(hours=1))

    top = dashboard.failing_handlers(NOW)

    assert [(entry.handler, entry.failures) for entry in top] == [("app.send", 3), ("app.report", 1)]
    assert top[0].last_error.startswith("\nSMTPError") and top[0].last_failed == NOW - timedelta(minutes=5)


def test_failing_handlers_link_to_the_failed_jobs_of_that_handler(admin_client):
    send = {make_job("failed", handler="app.send", finished_at=timezone.now() - timedelta(minutes=1))}
    send.add(make_job("failed", handler="app.send", finished_at=timezone.now(), last_error="\nSMTPError: down\nx"))
    make_job("failed", handler="app.other", finished_at=timezone.now())
    make_job("pending", handler="app.send")

    response = admin_client.get(reverse(URL))
    (entry, error, url) = response.context["failing_handlers"][0]

    assert (entry.handler, error) == ("app.send", "SMTPError: down")
    assert "handler=app.send&status__exact=failed" in url
    assert listed(admin_client, url) == send


# -- The queue table and its links --------------------------------------------------------------


def listed(client, url: str) -> set[str]:
    response = client.get(url)
    assert response.status_code == 200
    return {job.pk for job in response.context["cl"].result_list}


def test_each_count_links_to_exactly_the_jobs_it_counts(admin_client):
    past, future = timezone.now() - timedelta(minutes=5), timezone.now() + timedelta(hours=1)
    expected = {
        "pending": {make_job(queue="emails", available_at=past) for _ in range(2)},
        "delayed": {make_job(queue="emails", available_at=future)},
        "in_progress": {make_job("in_progress", queue="emails")},
        "failed": {make_job("failed", queue="emails") for _ in range(3)},
        "cancelled": {make_job("cancelled", queue="emails")},
        "waiting": {make_job("waiting", queue="emails") for _ in range(2)},
    }
    make_job("failed", queue="default")  # another queue
    make_job("failed", queue="emails", backend="other")  # another backend

    response = admin_client.get(reverse(URL))
    emails = next(cells for row, cells, _ in response.context["queue_rows"] if row.queue == "emails")

    assert [cell.value for cell in emails] == [len(jobs) for jobs in expected.values()]
    for cell, jobs in zip(emails, expected.values(), strict=True):
        assert listed(admin_client, cell.url) == jobs
    assert "?status__exact=failed&queue=emails&backend=default" in emails[3].url
    assert html.escape(emails[3].url) in response.content.decode()


def test_oldest_ready_age_reads_at_a_glance():
    assert age_text(None) == "—"
    assert age_text(42.7) == "42 s"
    assert age_text(200) == "3 min 20 s"
    assert age_text(7500) == "2 h 5 min"


def test_an_unreachable_backend_shows_its_error_and_the_rest_renders(admin_client, settings):
    closed = {"ENGINE": "redis", "OPTIONS": {"URL": "redis://127.0.0.1:1/0", "PREFIX": "unreachable"}}
    settings.JOBS = {**settings.JOBS, "BACKENDS": {"default": DATABASE, "down": closed}}
    make_job(queue="emails", available_at=timezone.now() - timedelta(seconds=1))

    response = admin_client.get(reverse(URL))

    assert response.status_code == 200
    rows = {(row.backend, row.queue): row for row, _, _ in response.context["queue_rows"]}
    assert "ConnectionError" in rows["down", "emails"].error
    assert not rows["default", "emails"].error and rows["default", "emails"].pending == 1
    assert "Could not read this backend: ConnectionError" in response.content.decode()
    assert 'id="jobs-hourly"' in response.content.decode()


# -- Limits -------------------------------------------------------------------------------------


def test_the_limits_table_shows_each_limits_use_against_its_caps(admin_client, settings):
    table = {"queue:emails": {"concurrency": 2, "rate": "10/m"}, "handler:other.job": {"rate": "5/s"}}
    settings.JOBS = {**settings.JOBS, "LIMITS": table}
    scripted.using(queue="emails").dispatch(action="ok")
    backend = Jobs.backend("default")
    lease = backend.fetch("emails")
    assert lease is not None and lease.envelope is not None
    assert backend.acquire(lease, limits.limits_for(lease.envelope.handler, "emails")) is None

    text = page(admin_client)

    cells = re.findall(
        r"<tr>\s*<td>(.*?)</td><td>(.*?)</td>\s*<td>(.*?)</td><td>(.*?)</td>\s*<td>(.*?)</td>\s*<td>(.*?)</td>", text
    )
    assert ("handler:other.job", "default", "—", "0 / 5/s", "0", "0") in cells
    assert ("queue:emails", "default", "1 / 2", "1 / 10/m", "0", "0") in cells


def test_without_limits_there_is_no_limits_table(admin_client):
    assert 'id="jobs-limits"' not in page(admin_client)


def test_bad_limits_show_their_error_and_the_rest_renders(admin_client, settings):
    settings.JOBS = {**settings.JOBS, "LIMITS": {"queue:emails": {"rate": "often"}}}

    text = page(admin_client)

    assert "JOBS[&#x27;LIMITS&#x27;] is wrong: LIMITS[&#x27;queue:emails&#x27;]: bad rate" in text
    assert 'id="jobs-hourly"' in text


# -- Charts -------------------------------------------------------------------------------------


def test_nice_ticks_are_round_and_reach_the_peak():
    assert charts.nice_ticks(0) == [0, 1]
    assert charts.nice_ticks(7) == [0, 2, 4, 6, 8]
    assert charts.nice_ticks(130) == [0, 50, 100, 150]


def test_column_chart_labels_its_axes_bars_and_peak():
    svg = charts.column_chart(
        ["10", "11"],
        ["10:00", "11:00"],
        [charts.Series("completed", "#000", [3, 12]), charts.Series("failed", "#111", [1, 0])],
        title="T",
        x_label="hour (UTC)",
        y_label="jobs per hour",
        chart_id="c",
    )
    assert ">jobs per hour</text>" in svg and ">hour (UTC)</text>" in svg
    assert (
        "<title>10:00: 3 completed, 1 failed</title>" in svg and "<title>11:00: 12 completed, 0 failed</title>" in svg
    )
    assert re.search(r">0</text>.*>5</text>.*>10</text>.*>15</text>", svg)  # y ticks
    assert '<text x="' in svg and 'font-weight="bold">12</text>' in svg  # the peak
    assert ">completed</text>" in svg and ">failed</text>" in svg  # the legend


def test_bar_chart_escapes_labels():
    svg = charts.bar_chart(
        ["default / <script>alert(1)</script>"],
        [charts.Series("pending", "#000", [2])],
        title="T",
        x_label="jobs",
        chart_id="d",
    )
    assert "<script>" not in svg
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in svg


def test_the_page_escapes_a_hostile_queue_name(admin_client, settings):
    hostile = "<script>alert(1)</script>"
    settings.JOBS = {**settings.JOBS, "QUEUES": ["default", hostile]}
    make_job(queue=hostile, available_at=timezone.now() - timedelta(seconds=1))

    content = page(admin_client)

    assert "<script>alert(1)" not in content
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in content
    depth = re.search(r'<svg[^>]*id="jobs-depth".*?</svg>', content, re.DOTALL)
    assert depth and "default / &lt;script&gt;alert(1)&lt;/script&gt;: 1 pending" in depth.group(0)


# -- The page and who may see it ----------------------------------------------------------------


def test_page_chrome_has_one_heading_breadcrumbs_and_links(admin_client):
    content = page(admin_client)

    assert content.count("<h1") == 1 and "<h1>Jobs dashboard</h1>" in content
    crumbs = re.search(r'<ol class="breadcrumbs">(.*?)</ol>', content, re.DOTALL)
    assert crumbs
    assert f'href="{reverse("admin:index")}"' in crumbs.group(1)
    assert f'href="{reverse("admin:app_list", args=["django_jobs"])}"' in crumbs.group(1)
    assert "Dashboard" in crumbs.group(1)
    assert f'href="{reverse("admin:django_jobs_job_changelist")}"' in content
    assert f'href="{reverse("admin:django_jobs_worker_changelist")}"' in content
    assert content.count('<svg xmlns="http://www.w3.org/2000/svg" class="jobs-chart"') == 2


def test_the_job_list_links_to_the_dashboard_and_anonymous_users_log_in_first(admin_client, client):
    assert reverse(URL).encode() in admin_client.get(reverse("admin:django_jobs_job_changelist")).content
    response = client.get(reverse(URL))
    assert response.status_code == 302 and "/login/" in response["Location"]


def test_a_view_only_staff_user_sees_the_dashboard_and_finds_it_on_the_index(staff_client):
    client = staff_client("view_job")
    assert "Jobs dashboard" in page(client)
    assert reverse(URL) in client.get(reverse("admin:index")).content.decode()


def test_a_staff_user_who_may_not_view_jobs_is_refused(staff_client):
    assert staff_client("view_worker").get(reverse(URL)).status_code == 403


def test_a_user_who_is_not_staff_is_sent_to_the_login_page(staff_client):
    response = staff_client("view_job", is_staff=False).get(reverse(URL))
    assert response.status_code == 302 and "/login/" in response["Location"]


# -- Query cost ---------------------------------------------------------------------------------


def fill(rows: int, worker: str) -> None:
    now = timezone.now().replace(second=0, microsecond=0)
    for i in range(rows):
        tick(
            now - timedelta(minutes=i % 1440),
            f"{worker}{i}",
            queue=("default", "emails")[i % 2],
            completed=i,
            failed=i % 3,
        )
        make_job(("pending", "failed", "cancelled", "in_progress")[i % 4], queue="emails", handler=f"h{i % 7}",
                 finished_at=now - timedelta(minutes=i))  # fmt: skip


def test_the_page_costs_the_same_queries_for_10_or_200_rows(admin_client):
    admin_client.get(reverse(URL))  # the session and user are cached the same way in both runs
    costs = []
    for rows, worker in ((10, "a"), (190, "b")):
        fill(rows, worker)
        with CaptureQueriesContext(connection) as queries:
            page(admin_client)
        costs.append(len(queries))
    assert costs[0] == costs[1]
    assert Throughput.objects.count() == 200
