"""The job admin in a real browser: headless Debian chromium, driven by selenium through
``/usr/bin/chromedriver``, against pytest-django's ``live_server``.

A staff superuser logs in through the login form, opens a job that failed after three runs,
reads its attempt history, retries it from the job list and finds the retry in the job's History
page. Full-page screenshots (1280 px wide) of the job list, the job page and the History page go
to ``test-artifacts/admin/``. ``JOBS_UPDATE_DOC_SCREENSHOTS=1`` also copies the job page's to
``docs/images/admin-job-history.png``, the screenshot docs/admin.md shows.

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

from django_jobs.models import JobAttempt
from django_jobs.worker import QueueWorker
from tests.conftest import require_service
from tests.procs import REPO_ROOT
from tests.testapp.jobs import scripted

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WIDTH = 1280
ARTIFACTS = REPO_ROOT / "test-artifacts" / "admin"
DOC_SCREENSHOT = REPO_ROOT / "docs" / "images" / "admin-job-history.png"
RETRIED = "Retried (was failed after 3 runs: RuntimeError: scripted failure)"

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
    driver.implicitly_wait(5)
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


def messages(driver: Any, level: str) -> list[str]:
    from selenium.webdriver.common.by import By

    return [li.text for li in driver.find_elements(By.CSS_SELECTOR, f"ul.messagelist li.{level}")]


def test_attempt_history_and_retry_in_the_browser(live_server, browser, django_user_model, failed_job):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    # Without STATIC_URL the live server's static handler fails every request, and the admin
    # needs its CSS and JS (served by django.contrib.staticfiles).
    assert settings.STATIC_URL and "django.contrib.staticfiles" in settings.INSTALLED_APPS, (
        "tests/settings.py needs django.contrib.staticfiles in INSTALLED_APPS and STATIC_URL"
    )
    django_user_model.objects.create_superuser("boss", "boss@example.com", "pw-for-tests-only")
    job_id = failed_job(runs=3)
    done = scripted.using(name="nightly report").dispatch(action="ok")
    assert QueueWorker("default").process_once().job_id == done

    # Log in through the form; the admin sends us on to the job list.
    browser.get(f"{live_server.url}/admin/login/?next=/admin/django_jobs/job/")
    browser.find_element(By.ID, "id_username").send_keys("boss")
    browser.find_element(By.ID, "id_password").send_keys("pw-for-tests-only")
    browser.find_element(By.CSS_SELECTOR, "#login-form [type=submit]").click()
    assert browser.find_element(By.ID, "changelist")
    assert browser.find_element(By.LINK_TEXT, done)
    browser.find_element(By.ID, "toggle-nav-sidebar").click()  # more room for the tables (remembered)
    screenshot(browser, "changelist")

    # The job page lists the three attempts, oldest first.
    browser.find_element(By.LINK_TEXT, job_id).click()
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
    page = screenshot(browser, "job-history")
    if os.environ.get("JOBS_UPDATE_DOC_SCREENSHOTS") == "1":
        DOC_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(page, DOC_SCREENSHOT)

    # Retry it from the job list.
    browser.find_element(By.CSS_SELECTOR, ".breadcrumbs a[href$='/django_jobs/job/']").click()
    browser.find_element(By.CSS_SELECTOR, f"input[name=_selected_action][value='{job_id}']").click()
    Select(browser.find_element(By.NAME, "action")).select_by_value("retry")
    browser.find_element(By.CSS_SELECTOR, "#changelist-form button[name=index]").click()
    assert messages(browser, "success") == ["Requeued 1 job(s)."]

    # The history is kept, and the job's History page lists the retry and who made it.
    browser.find_element(By.LINK_TEXT, job_id).click()
    assert len(browser.find_elements(By.CSS_SELECTOR, "#attempt-history tbody.attempt")) == 3
    browser.find_element(By.CSS_SELECTOR, "a.historylink").click()
    entries = browser.find_elements(By.CSS_SELECTOR, "#change-history tbody tr")
    assert [entry.text for entry in entries] == [entries[0].text] and RETRIED in entries[0].text
    assert "boss" in entries[0].text
    screenshot(browser, "history-after-retry")
    entry = LogEntry.objects.get(object_id=job_id)
    assert (entry.user.username, entry.action_flag, entry.get_change_message()) == ("boss", CHANGE, RETRIED)
