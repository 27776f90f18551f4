"""What a job costs on the beanstalkd backend: round trips, commands and CPU per job.

A worker loop (``QueueWorker.run``) drains N queued no-op jobs in-process, and greenstalk's
own reserve+delete loop (the raw floor of the shared anchors harness) drains N jobs beside it,
on the same beanstalkd, in tubes of their own. Per job it prints:

- **round trips** of the worker's connection: the writes to its socket (the client reads every
  reply before it writes again), so exact;
- **commands**: the command lines in those writes;
- **CPU**: user + system time of the process (every thread), the times it was switched out
  (each round trip may cost one), and the wall time;
- with ``--callgrind``: the CPU instructions of the drain instead (valgrind's callgrind: a
  process that dispatches and drains less one that only dispatches, so the machine's load does
  not change the figure; user space only, not the kernel's work of a round trip).

The working tree is measured, and with ``--ref`` the code of a git ref too (exported beside
it), in turns, so that both see the same machine load. Medians over ``--rounds``; on a shared
machine read the ratios and the round trips, not the absolute times.

    python bench/beanstalk_cost.py --ref baa3ff1 --jobs 5000 --rounds 3
    python bench/beanstalk_cost.py --ref baa3ff1 --jobs 1000 --callgrind
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class Writes:
    """Counts the writes to the socket it wraps, and the command lines in them."""

    def __init__(self, sock: Any) -> None:
        self.sock, self.writes, self.commands = sock, 0, 0

    def sendall(self, data: bytes) -> None:
        self.writes += 1
        self.commands += data.count(b"\r\n")
        self.sock.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def usage() -> tuple[float, int]:
    """CPU seconds of this process so far, and how many times it was switched out."""
    now = resource.getrusage(resource.RUSAGE_SELF)
    return now.ru_utime + now.ru_stime, now.ru_nvcsw + now.ru_nivcsw


def drive(address: str, jobs: int, workdir: str, mode: str) -> None:
    """One round in this process (the tree under test is first on ``sys.path``): print a JSON
    line. ``mode``: ``round`` (the worker, then the raw loop), ``drain`` or ``dispatch`` (for
    callgrind: dispatch, and drain or not)."""
    import django
    from django.conf import settings

    host, port = address.split(":")
    prefix = f"bench-cost-{uuid.uuid4().hex[:8]}"
    settings.configure(
        SECRET_KEY="bench-only-not-a-secret-0123456789abcdefghijklmnopqrstuvwxyz",
        USE_TZ=True,
        INSTALLED_APPS=["django_jobs"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.path.join(workdir, "db.sqlite3")}},
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        JOBS={
            "BACKENDS": {"default": {"ENGINE": "beanstalk", "OPTIONS": {"HOST": host, "PORT": port, "PREFIX": prefix}}},
            "IMPORTS": ["bench.history_cost_jobs"],
        },
    )
    django.setup()
    import greenstalk

    from bench.history_cost_jobs import noop
    from django_jobs.backends import get_backend
    from django_jobs.worker import QueueWorker

    backend: Any = get_backend("default")
    for n in range(jobs):
        noop.dispatch(n)
    if mode == "dispatch":
        return
    client = backend._tube("default").client
    writes = client._sock = Writes(client._sock)
    (cpu, switches), wall = usage(), time.perf_counter()
    done = QueueWorker(backend).run(max_jobs=jobs, sleep=0.01, reap=False)
    (cpu_after, switches_after), wall_after = usage(), time.perf_counter()
    assert done == jobs, done
    backend.close()
    if mode == "drain":
        return
    worker = {
        "cpu_us": (cpu_after - cpu) / jobs * 1e6,
        "switches": (switches_after - switches) / jobs,
        "wall_us": (wall_after - wall) / jobs * 1e6,
        "round_trips": writes.writes / jobs,
        "commands": writes.commands / jobs,
    }

    tube = f"{prefix}.raw"
    raw = greenstalk.Client((host, int(port)), use=tube, watch=tube)
    for n in range(jobs):
        raw.put(json.dumps({"n": n}))
    (cpu, _), wall = usage(), time.perf_counter()
    for _ in range(jobs):
        job = raw.reserve(timeout=5)
        json.loads(job.body)
        raw.delete(job)
    floor = {"cpu_us": (usage()[0] - cpu) / jobs * 1e6, "wall_us": (time.perf_counter() - wall) / jobs * 1e6}
    raw.close()
    print(json.dumps({"worker": worker, "raw": floor}))


def driver(tree: Path, args: argparse.Namespace, mode: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one round of ``drive`` on ``tree``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)])}
    return [sys.executable, __file__, "--drive", mode, "--address", args.address, "--jobs", str(args.jobs)], env


def measure(tree: Path, args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    command, env = driver(tree, args, "round")
    result = subprocess.run(command, env=env, cwd=workdir, check=True, capture_output=True, text=True)
    line: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return line


def instructions(tree: Path, args: argparse.Namespace, workdir: str) -> float:
    """Instructions per job of the drain: a dispatch and drain, less a dispatch alone."""
    totals = []
    for mode in ("dispatch", "drain"):
        out = Path(workdir) / f"callgrind-{mode}.out"
        command, env = driver(tree, args, mode)
        valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
        subprocess.run(valgrind + command, env=env, cwd=workdir, check=True, capture_output=True)
        found = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.MULTILINE)
        assert found, f"no totals in {out}"
        totals.append(int(found.group(1)))
    return (totals[1] - totals[0]) / args.jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default=os.environ.get("JOBS_TEST_BEANSTALK", "127.0.0.1:11300"))
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ref", help="also measure django_jobs as committed at this git ref")
    parser.add_argument("--callgrind", action="store_true", help="count CPU instructions per job instead")
    parser.add_argument("--drive", choices=["round", "drain", "dispatch"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        if args.drive:
            drive(args.address, args.jobs, workdir, args.drive)
            return
        trees = {"working tree": ROOT}
        if args.ref:
            exported = Path(workdir) / "ref"
            exported.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.ref, "django_jobs"], check=True, capture_output=True
            )
            subprocess.run(["tar", "-x", "-C", str(exported)], input=archive.stdout, check=True)
            trees = {args.ref: exported, **trees}
        if args.callgrind:
            print(f"beanstalkd at {args.address}, {args.jobs} no-op jobs drained in-process (callgrind)")
            for name, tree in trees.items():
                print(f"{name:<14} {instructions(tree, args, workdir) / 1e3:.0f} k instructions per job")
            return
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                rounds[name].append(measure(tree, args, workdir))
    print(f"beanstalkd at {args.address}, {args.jobs} no-op jobs drained in-process, medians of {args.rounds} rounds")
    print(
        "| code | round trips/job | commands/job | CPU µs/job | switched out/job | wall µs/job "
        "| raw loop CPU, wall µs/job | rate ÷ raw loop's |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, results in rounds.items():
        worker = {key: statistics.median(r["worker"][key] for r in results) for key in results[0]["worker"]}
        raw = {key: statistics.median(r["raw"][key] for r in results) for key in results[0]["raw"]}
        print(
            f"| {name} | {worker['round_trips']:.2f} | {worker['commands']:.2f} | {worker['cpu_us']:.0f} "
            f"| {worker['switches']:.2f} | {worker['wall_us']:.0f} | {raw['cpu_us']:.0f}, {raw['wall_us']:.0f} "
            f"| {raw_ratio(results)} |"
        )


def raw_ratio(results: list[dict[str, Any]]) -> str:
    """The worker's rate over the raw loop's, paired within each round, median."""
    return f"{statistics.median(r['raw']['wall_us'] / r['worker']['wall_us'] for r in results):.2f}x"


if __name__ == "__main__":
    main()
