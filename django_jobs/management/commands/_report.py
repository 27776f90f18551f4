"""What ``jobs_work`` prints: a start line, one line per delivery, and a summary line when a
worker process stops."""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import TextIO

from django_jobs import registry
from django_jobs.worker import WorkerResult

START_LINE = "django-jobs worker started"
STOP_LINE = "django-jobs worker stopped"


class Report:
    """Writes to ``out``; ``verbosity`` 0 prints nothing per job and no summary, 2 also lists
    the registered jobs at start."""

    def __init__(self, out: TextIO, verbosity: int) -> None:
        self.out, self.verbosity = out, verbosity
        self.counts: Counter[str] = Counter()
        self.since = time.monotonic()

    def _write(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    def started(self, backend: str, queues: list[str], concurrency: int) -> None:
        self._write(f"{START_LINE}: backend={backend} queues={','.join(queues)} concurrency={concurrency}")
        if self.verbosity >= 2:
            names = sorted(registry.registered())
            self._write(f"registered jobs ({len(names)}): {', '.join(names) or 'none'}")

    def result(self, result: WorkerResult) -> None:
        """One delivery: status, id, handler, queue, attempt, run time, the retry, the error."""
        self.counts[result.status] += 1
        error = f"  {result.error.splitlines()[0]}" if result.error else ""
        retry = ""
        if result.retry_in is not None and result.attempt is not None:
            retry = f"  retry {result.attempt + 1}/{result.max_runs} in {result.retry_in:.1f}s"
        self._write(
            f"{result.status:<18} {result.job_id} {result.handler} queue={result.queue} "
            f"attempt={result.attempt} {result.seconds:.3f}s{retry}{error}"
        )

    def restart(self) -> None:
        """In a freshly forked worker process: count from now."""
        self.counts.clear()
        self.since = time.monotonic()

    def stopped(self) -> None:
        """The summary of this process's deliveries."""
        total, seconds = sum(self.counts.values()), time.monotonic() - self.since
        parts = ", ".join(f"{count} {status}" for status, count in sorted(self.counts.items()))
        rate = total / seconds if seconds > 0 else 0.0
        self._write(
            f"{STOP_LINE}: process {os.getpid()}, {total} deliveries in {seconds:.1f}s ({rate:.1f}/s)"
            + (f": {parts}" if parts else "")
        )
