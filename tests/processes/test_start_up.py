"""A worker's start. What ``jobs_work`` imports: what a worker runs, and nothing else (no admin,
dashboard, charts, scheduler or Prometheus code, no other engine's backend), in a project without
the admin whose one backend is of the engine under test (with the admin installed, Django loads
django-jobs' admin classes, but not the dashboard's page, charts or the scheduler); each of these tests runs the command in
a fresh interpreter, then lists the modules it holds: in the command's own process with
``--once``, in the supervisor of a pool otherwise; and what a pool's worker process holds while
it runs its first job. Neither holds the health report, dependencies, flows or, on the database
engine, limits code that a plain job never runs. And the reaping at start, which the supervisor
does while its processes start.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from django_jobs import Jobs
from django_jobs.models import Job
from tests.procs import REPO_ROOT, processes, wait_until, worker_env
from tests.testapp.jobs import modules_held, scripted

pytestmark = pytest.mark.django_db(databases=["default", "postgres"], transaction=True)

SETTINGS = """
import os

from tests.settings import *  # noqa: F403

# No admin, and no django.tasks backend on django-jobs (nor, on Django 5.2, the django_tasks
# backport, whose django_stubs_ext imports the admin).
if not os.environ.get("JOBS_TEST_ADMIN"):
    INSTALLED_APPS = [app for app in INSTALLED_APPS if app not in ("django.contrib.admin", "django_tasks")]  # noqa: F405
ROOT_URLCONF = __name__
urlpatterns = []
JOBS = {**JOBS, "BACKENDS": {"default": JOBS["BACKENDS"][os.environ["JOBS_TEST_ENGINE"]]}}  # noqa: F405
del TASKS  # noqa: F821
"""
RUN = """
import sys
from django.core.management import execute_from_command_line

execute_from_command_line(["manage.py", "jobs_work", *sys.argv[1:]])
print("\\n".join(sorted(sys.modules)))
"""
NEVER = (
    r"django\.contrib\.admin|prometheus_client|croniter"
    r"|django_jobs\.(admin|dashboard|charts|contrib|tasks|scheduler|schedules|operations|management\.commands\.jobs_schedule)"
)
OTHER_ENGINES = {"pg": r"django_jobs\.backends\.redis", "redis": r"django_jobs\.backends\.(database|db_limits)"}
# Code a worker of plain jobs (no parents, no limits) runs only later, if ever: health reports,
# the dependencies' and flows' code (a reaping with no open edge and no waiting job needs none),
# and on the database engine the limits' tables.
NOT_YET = {
    "pg": r"django_jobs\.(health|dependencies|flows|backends\.db_limits)",
    "redis": r"django_jobs\.(health|dependencies|flows)",
}


def modules_after(tmp_path: Path, engine: str, *args: str, admin: bool = False) -> list[str]:
    (tmp_path / "no_admin_settings.py").write_text(SETTINGS)
    env = worker_env(
        DJANGO_SETTINGS_MODULE="no_admin_settings",
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO_ROOT)]),
        JOBS_TEST_ENGINE=engine,
        JOBS_TEST_ADMIN="1" if admin else "",
    )
    proc = subprocess.run(
        [sys.executable, "-c", RUN, *args],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.split()


@pytest.mark.parametrize(
    ("engine", "args"),
    [
        ("pg", ["--once"]),
        ("pg", ["--concurrency", "1", "--max-time", "0.5"]),
        ("redis", ["--once"]),
        ("redis", ["--concurrency", "1", "--max-time", "0.5"]),
    ],
    ids=["database-once", "database-supervisor", "redis-once", "redis-supervisor"],
)
def test_jobs_work_imports_only_what_a_worker_runs(request, tmp_path, engine, args):
    request.getfixturevalue("postgres_up" if engine == "pg" else "redis_up")
    modules = modules_after(tmp_path, engine, "--verbosity", "0", *args)
    assert "django_jobs.worker" in modules  # it did start a worker
    unwanted = re.compile(rf"^({NEVER}|{OTHER_ENGINES[engine]}|{NOT_YET[engine]})(\.|$)")
    assert [m for m in modules if unwanted.match(m)] == []


@pytest.mark.parametrize("engine", ["pg", "redis"])
def test_a_worker_process_runs_its_first_job_without_code_it_does_not_need_yet(request, tmp_path, engine):
    """The modules a pool's worker process holds while it runs its first (plain) job."""
    request.getfixturevalue("postgres_up" if engine == "pg" else "redis_up")
    held = tmp_path / "modules"
    modules_held.using(backend=engine).dispatch(path=str(held))
    modules_after(tmp_path, engine, "--verbosity", "0", "--concurrency", "1", "--max-time", "1")
    modules = held.read_text().split()
    assert "django_jobs.pipeline" in modules
    unwanted = re.compile(rf"^({NEVER}|{OTHER_ENGINES[engine]}|{NOT_YET[engine]})(\.|$)")
    assert [m for m in modules if unwanted.match(m)] == []


def test_with_the_admin_installed_a_worker_loads_no_dashboard_charts_or_scheduler(tmp_path, postgres_up):
    modules = modules_after(tmp_path, "pg", "--verbosity", "0", "--once", admin=True)
    assert "django_jobs.admin" in modules  # Django's admin loaded django-jobs' admin classes
    page = re.compile(r"^django_jobs\.(admin\.dashboard_page|dashboard|charts|scheduler|schedules)$")
    assert [m for m in modules if page.match(m)] == []


def test_a_lease_expired_before_the_start_is_reaped_at_start(postgres_up):
    """The supervisor reaps while its process starts: a lease that expired before the start is
    recovered at once, its lost run counted, and the job run; not one ``LEASE_TIMEOUT`` later (60 s
    here), when the worker process reaps for the first time."""
    job_id = scripted.using(backend="pg", max_retries=1).dispatch(action="ok")
    assert Jobs.backend("pg").fetch("default") is not None  # claimed by a worker that died since
    Job.objects.using("postgres").filter(pk=job_id).update(leased_until=timezone.now() - timedelta(seconds=1))
    with processes() as procs:
        worker = procs.worker("--backend", "pg", env=worker_env(lease_timeout=60))
        done = lambda: Job.objects.using("postgres").get(pk=job_id).status == "completed"
        wait_until(done, 20, "the job recovered and run")
        assert worker.stop() == 0, worker.output()
    assert Job.objects.using("postgres").get(pk=job_id).attempts == 2  # the lost run, then its run
    assert any("reaped 1 expired lease(s) on default" in line for line in worker.err), worker.output()
