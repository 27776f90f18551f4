"""Worker presence (``django_jobs.presence``) and the admin's workers panel.

Presence writes to the database the router gives for ``Worker``: each presence test runs with
``Worker`` and ``Throughput`` routed to SQLite and to PostgreSQL. Beats are called directly,
with a clock the test sets, except in the test of the thread itself.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import OperationalError, connections
from django.db.models import Sum
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone

from django_jobs import presence as presence_module
from django_jobs.ids import short
from django_jobs.models import Job, Throughput, Worker
from django_jobs.pipeline import Outcome
from django_jobs.presence import Presence
from django_jobs.worker import QueueWorker
from tests.api_support import drain
from tests.procs import wait_until
from tests.testapp.jobs import scripted

DATABASES = ["default", "postgres"]
T0 = datetime(2030, 1, 2, 12, 0, 10, tzinfo=UTC)


class RoutePresenceTo:
    """Sends ``Worker`` and ``Throughput`` rows to one database alias."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return self.alias if model in (Worker, Throughput) else None

    db_for_read = db_for_write


class Clock:
    """A clock the test moves."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture(params=DATABASES)
def presence_db(request: pytest.FixtureRequest) -> Iterator[str]:
    """The alias presence writes to, through a router."""
    if request.param == "postgres":
        request.getfixturevalue("postgres_up")
    with override_settings(DATABASE_ROUTERS=[RoutePresenceTo(request.param)]):
        yield request.param


def worker_row(presence: Presence) -> Worker:
    return Worker.objects.using(presence.alias).get(pk=presence.id)


def throughput(alias: str, worker_id: str) -> list[tuple[datetime, str, int, int, int, int]]:
    rows = Throughput.objects.using(alias).filter(worker=worker_id).order_by("minute", "queue")
    return [(r.minute, r.queue, r.completed, r.retried, r.failed, r.rejected) for r in rows]


def flaky_writer(monkeypatch: pytest.MonkeyPatch, failures: int) -> list[str]:
    """Makes the next ``failures`` beats fail as a database outage would; returns the log of
    tries ("failed" or "written")."""
    real, tries = presence_module.write_beat, []

    def write(alias: str, beat: presence_module.Beat) -> None:
        if tries.count("failed") < failures:
            tries.append("failed")
            raise OperationalError("connection refused")
        real(alias, beat)
        tries.append("written")

    monkeypatch.setattr(presence_module, "write_beat", write)
    return tries


# -- beats -----------------------------------------------------------------------------------------


@pytest.mark.django_db(databases=DATABASES)
def test_beats_write_the_row_the_job_in_hand_and_throughput_per_minute(presence_db):
    clock = Clock(T0)
    worker = QueueWorker("default", ["default", "other"])
    presence = Presence(worker, clock=clock)
    assert presence.alias == presence_db
    assert presence.beat()
    row = worker_row(presence)
    assert (row.backend, row.queues, row.pid, row.last_seen) == ("default", ["default", "other"], presence.pid, T0)
    assert (row.current_job, row.current_job_started, row.processed, row.stopped_at) == ("", None, 0, None)
    assert row.id.startswith(f"{row.hostname}:{row.pid}:")

    # A beat in the middle of a delivery shows the job in hand.
    in_hand: list[Any] = []
    real_process = worker.pipeline.process

    def process(lease: Any) -> Any:
        in_hand.append(worker.current)
        clock.now = T0 + timedelta(seconds=5)
        presence.beat()
        return real_process(lease)

    worker.pipeline.process = process
    first = scripted.using(name="nightly report").dispatch(action="ok")
    assert worker.process_once().status == Outcome.ACKED
    assert in_hand[0][0] == first and worker.current is None
    row = worker_row(presence)
    assert (row.current_job, row.current_job_name, row.processed) == (first, "nightly report", 0)
    assert timedelta(0) <= row.last_seen - row.current_job_started < timedelta(seconds=5)
    worker.pipeline.process = real_process

    scripted.dispatch(action="ok")
    scripted.using(max_retries=1).dispatch(action="raise")  # retried at once, then fails for good
    scripted.using(queue="other", max_retries=0).dispatch(action="raise")  # fails for good
    drain(worker)
    clock.now = T0 + timedelta(seconds=20)
    assert presence.beat()
    minute = T0.replace(second=0)
    assert throughput(presence_db, presence.id) == [(minute, "default", 2, 1, 1, 0), (minute, "other", 0, 0, 1, 0)]
    row = worker_row(presence)
    assert (row.current_job, row.current_job_started, row.processed) == ("", None, 5)

    # The same minute adds to the same rows; the next minute has rows of its own.
    scripted.dispatch(action="ok")
    drain(worker)
    clock.now = T0 + timedelta(seconds=40)
    assert presence.beat()
    clock.now = T0 + timedelta(seconds=55)
    assert presence.beat()  # nothing new: nothing added
    scripted.dispatch(action="ok")
    drain(worker)
    clock.now = T0 + timedelta(seconds=60)
    assert presence.beat(stopping=True)
    later = minute + timedelta(minutes=1)
    assert throughput(presence_db, presence.id) == [
        (minute, "default", 3, 1, 1, 0),
        (minute, "other", 0, 0, 1, 0),
        (later, "default", 1, 0, 0, 0),
    ]
    total = Throughput.objects.using(presence_db).aggregate(completed=Sum("completed"))["completed"]
    assert total == sum(n for (_, status), n in worker.tally.items() if status == Outcome.ACKED) == 4
    row = worker_row(presence)
    assert (row.processed, row.stopped_at, row.last_seen) == (7, clock.now, clock.now)
    assert row.state(clock.now) == "stopped"


@pytest.mark.django_db(databases=DATABASES)
def test_beats_that_fail_are_logged_once_and_their_counts_written_later(presence_db, monkeypatch, caplog):
    clock = Clock(T0)
    worker = QueueWorker("default")
    presence = Presence(worker, clock=clock)
    tries = flaky_writer(monkeypatch, failures=3)
    worker.tally[("default", Outcome.ACKED)] = 2
    caplog.set_level(logging.INFO, logger="django_jobs.worker")

    assert not presence.beat()
    worker.tally[("default", Outcome.ACKED)] += 1
    worker.tally[("default", Outcome.REJECTED)] = 1
    assert not presence.beat()
    assert not presence.beat()
    assert not Worker.objects.using(presence_db).exists() and not Throughput.objects.using(presence_db).exists()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one warning per outage, not one per beat"
    assert "OperationalError: connection refused" in warnings[0].getMessage()

    assert presence.beat()
    assert tries == ["failed"] * 3 + ["written"]
    assert throughput(presence_db, presence.id) == [(T0.replace(second=0), "default", 3, 0, 0, 1)]
    assert worker_row(presence).processed == 4
    assert "presence written again" in caplog.records[-1].getMessage()

    # A later outage is reported again, once.
    flaky_writer(monkeypatch, failures=1)
    assert not presence.beat()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


@pytest.mark.django_db(databases=DATABASES, transaction=True)
def test_the_thread_survives_an_outage_prunes_old_rows_and_stop_marks_the_row_stopped(presence_db, monkeypatch):
    now = timezone.now()
    old = Worker.objects.using(presence_db).create(
        id="gone:1:abc", hostname="gone", pid=1, backend="default", last_seen=now - timedelta(days=8)
    )
    Worker.objects.using(presence_db).create(
        id="recent:2:abc", hostname="recent", pid=2, backend="default", last_seen=now - timedelta(days=6)
    )
    for age in (9, 7):
        Throughput.objects.using(presence_db).create(
            minute=now - timedelta(days=age), worker=old.id, backend="default", queue="default", completed=1
        )
    tries = flaky_writer(monkeypatch, failures=2)
    worker = QueueWorker("default")
    worker.tally[("default", Outcome.ACKED)] = 5
    presence = Presence(worker, interval=0.02)
    presence.start()
    try:
        wait_until(lambda: Worker.objects.using(presence_db).filter(pk=presence.id).exists(), 10, "the worker row")
        # The row is committed a moment before the thread notes the write: wait for the note too.
        wait_until(lambda: "written" in tries, 10, "the write noted")
        assert tries[:3] == ["failed", "failed", "written"]
        wait_until(lambda: not Worker.objects.using(presence_db).filter(pk=old.pk).exists(), 10, "old rows deleted")
        assert set(Worker.objects.using(presence_db).values_list("hostname", flat=True)) == {
            "recent",
            presence.hostname,
        }
        assert [t.minute.date() for t in Throughput.objects.using(presence_db).filter(worker=old.id)] == [
            (now - timedelta(days=7)).date()
        ]
        long_name = "shop.jobs." + "x" * 300  # a broker's message may carry a name of any length
        worker.current = ("job-in-hand", time.time(), long_name)
        wait_until(lambda: worker_row(presence).current_job == "job-in-hand", 10, "the job in hand")
        assert worker_row(presence).current_job_name == long_name[:255]
        assert worker_row(presence).state() == "running"
    finally:
        presence.stop()
    assert presence._thread is not None and not presence._thread.is_alive()
    row = worker_row(presence)
    assert row.stopped_at is not None and row.state() == "stopped"
    assert throughput(presence_db, presence.id)[0][2] == 5


@pytest.mark.django_db(databases=DATABASES, transaction=True)
@pytest.mark.usefixtures("postgres_up")
def test_the_thread_keeps_its_connection_as_conn_max_age_says_and_closes_it_at_stop(monkeypatch):
    """With persistent connections (``CONN_MAX_AGE = None``) the thread keeps one connection
    between beats, and closes it when it ends: a worker process leaves no connection behind."""
    monkeypatch.setitem(connections.settings["postgres"], "CONN_MAX_AGE", None)

    def others() -> int:
        with connections["postgres"].cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            count: int = cursor.fetchone()[0]
        return count

    idle = others()
    with override_settings(DATABASE_ROUTERS=[RoutePresenceTo("postgres")]):
        presence = Presence(QueueWorker("default"), interval=0.02)
        presence.start()
        try:
            wait_until(lambda: Worker.objects.using("postgres").filter(pk=presence.id).exists(), 10, "the row")
            assert others() == idle + 1
        finally:
            presence.stop()
    wait_until(lambda: others() == idle, 10, "the thread's connection to close")


def test_state_is_running_stopped_or_dead_at_a_given_time():
    worker = Worker(last_seen=T0, started_at=T0)
    assert worker.state(T0 + Worker.DEAD_AFTER) == "running"
    assert worker.state(T0 + Worker.DEAD_AFTER + timedelta(seconds=1)) == "dead"
    worker.stopped_at = T0
    assert worker.state(T0 + timedelta(days=1)) == "stopped"


# -- the workers panel -----------------------------------------------------------------------------


@pytest.fixture
def panel_rows(db) -> dict[str, Worker]:
    """One worker of each state (on SQLite, ``default``), two running jobs: one with a Job row."""
    now = timezone.now()
    job_id = scripted.dispatch(action="ok")
    rows = {
        "running": Worker(
            id="alpha:101:a1", hostname="alpha", pid=101, backend="default", queues=["default", "emails"], last_seen=now,
            current_job=job_id, current_job_name="nightly report", current_job_started=now - timedelta(seconds=75),
            processed=1234,
        ),
        "broker": Worker(
            id="beta:202:b2", hostname="beta", pid=202, backend="redis", queues=["default"],
            last_seen=now - timedelta(seconds=1),
            current_job="f" * 32, current_job_name="<resize> images", current_job_started=now - timedelta(seconds=3),
        ),
        "stopped": Worker(
            id="gamma:303:c3", hostname="gamma", pid=303, backend="default",
            last_seen=now - timedelta(seconds=2), stopped_at=now - timedelta(seconds=2),
        ),
        "dead": Worker(
            id="delta:404:d4", hostname="delta", pid=404, backend="default",
            last_seen=now - Worker.DEAD_AFTER - timedelta(seconds=12),
        ),
    }  # fmt: skip
    for row in rows.values():
        row.save()
    return rows


def changelist(admin_client: Any, **params: str) -> Any:
    response = admin_client.get(reverse("admin:django_jobs_worker_changelist"), params)
    assert response.status_code == 200
    return response


@pytest.mark.django_db
def test_panel_shows_each_state_the_job_in_hand_and_no_add_button(admin_client, panel_rows):
    response = changelist(admin_client)
    html = response.content.decode()
    shown = [worker.hostname for worker in response.context["cl"].result_list]
    assert shown == ["alpha", "beta", "gamma", "delta"]  # newest last_seen first
    for state in ("running", "stopped", "dead"):
        assert f">{state}</span>" in html
    assert "one not seen for 30 s is dead" in html
    assert reverse("admin:django_jobs_worker_add") not in html
    job_id = panel_rows["running"].current_job
    url = reverse("admin:django_jobs_job_change", args=[job_id])
    # The job in hand: its name over its id's tail (linked to its page when it has a Job row),
    # over its runtime; a broker's job has no Job row: its id is text, not a link.
    name = '<span class="job-name" title="nightly report">nightly report</span>'
    assert f'{name}<a href="{url}"><code title="{job_id}">{short(job_id)}</code></a>' in html
    # Its runtime (75 s at the fixture, a few more on a loaded machine), deliveries processed.
    assert re.search(r"1 min 1[5-9] s", html) and "1234" in html
    assert f'&lt;resize&gt; images</span><code title="{"f" * 32}">ffffffff</code>' in html
    assert "42 s ago" in html  # the dead worker's last_seen
    assert "default, emails" in html


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"state": "running"}, ["alpha", "beta"]),
        ({"state": "stopped"}, ["gamma"]),
        ({"state": "dead"}, ["delta"]),
        ({"q": "303"}, ["gamma"]),
        ({"q": "delt"}, ["delta"]),
    ],
)
def test_panel_filters_by_state_and_searches_host_and_pid(admin_client, panel_rows, params, expected):
    response = changelist(admin_client, **params)
    assert [worker.hostname for worker in response.context["cl"].result_list] == expected


@pytest.mark.django_db
def test_panel_rows_are_read_only_but_deletable(admin_client, panel_rows):
    stopped = panel_rows["stopped"]
    page = admin_client.get(reverse("admin:django_jobs_worker_change", args=[stopped.pk]))
    assert page.status_code == 200 and b'name="_save"' not in page.content
    response = admin_client.post(reverse("admin:django_jobs_worker_delete", args=[stopped.pk]), {"post": "yes"})
    assert response.status_code == 302
    assert not Worker.objects.filter(pk=stopped.pk).exists()
    assert Job.objects.filter(pk=panel_rows["running"].current_job).exists()
