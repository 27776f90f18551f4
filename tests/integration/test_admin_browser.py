"""The job admin in a real browser: headless Debian chromium, driven by selenium through
``/usr/bin/chromedriver``, against pytest-django's ``live_server``.

A superuser logs in through the login form and reads the job list (a badge per status, short
ids, no horizontal scrolling at 1280 px with the nav sidebar open), opens a job that failed after
three runs, reads its attempt history, retries it with the job page's Retry button, finds the
retry in the job's History page, and cancels a pending job with the list's Cancel action. A
staff user who may only view jobs reads the list and a job page, is offered no action and no
button, and a POST to the retry URL is refused. Full-page screenshots (1280 px wide) go to
``test-artifacts/admin/``. ``JOBS_UPDATE_DOC_SCREENSHOTS=1`` also copies the job list's and the
job page's to ``docs/images/admin-changelist.png`` and ``docs/images/admin-job-history.png``,
the screenshots docs/admin.md shows.

Without chromium, chromedriver or selenium the test skips locally and fails under ``CI=true``.
Selenium is given the driver's path, so selenium-manager never runs (and never downloads).
"""

from __future__ import annotations

import base64
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission
from django.urls import reverse

from django_jobs import Jobs, operations
from django_jobs.models import Job, JobAttempt
from django_jobs.worker import QueueWorker
from tests.conftest import require_service
from tests.procs import REPO_ROOT
from tests.testapp.jobs import scripted

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WIDTH = 1280
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
    """A headless chromium, 1280 px wide, driven through Debian's chromedriver."""
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
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={WIDTH},1000"):
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
    """Neither the page nor the job list's own scroller (``#changelist .results``) scrolls sideways."""
    fits: bool = driver.execute_script(
        """
        const list = document.querySelector("#changelist .results");
        return document.documentElement.scrollWidth <= arguments[0]
            && (!list || list.scrollWidth <= list.clientWidth);
        """,
        WIDTH,
    )
    return fits


def absent(driver: Any, css: str) -> bool:
    """No element matches ``css`` on the page as loaded (no implicit wait for one to appear)."""
    from selenium.webdriver.common.by import By

    driver.implicitly_wait(0)
    try:
        return not driver.find_elements(By.CSS_SELECTOR, css)
    finally:
        driver.implicitly_wait(IMPLICIT_WAIT)


def messages(driver: Any, level: str) -> list[str]:
    from selenium.webdriver.common.by import By

    return [li.text for li in driver.find_elements(By.CSS_SELECTOR, f"ul.messagelist li.{level}")]


def one_of_each_status(failed_job: Any) -> dict[str, str]:
    """A job in each status, by status (the failed one after three runs, with an attempt history)."""
    jobs = {"failed": failed_job(runs=3)}
    jobs["completed"] = scripted.using(name="nightly report").dispatch(action="ok")
    assert QueueWorker("default").process_once().job_id == jobs["completed"]
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
        short = browser.find_element(By.LINK_TEXT, full[:8])
        assert short.find_element(By.TAG_NAME, "span").get_attribute("title") == full
    error = browser.find_element(By.CSS_SELECTOR, f"input[value='{jobs['charge']}']").find_element(
        By.XPATH, "ancestor::tr//td[contains(@class, 'field-error_summary')]/span"
    )
    assert error.get_attribute("title") == LONG_ERROR.splitlines()[0]
    assert len(error.text) == 60 and error.text.endswith("…")
    assert browser.find_element(By.ID, "nav-sidebar").is_displayed()
    assert no_horizontal_scroll(browser)
    assert browser.find_element(By.LINK_TEXT, "DASHBOARD") and browser.find_element(By.LINK_TEXT, "WORKERS")
    for_docs(screenshot(browser, "changelist"), "admin-changelist")
    browser.execute_script("document.documentElement.dataset.theme = 'dark'")  # this page only
    screenshot(browser, "changelist-dark")

    # The job page lists the three attempts, oldest first.
    browser.find_element(By.LINK_TEXT, job_id[:8]).click()
    rows = browser.find_elements(By.CSS_SELECTOR, "#attempt-history tbody.attempt")
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


def test_a_view_only_staff_user_reads_but_cannot_retry_or_cancel(live_server, browser, django_user_model, failed_job):
    from selenium.webdriver.common.by import By

    user = django_user_model.objects.create_user("viewer", "viewer@example.com", PASSWORD, is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="django_jobs", codename="view_job"))
    job_id = failed_job(runs=2)
    pending = scripted.dispatch(action="ok")

    log_in(browser, live_server, "viewer")

    # The list, with no action to choose and nothing to select.
    assert browser.find_element(By.LINK_TEXT, job_id[:8]) and browser.find_element(By.LINK_TEXT, pending[:8])
    assert absent(browser, "[name=action]") and absent(browser, "[name=_selected_action]")
    assert no_horizontal_scroll(browser)
    screenshot(browser, "view-only-changelist")

    # The job page, with its history and no button.
    browser.find_element(By.LINK_TEXT, job_id[:8]).click()
    assert len(browser.find_elements(By.CSS_SELECTOR, "#attempt-history tbody.attempt")) == 2
    assert absent(browser, ".object-tools form") and absent(browser, ".object-tools button")
    screenshot(browser, "view-only-job")

    # A POST to the retry URL anyway, with the session and its CSRF token, is refused.
    status = browser.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        const token = document.querySelector("[name=csrfmiddlewaretoken]").value;
        fetch(arguments[0], {method: "POST", headers: {"X-CSRFToken": token}, credentials: "same-origin"})
            .then(response => done(response.status));
        """,
        f"{live_server.url}{reverse('admin:django_jobs_job_retry', args=[job_id])}",
    )
    assert status == 403
    assert Job.objects.get(pk=job_id).status == "failed"
    assert not LogEntry.objects.exists()
