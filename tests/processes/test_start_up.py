"""What ``jobs_work`` imports: what a worker runs, and nothing else (no admin, dashboard, charts,
scheduler or Prometheus code, no other engine's backend), in a project without the admin whose
one backend is of the engine under test.

Each test runs the command in a fresh interpreter, then lists the modules it holds: in the
command's own process with ``--once``, in the supervisor of a pool otherwise.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import REPO_ROOT, worker_env

pytestmark = pytest.mark.django_db(databases=["default", "postgres"], transaction=True)

SETTINGS = """
import os

from tests.settings import *  # noqa: F403

# No admin, and no django.tasks backend on django-jobs (nor, on Django 5.2, the django_tasks
# backport, whose django_stubs_ext imports the admin).
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


def modules_after(tmp_path: Path, engine: str, *args: str) -> list[str]:
    (tmp_path / "no_admin_settings.py").write_text(SETTINGS)
    env = worker_env(
        DJANGO_SETTINGS_MODULE="no_admin_settings",
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO_ROOT)]),
        JOBS_TEST_ENGINE=engine,
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
    unwanted = re.compile(rf"^({NEVER}|{OTHER_ENGINES[engine]})(\.|$)")
    assert [m for m in modules if unwanted.match(m)] == []
