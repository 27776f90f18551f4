"""Prometheus multiprocess mode with a real ``jobs_work --concurrency 2`` on PostgreSQL: every
forked worker process writes its figures to ``PROMETHEUS_MULTIPROC_DIR``, and ``metrics_view``
(in another process, as a web server would) serves their sums. Checked on the exposition text.

The test process itself imported ``prometheus_client`` without the variable (it picks its mode
at import), so the workers and the scrape run in subprocesses whose environment sets it, with
``METRICS_COLLECTOR`` switched on by a few lines run before Django reads the test settings.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connections
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from django_jobs import Jobs
from tests.procs import REPO_ROOT, SAFETY_MAX_TIME, Proc, processes, wait_until, worker_env
from tests.testapp.jobs import scripted

PG = "postgres"
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(databases=["default", PG], transaction=True),
    pytest.mark.usefixtures("postgres_up"),
]

# The test settings with the Prometheus collector, and only the database backends (a scrape
# reads the depth of every configured backend).
CONFIGURE = """
import sys
from tests import settings
settings.JOBS["METRICS_COLLECTOR"] = "django_jobs.contrib.prometheus.PrometheusCollector"
settings.JOBS["BACKENDS"] = {name: settings.JOBS["BACKENDS"][name] for name in ("default", "pg")}
settings.TASKS = {alias: settings.TASKS[alias] for alias in ("default", "pg")}  # none on a backend left out
"""
MANAGE = (
    CONFIGURE
    + """
from django.core.management import execute_from_command_line
execute_from_command_line(["manage.py", *sys.argv[1:]])
"""
)
SCRAPE = (
    CONFIGURE
    + """
import django
django.setup()
from django.test import RequestFactory
from django_jobs.contrib.prometheus import metrics_view
response = metrics_view(RequestFactory().get("/metrics"))
sys.stdout.write(response["Content-Type"] + "\\n" + response.content.decode())
"""
)


def scrape(env: dict[str, str]) -> tuple[str, dict[str, dict[tuple[tuple[str, str], ...], float]]]:
    """Run the view in a fresh process; its content type and ``{sample: {labels: value}}``."""
    done = subprocess.run(
        [sys.executable, "-c", SCRAPE], check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    content_type, _, text = done.stdout.partition("\n")
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return content_type, samples


def succeeded_by_pid(directory: Path) -> dict[int, float]:
    """``jobs_succeeded`` as written by each process to its own counter file."""
    counts = {}
    for file in directory.glob("counter_*.db"):
        values = MmapedDict.read_all_values_from_file(str(file))
        counts[int(file.stem.split("_")[1])] = sum(v for key, v, *_ in values if '"jobs_succeeded_total"' in key)
    return counts


@pytest.mark.slow
def test_counters_of_every_worker_process_are_served_summed(tmp_path):
    ok, failing = 40, 3
    env = worker_env(PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    with processes() as procs:
        args = ["jobs_work", "--backend", "pg", "--concurrency", "2", "--prefetch", "1"]
        worker = Proc([sys.executable, "-c", MANAGE, *args, "--max-time", str(SAFETY_MAX_TIME)], env)
        procs.started.append(worker)
        assert "concurrency=2" in worker.wait_started()
        # Each job takes a moment and is claimed alone, so both idle processes get some.
        quick = scripted.using(backend="pg")
        ids = Jobs.bulk([quick.builder(action="sleep", seconds=0.05) for _ in range(ok)], backend="pg")
        ids += [scripted.using(backend="pg", max_retries=0).dispatch(action="raise") for _ in range(failing)]
        wait_until(lambda: len(worker.job_lines()) == ok + failing, 60, f"{ok + failing} jobs reported")
        assert worker.stop(signal.SIGTERM) == 0, worker.output()
    connections.close_all()  # the scrape's process reads the same test databases

    by_pid = succeeded_by_pid(tmp_path)
    workers = {pid for pid, count in by_pid.items() if count}
    assert len(workers) >= 2, f"jobs succeeded in one process only: {by_pid}"
    assert sum(by_pid.values()) == ok

    content_type, samples = scrape(env)
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"

    def summed(name: str) -> float:
        return sum(samples.get(name, {}).values())

    assert summed("jobs_succeeded_total") == ok
    assert summed("jobs_failed_total") == failing
    assert summed("jobs_failed_permanently_total") == failing
    assert summed("jobs_fetched_total") == ok + failing
    # Histograms merge across processes too: one observation per run, in the +Inf bucket.
    assert summed("jobs_exec_seconds_count") == ok + failing
    assert samples["jobs_exec_seconds_bucket"][(("le", "+Inf"), ("queue", "default"))] == ok + failing
    # The queue gauges, read by the scrape's process from the database.
    depth = samples["jobs_queue_depth"]
    assert depth[(("backend", "pg"), ("queue", "default"), ("state", "failed"))] == failing
    assert depth[(("backend", "pg"), ("queue", "default"), ("state", "pending"))] == 0
    assert samples["jobs_backend_up"] == {(("backend", "default"),): 1, (("backend", "pg"),): 1}
