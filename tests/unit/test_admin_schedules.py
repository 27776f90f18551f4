"""The schedules admin: the list, the schedule page and its ticks, the "run now" action."""

from __future__ import annotations

import html
import re
import types
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_jobs.models import Job, Schedule, ScheduleTick
from django_jobs.scheduler import Scheduler
from tests.testapp.jobs import scripted

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("clean_state")]

CHANGELIST = "admin:django_jobs_schedule_changelist"
# 03:00:07 UTC on a winter day: 12:00:07 in Tokyo, the admin's zone in these tests.
NEXT = datetime(2026, 1, 6, 3, 0, 7, tzinfo=UTC)
LAST = datetime(2026, 1, 5, 3, 0, 7, tzinfo=UTC)


@pytest.fixture(autouse=True)
def admin_zone(settings):
    settings.TIME_ZONE = "Asia/Tokyo"


@pytest.fixture
def rows():
    """Four schedules: one enabled whose last job has a row, one whose last job has none (a
    broker's), one disabled in the settings, one taken out of the settings."""
    job_id = scripted.dispatch(action="ok")
    nightly = Schedule.objects.create(
        name="nightly-report",
        definition={"job": "shop.jobs.report", "daily": "03:00", "kwargs": {"full": True}},
        description="daily at 03:00 (Europe/Paris)",
        time_zone="Europe/Paris",
        next_run=NEXT,
        last_run=LAST,
        last_job_id=job_id,
    )
    for day in range(3):
        tick = LAST - timedelta(days=day)
        ScheduleTick.objects.create(schedule=nightly, tick=tick, job_id=f"old-{day}", dispatched_at=tick)
    ScheduleTick.objects.create(schedule=nightly, tick=NEXT, job_id=job_id)  # claimed, not dispatched yet
    poll = Schedule.objects.create(
        name="poll-feeds", description="every 5 minutes", time_zone="UTC", last_run=LAST, last_job_id="f" * 32
    )
    paused = Schedule.objects.create(name="paused", description="hourly at :15", enabled=False)
    removed = Schedule.objects.create(name="removed", description="weekly", enabled=False, in_settings=False)
    return types.SimpleNamespace(job_id=job_id, nightly=nightly, poll=poll, paused=paused, removed=removed)


@pytest.fixture
def run_now(monkeypatch):
    """``Scheduler.run_now`` replaced by a recorder: returns ``job-<name>`` (or raises what
    ``fail[name]`` holds); ``.calls`` lists the names it was asked for."""
    recorder = types.SimpleNamespace(calls=[], fail={})

    def fake(self, name):
        recorder.calls.append(name)
        if name in recorder.fail:
            raise recorder.fail[name]
        return f"job-{name}"

    monkeypatch.setattr(Scheduler, "run_now", fake)
    return recorder


def text(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def list_cells(page: str) -> dict[str, dict[str, str]]:
    """The changelist's rows by schedule name: each cell's HTML by column."""
    table = {}
    for row in re.findall(r"<tr>(.*?)</tr>", page.split('id="result_list"', 1)[1], re.DOTALL):
        cells = dict(re.findall(r'<t[hd] class="field-(\w+)"[^>]*>(.*?)</t[hd]>', row, re.DOTALL))
        if cells:
            table[text(cells["name_and_schedule"].split("<div", 1)[0])] = cells
    return table


def listed(client, **params) -> list[str]:
    response = client.get(reverse(CHANGELIST), params)
    assert response.status_code == 200
    return [schedule.name for schedule in response.context["cl"].result_list]


def schedule_page(client, name: str) -> str:
    response = client.get(reverse("admin:django_jobs_schedule_change", args=[name]))
    assert response.status_code == 200
    return response.content.decode()


def tick_rows(page: str) -> list[list[str]]:
    section = re.search(r'<fieldset class="module" id="schedule-ticks".*?</fieldset>', page, re.DOTALL)
    assert section, "the schedule page has no tick table"
    body = re.search(r"<tbody>(.*?)</tbody>", section.group(0), re.DOTALL)
    if body is None:
        return []
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", body.group(1), re.DOTALL)
    return [[text(cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.DOTALL)] for row in rows]


def run_action(client, *names: str):
    return client.post(reverse(CHANGELIST), {"action": "run_now", "_selected_action": list(names)}, follow=True)


def texts(response) -> list[str]:
    return [str(message) for message in response.context["messages"]]


# -- the list ---------------------------------------------------------------------------------------


def test_the_list_shows_words_times_to_the_second_last_jobs_and_states(admin_client, rows):
    page = admin_client.get(reverse(CHANGELIST)).content.decode()
    cells = list_cells(page)

    assert list(cells) == ["nightly-report", "paused", "poll-feeds", "removed"]
    nightly = cells["nightly-report"]
    # The words, and the zone unless the words hold it already.
    assert text(nightly["name_and_schedule"]) == "nightly-report daily at 03:00 (Europe/Paris)"
    assert text(cells["poll-feeds"]["name_and_schedule"]) == "poll-feeds every 5 minutes · UTC"
    # In the admin's zone, to the second; no scheduler passes over these rows.
    assert text(nightly["next"]) == "2026-01-06 12:00:07 overdue: no scheduler running"
    assert text(nightly["last"]) == "2026-01-05 12:00:07"
    assert f'href="{reverse("admin:django_jobs_job_change", args=[rows.job_id])}"' in nightly["last_job"]
    assert text(nightly["dispatched"]) == "3"  # the tick not dispatched yet is not counted

    poll = cells["poll-feeds"]
    assert "<a " not in poll["last_job"] and f'title="{"f" * 32}"' in poll["last_job"]  # no Job row: text
    assert text(poll["next"]) == "—" and text(poll["dispatched"]) == "0"

    assert text(nightly["state_badge"]) == "enabled"
    assert text(cells["paused"]["state_badge"]) == "disabled"
    assert text(cells["removed"]["state_badge"]) == "removed from settings"
    assert 'class="job-status status-completed"' in nightly["state_badge"]
    assert "cannot be changed here" in page


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"enabled__exact": "1"}, ["nightly-report", "poll-feeds"]),
        ({"enabled__exact": "0"}, ["paused", "removed"]),
        ({"in_settings__exact": "0"}, ["removed"]),
        ({"q": "feeds"}, ["poll-feeds"]),
    ],
)
def test_filters_and_search(admin_client, rows, params, expected):
    assert listed(admin_client, **params) == expected


def test_the_list_costs_the_same_queries_however_many_ticks(admin_client, rows):
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert admin_client.get(reverse(CHANGELIST)).status_code == 200
        return len(captured)

    before = queries()
    for minute in range(1, 40):
        ScheduleTick.objects.create(
            schedule=rows.poll, tick=LAST - timedelta(minutes=minute), job_id=f"j{minute}", dispatched_at=LAST
        )
    assert queries() == before
    assert text(list_cells(admin_client.get(reverse(CHANGELIST)).content.decode())["poll-feeds"]["dispatched"]) == "39"


# -- no scheduler running ----------------------------------------------------------------------------


def warning(page: str) -> str:
    found = re.search(r'<li class="warning" id="no-scheduler">(.*?)</li>', page, re.DOTALL)
    return html.unescape(re.sub(r"<[^>]+>", "", found.group(1))) if found else ""


def test_without_a_scheduler_for_a_minute_the_list_warns_and_says_a_past_next_run_is_overdue(admin_client, rows):
    now = timezone.now()
    Schedule.objects.filter(name="nightly-report").update(next_run=now - timedelta(minutes=3))
    Schedule.objects.filter(name="poll-feeds").update(next_run=now + timedelta(minutes=3))
    last = now - timedelta(seconds=61)
    Schedule.objects.update(last_pass_at=last)

    page = admin_client.get(reverse(CHANGELIST)).content.decode()

    when = timezone.localtime(last).strftime("%Y-%m-%d %H:%M:%S")
    assert warning(page) == (
        f"No scheduler has passed for over a minute (the last pass: {when}): enabled schedules are not "
        "dispatched. Run manage.py jobs_schedule, or jobs_work --with-scheduler."
    )
    cells = list_cells(page)
    assert text(cells["nightly-report"]["next"]).endswith(" overdue: no scheduler running")
    assert "overdue" not in cells["poll-feeds"]["next"]  # still to come
    detail = schedule_page(admin_client, "nightly-report")
    assert "overdue: no scheduler running" in detail and when in detail  # its page says so, and the last pass


def test_no_pass_ever_recorded_is_warned_about_too(admin_client, rows):
    assert warning(admin_client.get(reverse(CHANGELIST)).content.decode()).startswith(
        "No scheduler has passed for over a minute (none recorded):"
    )


def test_a_scheduler_passing_within_the_minute_leaves_the_list_quiet(admin_client, rows):
    now = timezone.now()
    Schedule.objects.filter(name="poll-feeds").update(last_pass_at=now - timedelta(seconds=50))
    Schedule.objects.filter(name="nightly-report").update(next_run=now + timedelta(minutes=3))

    page = admin_client.get(reverse(CHANGELIST)).content.decode()

    assert warning(page) == ""
    assert not [cells["next"] for cells in list_cells(page).values() if "overdue" in cells["next"]]


def test_without_an_enabled_schedule_there_is_nothing_to_warn_about(admin_client, rows):
    Schedule.objects.update(enabled=False)
    assert warning(admin_client.get(reverse(CHANGELIST)).content.decode()) == ""


# -- read-only ---------------------------------------------------------------------------------------


def test_schedules_are_read_only(admin_client, rows):
    page = admin_client.get(reverse(CHANGELIST)).content.decode()
    assert "/admin/django_jobs/schedule/add/" not in page
    assert 'value="delete_selected"' not in page
    assert admin_client.get(reverse("admin:django_jobs_schedule_add")).status_code == 403
    assert admin_client.post(reverse("admin:django_jobs_schedule_delete", args=["paused"])).status_code == 403

    detail = schedule_page(admin_client, "paused")
    form = detail.split('id="schedule_form"', 1)[1].split("</form>")[0]
    assert re.findall(r"<(?:input|select|textarea|button)\b[^>]*>", form) == [
        re.search(r'<input type="hidden" name="csrfmiddlewaretoken"[^>]*>', form).group(0)
    ]
    assert 'class="closelink">Close</a>' in form
    admin_client.post(reverse("admin:django_jobs_schedule_change", args=["paused"]), {"enabled": "on"})
    assert Schedule.objects.get(pk="paused").enabled is False


# -- the schedule page -------------------------------------------------------------------------------


def test_the_page_shows_the_definition_and_the_latest_ticks(admin_client, rows):
    ScheduleTick.objects.create(schedule=rows.nightly, tick=LAST + timedelta(hours=1), job_id="m1", manual=True)
    ScheduleTick.objects.filter(tick=LAST - timedelta(days=2)).update(dispatched_at=None, abandoned_at=NEXT)
    page = schedule_page(admin_client, "nightly-report")

    assert "&quot;daily&quot;: &quot;03:00&quot;" in page and "&quot;full&quot;: true" in page  # pretty JSON
    ticks = tick_rows(page)
    assert [row[:2] for row in ticks] == [
        ["2026-01-06 12:00:07", "scheduled"],
        ["2026-01-05 13:00:07", "manual"],
        ["2026-01-05 12:00:07", "scheduled"],
        ["2026-01-04 12:00:07", "scheduled"],
        ["2026-01-03 12:00:07", "scheduled"],
    ]
    assert ticks[0][4] == "not yet" and ticks[2][4] == "2026-01-05 12:00:07"
    assert ticks[4][4] == "never (abandoned 2026-01-06 12:00:07)"
    link = f'href="{reverse("admin:django_jobs_job_change", args=[rows.job_id])}"'
    section = page.split('id="schedule-ticks"', 1)[1]
    assert section.count(link) == 1  # only the tick whose job has a row links to it
    assert ticks[1][2] == "m1"


def test_the_page_lists_the_newest_25_ticks_in_as_many_queries_as_for_one(admin_client, rows):
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            schedule_page(admin_client, "poll-feeds")
        return len(captured)

    ScheduleTick.objects.create(schedule=rows.poll, tick=LAST, job_id="first", dispatched_at=LAST)
    one = queries()
    for minute in range(1, 40):
        ScheduleTick.objects.create(
            schedule=rows.poll, tick=LAST - timedelta(minutes=minute), job_id=f"j{minute}", dispatched_at=LAST
        )
    assert queries() == one
    ticks = tick_rows(schedule_page(admin_client, "poll-feeds"))
    assert len(ticks) == 25 and ticks[0][2] == "first" and ticks[-1][2] == "j24"


def test_a_schedule_without_ticks_says_so(admin_client, rows):
    page = schedule_page(admin_client, "paused")
    assert tick_rows(page) == [] and "No tick yet." in page


# -- run now -----------------------------------------------------------------------------------------


def test_run_now_dispatches_enabled_schedules_logs_and_names_the_jobs(admin_client, rows, run_now):
    response = run_action(admin_client, "nightly-report", "poll-feeds")

    assert sorted(run_now.calls) == ["nightly-report", "poll-feeds"]
    assert "Ran 2 schedule(s) now: job(s) job-nightly-report, job-poll-feeds." in texts(response)
    logged = dict(LogEntry.objects.values_list("object_id", "change_message"))
    assert logged == {"nightly-report": "Ran now: job job-nightly-report", "poll-feeds": "Ran now: job job-poll-feeds"}
    assert set(LogEntry.objects.values_list("action_flag", flat=True)) == {CHANGE}


def test_run_now_refuses_disabled_and_removed_schedules(admin_client, rows, run_now):
    response = run_action(admin_client, "paused", "removed", "poll-feeds")

    assert run_now.calls == ["poll-feeds"]
    assert "Not run: paused (disabled), removed (removed from settings). Only enabled schedules can run." in texts(
        response
    )
    assert list(LogEntry.objects.values_list("object_id", flat=True)) == ["poll-feeds"]


def test_run_now_reports_a_failure_and_runs_the_others(admin_client, rows, run_now):
    run_now.fail["nightly-report"] = ConnectionError("broker down")
    response = run_action(admin_client, "nightly-report", "poll-feeds")

    assert "nightly-report was not run: broker down" in texts(response)
    assert "Ran 1 schedule(s) now: job(s) job-poll-feeds." in texts(response)
    assert list(LogEntry.objects.values_list("object_id", flat=True)) == ["poll-feeds"]


def test_a_view_only_staff_user_reads_but_has_no_action(staff_client, rows, run_now):
    client = staff_client("view_schedule")
    page = client.get(reverse(CHANGELIST)).content.decode()
    assert "nightly-report" in page
    assert 'name="action"' not in page and 'name="_selected_action"' not in page
    assert len(tick_rows(schedule_page(client, "nightly-report"))) == 4

    response = run_action(client, "nightly-report")
    assert run_now.calls == [] and not LogEntry.objects.exists()
    assert not any("Ran" in message for message in texts(response))


def test_a_staff_user_who_may_change_schedules_runs_one_now(staff_client, rows, run_now):
    client = staff_client("view_schedule", "change_schedule")
    assert 'value="run_now"' in client.get(reverse(CHANGELIST)).content.decode()

    run_action(client, "nightly-report")

    assert run_now.calls == ["nightly-report"]
    entry = LogEntry.objects.get(object_id="nightly-report")
    assert (entry.user.username, entry.change_message) == ("staff", "Ran now: job job-nightly-report")
    assert Job.objects.filter(pk=rows.job_id).exists()


def test_run_now_dispatches_the_real_job_as_a_manual_tick(admin_client, settings):
    settings.JOBS = {
        **settings.JOBS,
        "SCHEDULE": {"report": {"job": "tests.testapp.jobs.scripted", "kwargs": {"action": "ok"}, "daily": "03:00"}},
    }
    Scheduler().sync()

    response = run_action(admin_client, "report")

    [tick] = ScheduleTick.objects.filter(schedule_id="report")
    assert tick.manual and tick.dispatched_at is not None
    job = Job.objects.get(pk=tick.job_id)
    assert (job.handler, job.status, job.payload["kwargs"]) == (
        "tests.testapp.jobs.scripted",
        "pending",
        {"action": "ok"},
    )
    assert tick.job_id in response.content.decode()
    assert LogEntry.objects.get(object_id="report").get_change_message() == f"Ran now: job {tick.job_id}"
