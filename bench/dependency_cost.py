"""What a job dependency costs on the database backend.

``edges`` (the default): N no-op jobs dispatched and drained in one process by a real worker
loop (``QueueWorker.run``), twice: in batches of ``--chain`` jobs without edges (``Jobs.bulk``),
then as chains of ``--chain`` jobs (``chain(...).dispatch()``: every job but the first waits
for the one before it, every job but the last is a parent, acked on the transactional path).
It prints the dispatch and drain time of each, the SQL statements per job, and the extra time
per edge (one run: compare ratios, not absolute rates, on a shared machine).

    python bench/dependency_cost.py --db postgres --jobs 2000
    python bench/dependency_cost.py --db sqlite --jobs 2000

``callgrind``: the cost of the ack fence (``AND NOT has_dependents``) on jobs WITHOUT
dependents, in CPU instructions per job (valgrind's callgrind, so it does not depend on the
machine's load): one process dispatches 1,000 no-op jobs and drains them in-process, one only
dispatches them; the difference over 1,000 is the drain's instructions per job. It measures
the working tree and, with ``--ref``, the code of a git ref exported beside it (e.g. the
commit before the fence), on SQLite, with the benchmark's settings (``bench/settings.py``).

    python bench/dependency_cost.py callgrind --ref f1dbd8c
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CALLGRIND_JOBS = 1000
DATABASE = "bench_dependencies"


# -- edges: chains against the same jobs without edges --


def measure(kind: str, jobs: int, length: int) -> dict[str, float]:
    """Dispatch ``jobs`` in batches of ``length`` (``chains``: each batch one chain), drain
    them; the seconds and SQL statements of each half."""
    from django.db import connection

    from bench.history_cost_jobs import noop
    from django_jobs import Jobs, chain
    from django_jobs.models import Dependency, Job
    from django_jobs.worker import QueueWorker

    Job.objects.all().delete()
    Dependency.objects.all().delete()
    statements = 0

    def count(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        nonlocal statements
        statements += 1
        return execute(sql, params, many, context)

    figures: dict[str, float] = {}
    with connection.execute_wrapper(count):
        start = time.perf_counter()
        for first in range(0, jobs, length):
            numbers = range(first, min(first + length, jobs))
            if kind == "chains":
                chain(*(noop.prepare(n) for n in numbers)).dispatch()
            else:
                Jobs.bulk([noop.builder(n) for n in numbers])
        figures["dispatch_s"], figures["dispatch_sql"] = time.perf_counter() - start, statements / jobs
        statements = 0
        start = time.perf_counter()
        QueueWorker(queues=["default"]).run(once=False, max_jobs=jobs, sleep=0.01, reap=False)
        figures["drain_s"], figures["drain_sql"] = time.perf_counter() - start, statements / jobs
    assert Job.objects.filter(status="completed").count() == jobs, "every job must complete"
    figures["edges"] = Dependency.objects.count()
    return figures


def edges(args: argparse.Namespace) -> None:
    from bench.history_cost import configure, recreate_postgres

    with tempfile.TemporaryDirectory() as workdir:
        if args.db == "postgres":
            recreate_postgres(DATABASE)
        configure(args.db, workdir, DATABASE)
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        measure("plain", min(args.jobs, 200), args.chain)  # warm up: imports, prepared statements
        plain = measure("plain", args.jobs, args.chain)
        chains = measure("chains", args.jobs, args.chain)
    count = chains["edges"]
    print(f"{args.db}, {args.jobs} no-op jobs, batches/chains of {args.chain} ({count:.0f} edges), one worker loop")
    print(f"{'':<10} {'dispatch ms/job':>16} {'drain ms/job':>13} {'SQL/job dispatch':>17} {'SQL/job drain':>14}")
    for name, figures in (("no edges", plain), ("chains", chains)):
        print(
            f"{name:<10} {1000 * figures['dispatch_s'] / args.jobs:>16.3f} {1000 * figures['drain_s'] / args.jobs:>13.3f}"
            f" {figures['dispatch_sql']:>17.2f} {figures['drain_sql']:>14.2f}"
        )
    for half in ("dispatch", "drain"):
        extra = chains[f"{half}_s"] - plain[f"{half}_s"]
        ratio = chains[f"{half}_s"] / plain[f"{half}_s"]
        print(f"{half}: chains/no edges {ratio:.2f}x, {1000 * extra / count:+.3f} ms per edge")
    total = chains["dispatch_s"] + chains["drain_s"] - plain["dispatch_s"] - plain["drain_s"]
    print(f"dispatch+drain: {1000 * total / count:+.3f} ms per edge")


# -- callgrind: the ack fence on jobs without dependents --

DRIVER = """
import os, sys, django
django.setup()
from django_jobs import Jobs
from django_jobs.worker import QueueWorker
from benchjobs import noop_job
Jobs.bulk([noop_job.builder() for _ in range({jobs})])
if sys.argv[1] == "drain":
    done = QueueWorker(queues=["default"]).run(once=False, max_jobs={jobs}, sleep=0.01, reap=False)
    assert done == {jobs}, done
"""


def instructions(tree: Path, drain: bool, workdir: Path) -> int:
    """Instructions of one process that dispatches (and, ``drain``, drains) the jobs, run by
    ``tree``'s code on a fresh copy of a migrated SQLite database."""
    database = workdir / f"run-{tree.name}-{int(drain)}.sqlite3"
    shutil.copy(workdir / f"migrated-{tree.name}.sqlite3", database)
    out = workdir / f"callgrind-{tree.name}-{int(drain)}.out"
    env = _env(tree, database)
    driver = DRIVER.format(jobs=CALLGRIND_JOBS)
    command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-c", driver]
    subprocess.run([*command, "drain" if drain else "dispatch"], env=env, check=True, capture_output=True, cwd=workdir)
    totals = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.MULTILINE)
    assert totals, f"no totals in {out}"
    return int(totals.group(1))


def _env(tree: Path, database: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        BENCH_SYSTEM="jobs",
        BENCH_DB="sqlite",
        BENCH_SQLITE_PATH=str(database),
        DJANGO_SETTINGS_MODULE="settings",
        PYTHONPATH=f"{tree / 'bench'}:{tree}",
        PYTHONHASHSEED="0",
    )
    return env


def per_job(tree: Path, workdir: Path) -> float:
    migrated = workdir / f"migrated-{tree.name}.sqlite3"
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "-v", "0"], env=_env(tree, migrated), check=True, cwd=workdir
    )
    return (instructions(tree, True, workdir) - instructions(tree, False, workdir)) / CALLGRIND_JOBS


def callgrind(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        trees = {"working tree": ROOT}
        if args.ref:
            exported = workdir / "ref"
            exported.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.ref, "django_jobs", "bench"], check=True, capture_output=True
            )
            subprocess.run(["tar", "-x", "-C", str(exported)], input=archive.stdout, check=True)
            trees = {args.ref: exported, **trees}
        results = {name: per_job(tree, workdir) for name, tree in trees.items()}
    print(f"SQLite, {CALLGRIND_JOBS} no-op jobs drained in-process (callgrind, instructions per job)")
    for name, value in results.items():
        print(f"{name:<14} {value / 1e6:.3f} M")
    if args.ref:
        base, now = results[args.ref], results["working tree"]
        print(f"difference     {(now - base) / 1e3:+.1f} k ({100 * (now - base) / base:+.2f} %)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=["edges", "callgrind"], default="edges")
    parser.add_argument("--db", choices=["postgres", "sqlite"], default="sqlite")
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--chain", type=int, default=10, help="jobs per chain (and per batch without edges)")
    parser.add_argument("--ref", help="callgrind: also measure django_jobs as committed at this git ref")
    args = parser.parse_args()
    if args.mode == "callgrind":
        callgrind(args)
        return
    sys.path.insert(0, str(ROOT))
    edges(args)


if __name__ == "__main__":
    main()
