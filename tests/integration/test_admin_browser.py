"""The job admin in a real browser: headless Debian chromium, driven by selenium through
``/usr/bin/chromedriver``, against pytest-django's ``live_server``.

A superuser logs in through the login form and reads the job list (a badge per status, short
ids, one line per job and no horizontal scrolling at 1280 px with the nav sidebar open, long
names and errors cut with an ellipsis and whole in their tooltips), opens a job that failed after
three runs, reads its attempt history, retries it with the job page's Retry button, finds the
retry in the job's History page, and cancels a pending job with the list's Cancel action. A
staff user who may only view jobs reads the list, a job page and the dashboard, is offered no
action and no button, a POST to the retry URL is refused, and the workers panel is theirs only
with the ``view_worker`` permission (and then without a delete action).

The dashboard, over jobs, failures and per-minute counts of the database backend and Redis: its
queue table's counts, its two charts, a failed count that opens the job list filtered to those
jobs, and the handlers failing most. The workers panel, over a running, a stopped and a dead
worker: state badges, the name of each one's job over its id, the running one's job linked to its
page, the "dead" filter. The schedules list, after the last scheduler stopped ten minutes ago
(by the clock it was given): its warning, a past next run said to be overdue; then after a pass.

Full-page screenshots (1280 px wide) go to ``test-artifacts/admin/``.
``JOBS_UPDATE_DOC_SCREENSHOTS=1`` also copies the job list's, the job page's, the dashboard's,
the workers panel's and the schedules list's to ``docs/images/admin-changelist.png``,
``admin-job-history.png``, ``admin-dashboard.png``, ``admin-workers.png`` and
``admin-schedules.png``, the screenshots the docs show.

Without chromium, chromedriver or selenium the test skips locally and fails under ``CI=true``
(so do the dashboard's, without Redis). Selenium is given the driver's path, so selenium-manager
never runs (and never downloads).
"""

from __future__ import annotations

import base64
import os
import shutil
import struct
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from django.conf import settings
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission
from django.urls import reverse
from django.utils import timezone

from django_jobs import Jobs, operations
from django_jobs.ids import short
from django_jobs.models import Job, JobAttempt, Throughput, Worker
from django_jobs.scheduler import Scheduler
from django_jobs.schedules import parse_entry
from django_jobs.worker import QueueWorker
from tests.conftest import require_service
from tests.procs import REPO_ROOT
from tests.testapp.jobs import remember, scripted

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WIDTH, HEIGHT = 1280, 900  # a laptop's screen: what shows of a page before scrolling
ARTIFACTS = REPO_ROOT / "test-artifacts" / "admin"
DOC_IMAGES = REPO_ROOT / "docs" / "images"
RETRIED = "Retried (was failed after 3 runs: RuntimeError: scripted failure)"
PASSWORD = "pw-for-tests-only"
IMPLICIT_WAIT = 5  # seconds find_element waits for an element to appear
# A first line longer than the job list shows (the list cuts it, its tooltip holds it all).
LONG_ERROR = (
    "requests.exceptions.ConnectionError: HTTPSConnectionPool(host='api.example.com', port=443): "
    "Max retries exceeded with url: /v1/charges\nTraceback (most recent call last):\n  ..."
)

pytestmark = pytest.mark.usefixtures("clean_state")


@pytest.fixture
def browser() -> Iterator[Any]:
    """A headless chromium, 1280x900, driven through Debian's chromedriver."""
    require_service("chromium", CHROMIUM.is_file(), f"{CHROMIUM} is missing (apt-get install chromium)")
    require_service(
        "chromedriver", CHROMEDRIVER.is_file(), f"{CHROMEDRIVER} is missing (apt-get install chromium-driver)"
    )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        require_service("selenium", False, f"{exc} (pip install -e '.[test]')")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={WIDTH},{HEIGHT}"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.implicitly_wait(IMPLICIT_WAIT)
    try:
        yield driver
    finally:
        driver.quit()


def screenshot(driver: Any, name: str) -> Path:
    """The whole page, ``WIDTH`` px wide, saved as ``test-artifacts/admin/<name>.png``."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    metrics = {"width": WIDTH, "height": height, "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    try:
        shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    png = base64.b64decode(shot["data"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (WIDTH, height)  # IHDR: width, height
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    path.write_bytes(png)
    return path


def for_docs(shot: Path, name: str) -> None:
    """With ``JOBS_UPDATE_DOC_SCREENSHOTS=1``: copy ``shot`` to ``docs/images/<name>.png``."""
    if os.environ.get("JOBS_UPDATE_DOC_SCREENSHOTS") == "1":
        DOC_IMAGES.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, DOC_IMAGES / f"{name}.png")


def log_in(driver: Any, live_server: Any, username: str) -> None:
    """Through the login form; the admin sends us on to the job list."""
    from selenium.webdriver.common.by import By

    driver.get(f"{live_server.url}/admin/login/?next=/admin/django_jobs/job/")
    driver.find_element(By.ID, "id_username").send_keys(username)
    driver.find_element(By.ID, "id_password").send_keys(PASSWORD)
    driver.find_element(By.CSS_SELECTOR, "#login-form [type=submit]").click()
    assert driver.find_element(By.ID, "changelist")


def no_horizontal_scroll(driver: Any) -> bool:
    """Neither the page nor any box of its content (the job list's own scroller, a module such
    as a dashboard table or chart) is wider inside than it is: nothing scrolls or spills sideways."""
    fits: bool = driver.execute_script(
        """
        const boxes = document.querySelectorAll("#changelist .results, #content-main .module");
        return document.documentElement.scrollWidth <= arguments[0]
            && [...boxes].every(box => box.scrollWidth <= box.clientWidth);
        """,
        WIDTH,
    )
    return fits


def row_heights_in_lines(driver: Any) -> list[float]:
    """The height of each row of the list, less its cells' padding, in lines of its text."""
    heights: list[float] = driver.execute_script(
        """
        return [...document.querySelectorAll("#result_list tbody tr")].map(row => {
            const style = getComputedStyle(row.cells[0]);
            const inner = row.cells[0].clientHeight - parseFloat(style.paddingTop) - parseFloat(style.paddingBottom);
            return inner / parseFloat(style.lineHeight);
        });
        """
    )
    return heights


def overflowing_cells(driver: Any) -> list[str]:
    """The list's cells whose content does not fit them, unless it is cut with an ellipsis and
    holds its whole text in a title; and those that reach past the table's edge."""
    found: list[str] = driver.execute_script(
        """
        const table = document.querySelector("#result_list").getBoundingClientRect();
        const found = [];
        for (const cell of document.querySelectorAll("#result_list tbody td, #result_list tbody th")) {
            const name = cell.className + ": " + cell.innerText.trim();
            if (cell.getBoundingClientRect().right > table.right + 0.5) found.push("past the edge " + name);
            for (const box of [cell, ...cell.querySelectorAll("*")]) {
                if (box.scrollWidth <= box.clientWidth) continue;
                const text = box.innerText.trim().replace(/…$/, "");
                const style = getComputedStyle(box);
                const title = box.title || box.closest("[title]")?.title || "";
                if (style.textOverflow !== "ellipsis" || style.overflowX !== "hidden" || !title.startsWith(text))
                    found.push(name);
            }
        }
        return found;
        """
    )
    return found


def above_the_fold(driver: Any, element: Any) -> bool:
    """``element`` shows whole in the window as the page opens, before any scrolling (the
    window is ``HEIGHT`` px high, its frame included: the page gets less)."""
    fits: bool = driver.execute_script(
        """
        const box = arguments[0].getBoundingClientRect();
        return window.scrollY === 0 && box.height > 0 && box.bottom <= window.innerHeight;
        """,
        element,
    )
    return fits


def open_from_index(driver: Any, live_server: Any, model: str) -> None:
    """The admin index, then its link to ``model``'s page (as listed under the app)."""
    from selenium.webdriver.common.by import By

    driver.get(f"{live_server.url}{reverse('admin:index')}")
    driver.find_element(By.CSS_SELECTOR, f"#content-main th a[href$='/django_jobs/{model}/']").click()


def table(driver: Any, css: str) -> list[list[str]]:
    """The text of each cell (``th`` and ``td``) of each row ``css`` matches, read in one go."""
    rows: list[list[str]] = driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(row => [...row.cells].map(c => c.innerText.trim()))",
        css,
    )
    return rows


def selected_filters(driver: Any) -> dict[str, str]:
    """The job list's filter sidebar: each filter's title and the choice selected in it."""
    chosen: dict[str, str] = driver.execute_script(
        """
        return Object.fromEntries([...document.querySelectorAll("#changelist-filter details")].map(
            filter => [filter.dataset.filterTitle, filter.querySelector("li.selected").innerText.trim()]));
        """
    )
    return chosen


def listed_jobs(driver: Any) -> set[str]:
    """The ids of the jobs the job list shows."""
    from selenium.webdriver.common.by import By

    return {
        box.get_attribute("value")
        for box in driver.find_elements(By.CSS_SELECTOR, "#result_list [name=_selected_action]")
    }


def status_of(driver: Any, method: str, url: str) -> int:
    """The HTTP status of a ``method`` request to ``url`` sent from the page, with the session
    and the page's CSRF token (every admin page has one, in its log-out form)."""
    status: int = driver.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        const token = document.querySelector("[name=csrfmiddlewaretoken]").value;
        fetch(arguments[1], {method: arguments[0], headers: {"X-CSRFToken": token}, credentials: "same-origin"})
            .then(response => done(response.status));
        """,
        method,
        url,
    )
    return status


def absent(driver: Any, css: str, scope: Any = None) -> bool:
    """No element matches ``css`` on the page as loaded, or in ``scope`` (an element) when given,
    without waiting for one to appear."""
    from selenium.webdriver.common.by import By

    driver.implicitly_wait(0)
    try:
        return not (scope or driver).find_elements(By.CSS_SELECTOR, css)
    finally:
        driver.implicitly_wait(IMPLICIT_WAIT)


def messages(driver: Any, level: str) -> list[str]:
    from selenium.webdriver.common.by import By

    return [li.text for li in driver.find_elements(By.CSS_SELECTOR, f"ul.messagelist li.{level}")]


def one_of_each_status(failed_job: Any) -> dict[str, str]:
    """A job in each status, by status (the failed one after three runs, with an attempt history)."""
    jobs = {"failed": failed_job(runs=3)}
    # Completed on its second run: its row still holds the first run's error.
    jobs["completed"] = scripted.using(name="nightly report", max_retries=1).dispatch(
        action="flaky", key="nightly", fail_times=1
    )
    for _ in range(2):
        Job.objects.filter(pk=jobs["completed"]).update(available_at=timezone.now())
        assert QueueWorker("default").process_once().job_id == jobs["completed"]
    assert Job.objects.get(pk=jobs["completed"]).last_error.startswith("RuntimeError: flaky failure")
    jobs["in_progress"] = scripted.using(name="import catalogue").dispatch(action="ok")
    assert Jobs.backend("default").fetch("default").token == jobs["in_progress"]  # a worker holds it
    jobs["cancelled"] = scripted.using(name="old newsletter").dispatch(action="ok")
    operations.cancel_jobs(Job.objects.filter(pk=jobs["cancelled"]), "Cancelled by boss in the admin", "admin:boss")
    jobs["charge"] = scripted.using(name="charge card", max_retries=0).dispatch(action="ok")
    Job.objects.filter(pk=jobs["charge"]).update(status="failed", attempts=1, last_error=LONG_ERROR)
    jobs["pending"] = scripted.using(name="welcome mail", queue="emails").dispatch(action="ok")
    return jobs


def test_the_job_admin_in_the_browser(live_server, browser, django_user_model, failed_job):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    # Without STATIC_URL the live server's static handler fails every request, and the admin
    # needs its CSS and JS (served by django.contrib.staticfiles).
    assert settings.STATIC_URL and "django.contrib.staticfiles" in settings.INSTALLED_APPS, (
        "tests/settings.py needs django.contrib.staticfiles in INSTALLED_APPS and STATIC_URL"
    )
    django_user_model.objects.create_superuser("boss", "boss@example.com", PASSWORD)
    jobs = one_of_each_status(failed_job)
    job_id = jobs["failed"]

    log_in(browser, live_server, "boss")

    # The job list: a coloured badge per status, short ids holding the full id, the first line
    # of the last error cut short, and no horizontal scrolling with the nav sidebar open.
    badges = {b.text for b in browser.find_elements(By.CSS_SELECTOR, "#result_list .job-status")}
    assert badges == {"Pending", "In progress", "Completed", "Failed", "Cancelled"}
    colours = {
        b.value_of_css_property("background-color")
        for b in browser.find_elements(By.CSS_SELECTOR, "#result_list .job-status")
    }
    assert len(colours) == 5
    for full in jobs.values():
        link = browser.find_element(By.LINK_TEXT, short(full))
        assert link.find_element(By.TAG_NAME, "span").get_attribute("title") == full
    error = browser.find_element(By.CSS_SELECTOR, f"input[value='{jobs['charge']}']").find_element(
        By.XPATH, "ancestor::tr//td[contains(@class, 'field-error_summary')]/span"
    )
    assert error.get_attribute("title") == LONG_ERROR.splitlines()[0]
    assert len(error.text) == 60 and error.text.endswith("…")
    assert browser.find_element(By.ID, "nav-sidebar").is_displayed()
    assert no_horizontal_scroll(browser)
    # One line per job: a long name or error is cut with an ellipsis and holds all of it in its
    # title; the queue and backend have a column of their own; a completed job shows no error.
    assert max(row_heights_in_lines(browser)) < 2
    assert overflowing_cells(browser) == []
    rows = {row[1]: row[2:] for row in table(browser, "#result_list tbody tr")}
    assert rows[short(jobs["pending"])][:2] == ["welcome mail", "emails · default"]
    assert rows[short(jobs["completed"])][-1] == "—"
    label = browser.find_element(By.CSS_SELECTOR, f"input[value='{job_id}']").find_element(
        By.XPATH, "ancestor::tr//td[contains(@class, 'field-label')]/span"
    )
    assert label.get_attribute("title") == "tests.testapp.jobs.scripted"
    assert browser.find_element(By.LINK_TEXT, "DASHBOARD") and browser.find_element(By.LINK_TEXT, "WORKERS")
    for_docs(screenshot(browser, "changelist"), "admin-changelist")
    browser.execute_script("document.documentElement.dataset.theme = 'dark'")  # this page only
    screenshot(browser, "changelist-dark")

    # The job page lists the three attempts, oldest first, near its top: on the screen as the
    # page opens, the timing fields folded below.
    browser.find_element(By.LINK_TEXT, short(job_id)).click()
    rows = browser.find_elements(By.CSS_SELECTOR, "#attempt-history tbody.attempt")
    assert above_the_fold(browser, browser.find_element(By.ID, "attempt-history"))
    timing = browser.find_element(By.XPATH, "//fieldset[.//h2[normalize-space()='Timing']]")
    assert timing.find_element(By.TAG_NAME, "details").get_attribute("open") is None
    assert not timing.find_element(By.CSS_SELECTOR, ".field-finished").is_displayed()
    outcomes = [row.find_element(By.CSS_SELECTOR, ".outcome").text for row in rows]
    assert outcomes == ["Retrying", "Retrying", "Failed"]
    assert [row.find_element(By.CSS_SELECTOR, "td").text for row in rows] == ["1", "2", "3"]
    kept = JobAttempt.objects.filter(job_id=job_id).order_by("attempt")
    assert all(attempt.worker_id in row.text for row, attempt in zip(rows, kept, strict=True))
    # The traceback stays folded until its summary is clicked.
    last = rows[-1].find_element(By.TAG_NAME, "details")
    traceback = last.find_element(By.TAG_NAME, "pre")
    assert last.find_element(By.TAG_NAME, "summary").text == "RuntimeError: scripted failure"
    assert not traceback.is_displayed()
    last.find_element(By.TAG_NAME, "summary").click()
    assert traceback.is_displayed() and "Traceback (most recent call last)" in traceback.text
    assert [b.text for b in browser.find_elements(By.CSS_SELECTOR, ".object-tools button")] == ["RETRY"]
    assert no_horizontal_scroll(browser)
    for_docs(screenshot(browser, "job-history"), "admin-job-history")

    # Retry it with the job page's button: back on its page, pending, its history kept.
    browser.find_element(By.CSS_SELECTOR, ".object-tools button.job-retry").click()
    assert messages(browser, "success") == ["Requeued 1 job(s)."]
    assert browser.find_element(By.CSS_SELECTOR, ".field-status_badge .job-status").text == "Pending"
    assert len(browser.find_elements(By.CSS_SELECTOR, "#attempt-history tbody.attempt")) == 3
    assert [b.text for b in browser.find_elements(By.CSS_SELECTOR, ".object-tools button")] == ["CANCEL"]
    screenshot(browser, "job-after-retry")

    # The job's History page lists the retry and who made it.
    browser.find_element(By.CSS_SELECTOR, "a.historylink").click()
    entries = browser.find_elements(By.CSS_SELECTOR, "#change-history tbody tr")
    assert [entry.text for entry in entries] == [entries[0].text] and RETRIED in entries[0].text
    assert "boss" in entries[0].text
    screenshot(browser, "history-after-retry")
    entry = LogEntry.objects.get(object_id=job_id)
    assert (entry.user.username, entry.action_flag, entry.get_change_message()) == ("boss", CHANGE, RETRIED)

    # Cancel the pending job with the list's action.
    browser.find_element(By.CSS_SELECTOR, ".breadcrumbs a[href$='/django_jobs/job/']").click()
    browser.find_element(By.CSS_SELECTOR, f"input[name=_selected_action][value='{jobs['pending']}']").click()
    Select(browser.find_element(By.NAME, "action")).select_by_value("cancel")
    browser.find_element(By.CSS_SELECTOR, "#changelist-form button[name=index]").click()
    assert messages(browser, "success") == ["Cancelled 1 job(s)."]
    row = browser.find_element(By.CSS_SELECTOR, f"input[value='{jobs['pending']}']").find_element(
        By.XPATH, "ancestor::tr"
    )
    assert row.find_element(By.CSS_SELECTOR, ".job-status").text == "Cancelled"
    assert "Cancelled by boss in the admin" in row.find_element(By.CSS_SELECTOR, ".field-error_summary").text
    screenshot(browser, "changelist-after-cancel")
    assert Job.objects.get(pk=jobs["pending"]).status == "cancelled"
    assert LogEntry.objects.get(object_id=jobs["pending"]).get_change_message() == "Cancelled (was pending, never run)"


def test_the_abort_button_says_what_is_true_and_is_not_offered_twice(live_server, browser, django_user_model):
    """A running job's Abort: the message says the worker was asked (not that it stopped), the
    page says who asked and when in place of the button, the list says "aborting"; a second
    abort from the list is told it was asked already."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    django_user_model.objects.create_superuser("boss", "boss@example.com", PASSWORD)
    job_id = scripted.using(name="import catalogue").dispatch(action="ok")
    assert Jobs.backend("default").fetch("default").token == job_id  # a worker holds it

    log_in(browser, live_server, "boss")
    browser.find_element(By.LINK_TEXT, short(job_id)).click()
    browser.find_element(By.CSS_SELECTOR, "button.job-abort").click()

    message = browser.find_element(By.CSS_SELECTOR, ".messagelist li").text
    assert "Asked 1 running job(s) to abort" in message and "within about" in message, message
    assert "stopped" not in message
    assert absent(browser, "button.job-abort"), "an abort is offered once"
    state = browser.find_element(By.CSS_SELECTOR, "span.job-state.job-aborting")
    assert state.text.lower() == "abort requested"
    assert "abort requested by admin:boss at " in state.get_attribute("title")
    assert "abort requested by admin:boss at " in browser.find_element(By.CSS_SELECTOR, "body").text
    screenshot(browser, "abort-requested")
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.abort_requested) == ("in_progress", "admin:boss") and job.abort_requested_at is not None

    browser.get(f"{live_server.url}/admin/django_jobs/job/")
    row = browser.find_element(By.CSS_SELECTOR, f"input[value='{job_id}']").find_element(By.XPATH, "ancestor::tr")
    assert "aborting" in row.text
    row.find_element(By.CSS_SELECTOR, "input[name=_selected_action]").click()
    Select(browser.find_element(By.NAME, "action")).select_by_value("abort")
    browser.find_element(By.CSS_SELECTOR, "button[name=index]").click()
    again = browser.find_element(By.CSS_SELECTOR, ".messagelist li").text
    assert "already" in again and "admin:boss" in again, again


def test_a_view_only_staff_user_reads_but_cannot_retry_or_cancel(
    live_server, browser, django_user_model, failed_job, settings
):
    from selenium.webdriver.common.by import By

    settings.JOBS = {**settings.JOBS, "BACKENDS": {"default": settings.JOBS["BACKENDS"]["default"]}}
    user = django_user_model.objects.create_user("viewer", "viewer@example.com", PASSWORD, is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="django_jobs", codename="view_job"))
    worker = Worker.objects.create(id="web-1:4242:a1b2", hostname="web-1", pid=4242, backend="default")
    job_id = failed_job(runs=2)
    pending = scripted.dispatch(action="ok")

    log_in(browser, live_server, "viewer")

    # The list, with no action to choose and nothing to select.
    assert browser.find_element(By.LINK_TEXT, short(job_id)) and browser.find_element(By.LINK_TEXT, short(pending))
    assert absent(browser, "[name=action]") and absent(browser, "[name=_selected_action]")
    assert no_horizontal_scroll(browser)
    screenshot(browser, "view-only-changelist")

    # The job page, with its history and no button.
    browser.find_element(By.LINK_TEXT, short(job_id)).click()
    assert len(browser.find_elements(By.CSS_SELECTOR, "#attempt-history tbody.attempt")) == 2
    assert absent(browser, ".object-tools form") and absent(browser, ".object-tools button")
    screenshot(browser, "view-only-job")

    # A POST to the retry URL anyway, with the session and its CSRF token, is refused.
    assert (
        status_of(browser, "POST", f"{live_server.url}{reverse('admin:django_jobs_job_retry', args=[job_id])}") == 403
    )
    assert Job.objects.get(pk=job_id).status == "failed"
    assert not LogEntry.objects.exists()

    # The dashboard is theirs to read (viewing jobs is enough) ...
    open_from_index(browser, live_server, "jobdashboard")
    assert [h1.text for h1 in browser.find_elements(By.TAG_NAME, "h1")] == ["Jobs dashboard"]
    assert [row[:7] for row in table(browser, "#jobs-queues tbody tr") if row[1] == "default"] == [
        ["default", "default", "1", "0", "0", "1", "0"]
    ]
    screenshot(browser, "view-only-dashboard")

    # ... the workers panel is not: the index does not list it and its URL is refused.
    workers_url = f"{live_server.url}{reverse('admin:django_jobs_worker_changelist')}"
    browser.get(f"{live_server.url}{reverse('admin:index')}")
    assert absent(browser, "a[href$='/django_jobs/worker/']")
    assert status_of(browser, "GET", workers_url) == 403

    # With view_worker they read it, with nothing to select or delete, and a delete is refused.
    user.user_permissions.add(Permission.objects.get(content_type__app_label="django_jobs", codename="view_worker"))
    open_from_index(browser, live_server, "worker")
    assert [row.text for row in browser.find_elements(By.CSS_SELECTOR, "#result_list th.field-host")] == [
        "web-1\npid 4242"
    ]
    assert absent(browser, "[name=action]") and absent(browser, "[name=_selected_action]")
    delete_url = f"{live_server.url}{reverse('admin:django_jobs_worker_delete', args=[worker.pk])}"
    assert status_of(browser, "POST", delete_url) == 403
    assert Worker.objects.filter(pk=worker.pk).exists()


# -- The dashboard and the workers panel --------------------------------------------------------

SMTP_ERROR = "SMTPServerDisconnected: Connection unexpectedly closed\nTraceback (most recent call last):\n  ..."


def fail_for_good(queue: str) -> str:
    """A ``scripted`` job on ``queue`` that the worker ran once and that failed for good."""
    job_id = scripted.using(name="sync stock levels", queue=queue, max_retries=0).dispatch(action="raise")
    assert QueueWorker("default", [queue]).process_once().job_id == job_id
    return job_id


def dashboard_jobs() -> dict[str, list[str]]:
    """Jobs of the database backend on three queues, and one waiting on Redis; by what they show.

    default: one in progress, one pending, one failed, one cancelled; emails: three pending,
    one delayed; other: three failed (two ``scripted``, one ``remember``). Four failures in all:
    three of ``scripted``, one of ``remember``.
    """
    jobs: dict[str, list[str]] = {"other_failed": [], "scripted_failed": []}
    for queue in ("default", "other", "other"):
        job_id = fail_for_good(queue)
        jobs["scripted_failed"].append(job_id)
        if queue == "other":
            jobs["other_failed"].append(job_id)
    jobs["in_progress"] = [scripted.using(name="import catalogue").dispatch(action="ok")]
    assert Jobs.backend("default").fetch("default").token == jobs["in_progress"][0]  # a worker holds it
    jobs["pending"] = [scripted.using(name="nightly report").dispatch(action="ok")]
    for name in ("welcome mail", "password reset", "order receipt"):
        jobs["pending"].append(scripted.using(name=name, queue="emails").dispatch(action="ok"))
    jobs["delayed"] = [scripted.using(name="weekly digest", queue="emails", delay=3600).dispatch(action="ok")]
    cancelled = scripted.using(name="old newsletter").dispatch(action="ok")
    operations.cancel_jobs(Job.objects.filter(pk=cancelled), "Cancelled by boss in the admin", "admin:boss")
    mail = remember.using(name="send invoice", queue="other").dispatch()
    Job.objects.filter(pk=mail).update(status="failed", attempts=1, last_error=SMTP_ERROR, finished_at=timezone.now())
    jobs["other_failed"].append(mail)
    jobs["redis"] = [scripted.using(backend="redis", name="resize images", queue="emails").dispatch(action="ok")]
    return jobs


def dashboard_throughput() -> dict[str, int]:
    """Per-minute counts of two worker processes (database and Redis) over the last 24 hours, a
    few minutes each hour, busier by day; returns the 24 hours' completed and failed totals."""
    minute = timezone.now().replace(second=0, microsecond=0)
    rows = []
    for hours_ago in range(24):
        for backend, worker, share in (("default", "web-1:4242:a1b2", 3), ("redis", "web-2:917:c3d4", 2)):
            for at in (0, 20, 40):
                busy = 6 + (hours_ago * 5 + at) % 11
                rows.append(
                    Throughput(
                        minute=minute - timedelta(hours=hours_ago, minutes=at),
                        worker=worker,
                        backend=backend,
                        queue="emails" if at == 20 else "default",
                        completed=share * busy,
                        retried=busy % 3,
                        failed=1 if (hours_ago + at) % 7 == 0 else 0,
                    )
                )
    Throughput.objects.bulk_create(rows)
    return {"completed": sum(row.completed for row in rows), "failed": sum(row.failed for row in rows)}


def test_the_dashboard_in_the_browser(live_server, browser, django_user_model, settings, redis_up):
    from selenium.webdriver.common.by import By

    shared = settings.JOBS["BACKENDS"]
    settings.JOBS = {**settings.JOBS, "BACKENDS": {name: shared[name] for name in ("default", "redis")}}
    django_user_model.objects.create_superuser("boss", "boss@example.com", PASSWORD)
    jobs = dashboard_jobs()
    day = dashboard_throughput()

    log_in(browser, live_server, "boss")
    open_from_index(browser, live_server, "jobdashboard")

    # One heading, and breadcrumbs back to the index.
    assert [h1.text for h1 in browser.find_elements(By.TAG_NAME, "h1")] == ["Jobs dashboard"]
    crumbs = browser.find_elements(By.CSS_SELECTOR, ".breadcrumbs li")
    assert crumbs[-1].text == "Dashboard"
    home = crumbs[0].find_element(By.TAG_NAME, "a").get_attribute("href")
    assert home == f"{live_server.url}{reverse('admin:index')}"

    # The queue table: each backend and queue, its counts as seeded.
    counts = {(row[0], row[1]): row[2:7] for row in table(browser, "#jobs-queues tbody tr")}
    assert counts == {
        ("default", "default"): ["1", "0", "1", "1", "1"],
        ("default", "emails"): ["3", "1", "0", "0", "0"],
        ("default", "other"): ["0", "0", "0", "3", "0"],
        ("redis", "default"): ["0", "0", "0", "0", "0"],
        ("redis", "emails"): ["1", "0", "0", "0", "0"],
        ("redis", "other"): ["0", "0", "0", "0", "0"],
    }

    # The throughput table's total over the last 24 hours: the seeded counts.
    total = table(browser, "#jobs-throughput tbody tr")[-1]
    rate = 100 * day["failed"] / (day["completed"] + day["failed"])
    assert total[0] == "All backends"
    assert (total[6], total[8], total[10]) == (str(day["completed"]), str(day["failed"]), f"{rate:.1f} %")

    # Both charts, their axes labelled, with a column or bar that holds jobs.
    hourly = [text.text for text in browser.find_elements(By.CSS_SELECTOR, "svg#jobs-hourly text")]
    assert {"hour (UTC)", "jobs per hour", "completed", "failed"} <= set(hourly)
    depth = [text.text for text in browser.find_elements(By.CSS_SELECTOR, "svg#jobs-depth text")]
    assert {"jobs", "pending", "delayed", "in progress", "default / emails", "redis / emails"} <= set(depth)
    for chart in ("jobs-hourly", "jobs-depth"):
        assert browser.find_elements(By.CSS_SELECTOR, f"svg#{chart} g > rect"), f"{chart} draws no column or bar"

    # The handlers failing most, the most failures first.
    handlers = table(browser, "#jobs-failing tbody tr")
    scripted_handler, remember_handler = (
        Job.objects.get(pk=jobs[key][-1]).handler for key in ("scripted_failed", "other_failed")
    )
    assert [(row[0], row[1]) for row in handlers] == [(scripted_handler, "3"), (remember_handler, "1")]
    assert handlers[1][3] == SMTP_ERROR.splitlines()[0]

    assert no_horizontal_scroll(browser)
    for_docs(screenshot(browser, "dashboard"), "admin-dashboard")

    # A failed count opens the job list, filtered to those very jobs.
    other = browser.find_element(By.XPATH, "//*[@id='jobs-queues']//tr[td[1]='default' and td[2]='other']")
    other.find_element(By.CSS_SELECTOR, "td:nth-child(6) a").click()
    assert selected_filters(browser)["status"] == "Failed"
    assert listed_jobs(browser) == set(jobs["other_failed"])


def test_the_dashboards_links_select_their_filters_in_the_job_list(live_server, browser, django_user_model, settings):
    from selenium.webdriver.common.by import By

    settings.JOBS = {**settings.JOBS, "BACKENDS": {"default": settings.JOBS["BACKENDS"]["default"]}}
    django_user_model.objects.create_superuser("boss", "boss@example.com", PASSWORD)
    failed = fail_for_good("other")
    elsewhere = fail_for_good("default")  # the same handler, on another queue

    log_in(browser, live_server, "boss")
    open_from_index(browser, live_server, "jobdashboard")
    other = browser.find_element(By.XPATH, "//*[@id='jobs-queues']//tr[td[1]='default' and td[2]='other']")
    other.find_element(By.CSS_SELECTOR, "td:nth-child(6) a").click()
    assert listed_jobs(browser) == {failed}
    picked = {"status": "Failed", "queue": "other", "handler": "All", "backend": "default"}
    assert selected_filters(browser) == picked

    browser.back()
    browser.find_element(By.CSS_SELECTOR, "#jobs-failing tbody a").click()
    assert listed_jobs(browser) == {failed, elsewhere}
    picked = {"status": "Failed", "queue": "All", "handler": Job.objects.get(pk=failed).handler, "backend": "All"}
    assert selected_filters(browser) == picked


def test_the_workers_panel_in_the_browser(live_server, browser, django_user_model):
    from selenium.webdriver.common.by import By

    django_user_model.objects.create_superuser("boss", "boss@example.com", PASSWORD)
    now = timezone.now()
    running_job = scripted.using(name="import catalogue").dispatch(action="ok")
    assert Jobs.backend("default").fetch("default").token == running_job
    workers = {
        "running": Worker.objects.create(
            id="web-1:4242:a1b2",
            hostname="web-1",
            pid=4242,
            backend="default",
            queues=["default", "emails"],
            started_at=now - timedelta(hours=3, minutes=12),
            last_seen=now - timedelta(seconds=2),
            current_job=running_job,
            current_job_name="import catalogue",
            current_job_started=now - timedelta(seconds=42),
            processed=1873,
        ),
        "idle": Worker.objects.create(
            id="web-2:917:c3d4",
            hostname="web-2",
            pid=917,
            backend="redis",
            queues=["emails"],
            started_at=now - timedelta(hours=1, minutes=5),
            last_seen=now - timedelta(seconds=4),
            processed=412,
        ),
        "stopped": Worker.objects.create(
            id="web-1:3101:e5f6",
            hostname="web-1",
            pid=3101,
            backend="default",
            queues=["other"],
            started_at=now - timedelta(days=1, hours=2),
            last_seen=now - timedelta(hours=3, minutes=13),
            stopped_at=now - timedelta(hours=3, minutes=13),
            processed=20566,
        ),
        # Killed mid-job: its job (on Redis) has no Job row, so its id is shown unlinked.
        "dead": Worker.objects.create(
            id="batch-7:30211:0a9b",
            hostname="batch-7",
            pid=30211,
            backend="redis",
            queues=["default", "other"],
            started_at=now - timedelta(hours=6),
            last_seen=now - timedelta(minutes=14),
            current_job="5e0c2a7d41b94f3b8c6d",
            current_job_name="shop.jobs.resize_product_images",
            current_job_started=now - timedelta(minutes=15),
            processed=96,
        ),
    }

    log_in(browser, live_server, "boss")
    open_from_index(browser, live_server, "worker")

    def badges() -> dict[str, str]:
        return {
            row.find_element(By.CSS_SELECTOR, "th.field-host").text.split("\n")[1]: row.find_element(
                By.CSS_SELECTOR, ".worker-state"
            ).text
            for row in browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
        }

    assert badges() == {f"pid {worker.pid}": state.replace("idle", "running") for state, worker in workers.items()}
    dead = browser.find_element(By.XPATH, "//*[@id='result_list']//tr[.//*[contains(@class, 'state-dead')]]")
    assert absent(browser, "td.field-job a", scope=dead)
    assert dead.find_element(By.CSS_SELECTOR, "td.field-job code").get_attribute("title") == "5e0c2a7d41b94f3b8c6d"
    # Each job in hand: its name (or handler) over the tail of its id and its runtime.
    in_hand = browser.execute_script(
        """
        return [...document.querySelectorAll("#result_list td.field-job")].filter(cell => cell.querySelector("code"))
            .map(cell => {
                const id = cell.querySelector("code"), name = cell.querySelector(".job-name");
                return [name.title, id.innerText, name.getBoundingClientRect().bottom <= id.getBoundingClientRect().top];
            });
        """
    )
    assert in_hand == [
        ["import catalogue", short(running_job), True],
        ["shop.jobs.resize_product_images", short("5e0c2a7d41b94f3b8c6d"), True],
    ]
    assert overflowing_cells(browser) == []
    assert no_horizontal_scroll(browser)
    for_docs(screenshot(browser, "workers"), "admin-workers")

    # The state filter: "dead" lists the dead worker alone.
    browser.find_element(By.CSS_SELECTOR, "#changelist-filter a[href*='state=dead']").click()
    assert badges() == {"pid 30211": "dead"}

    # The running worker's job links to its page.
    browser.back()
    browser.find_element(By.CSS_SELECTOR, "td.field-job a").click()
    assert browser.current_url == f"{live_server.url}{reverse('admin:django_jobs_job_change', args=[running_job])}"
    assert browser.find_element(By.CSS_SELECTOR, ".field-status_badge .job-status").text == "In progress"


# -- The schedules --------------------------------------------------------------------------------


def test_the_schedules_list_warns_when_no_scheduler_passes(live_server, browser, django_user_model):
    from selenium.webdriver.common.by import By

    django_user_model.objects.create_superuser("boss", "boss@example.com", PASSWORD)
    # A daily run half a day away, whatever the time the test runs at (a fixed hour would have
    # come due between the scheduler's pass and the page when the test runs just after it).
    nightly = (timezone.now() + timedelta(hours=12)).astimezone(ZoneInfo("Europe/Paris")).strftime("%H:%M")
    entries = {
        "poll-feeds": parse_entry("poll-feeds", {"job": "tests.testapp.jobs.remember", "every": 300}),
        "nightly-report": parse_entry(
            "nightly-report", {"job": "tests.testapp.jobs.remember", "daily": nightly, "timezone": "Europe/Paris"}
        ),
    }
    # The last scheduler passed ten minutes ago, by its clock, and stopped.
    ten_minutes_ago = timezone.now() - timedelta(minutes=10)
    Scheduler(entries, clock=lambda: ten_minutes_ago).run_pass()

    log_in(browser, live_server, "boss")
    open_from_index(browser, live_server, "schedule")

    warning = browser.find_element(By.ID, "no-scheduler")
    assert warning.text.startswith("No scheduler has passed for over a minute (the last pass: ")
    assert "enabled schedules are not dispatched" in warning.text

    def next_runs() -> dict[str, str]:
        return {row[1].split("\n")[0]: row[2] for row in table(browser, "#result_list tbody tr")}

    shown = next_runs()
    assert shown["poll-feeds"].endswith("overdue: no scheduler running")  # its next run is past
    assert "overdue" not in shown["nightly-report"]  # half a day away, still to come
    assert no_horizontal_scroll(browser)
    for_docs(screenshot(browser, "schedules"), "admin-schedules")

    # A scheduler passes again: no warning, and the next run is to come.
    Scheduler(entries).run_pass()
    browser.refresh()
    assert absent(browser, "#no-scheduler")
    assert "overdue" not in next_runs()["poll-feeds"]
