"""What ``jobs_work`` prints: a start line, one line per delivery, and a summary line when a
worker process stops.

Lines say what happened in words for people (completed, retrying, deferred, failed, rejected,
skipped, lost, interrupted: :attr:`~django_jobs.pipeline.WorkerResult.label`), coloured on a terminal only.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from django.core.management.base import OutputWrapper
from django.core.management.color import no_style

from django_jobs import registry
from django_jobs.pipeline import DEFERRED, INTERRUPTED_LABEL, Outcome, deferral
from django_jobs.worker import WorkerResult

START_LINE = "django-jobs worker started"
STOP_LINE = "django-jobs worker stopped"
# The summary's order: how a run usually goes, then what needs a look.
LABELS = ("completed", "retrying", DEFERRED, "skipped", "failed", "rejected", "lost", INTERRUPTED_LABEL)
# The routine labels' width; "interrupted" (the last lines of a stop at once) overflows it.
LABEL_WIDTH = max(map(len, LABELS[:-1]))
# Label -> the role of Django's ``Style`` it is coloured with; the others stay plain.
COLOURS = {
    Outcome.ACKED.label: "SUCCESS",
    Outcome.REQUEUED.label: "WARNING",
    Outcome.LEASE_LOST.label: "WARNING",
    INTERRUPTED_LABEL: "WARNING",
    Outcome.DEAD_LETTERED.label: "ERROR",
    Outcome.REJECTED.label: "ERROR",
}


class Report:
    """Writes to ``out``; ``verbosity`` 0 prints nothing per job and no summary, 2 also lists
    the registered jobs at start. ``style`` is a Django ``Style`` (``BaseCommand.style``) to
    colour the labels with; the command passes colours only when its output is a terminal or
    ``--force-color`` is given. ``err`` receives warnings (``out`` when not given)."""

    def __init__(self, out: TextIO, verbosity: int, style: Any = None, err: TextIO | None = None) -> None:
        self.out, self.verbosity, self.err = out, verbosity, err or out
        self.style = style or no_style()
        self.counts: Counter[str] = Counter()
        self.since = time.monotonic()

    def _write(self, line: str, out: TextIO | None = None) -> None:
        stream = out or self.out
        stream.write(line + "\n")
        stream.flush()

    def started(self, backend: str, queues: list[str], concurrency: int) -> None:
        self._write(f"{START_LINE}: backend={backend} queues={','.join(queues)} concurrency={concurrency}")
        if self.verbosity >= 2:
            names = sorted(registry.registered())
            self._write(f"registered jobs ({len(names)}): {', '.join(names) or 'none'}")

    def warning(self, text: str) -> None:
        """A ``WARNING:`` line (on ``err``), e.g. a backend that keeps nothing on disk."""
        line = f"WARNING: {text}"
        if isinstance(self.err, OutputWrapper):  # its own colour (errors) would override ours
            self.err.write(line, style_func=self.style.WARNING)
            self.err.flush()
        else:
            self._write(str(self.style.WARNING(line)), self.err)

    def result(self, result: WorkerResult) -> None:
        """One delivery: what happened, id, handler, queue, attempt, run time, the retry, the error."""
        label = result.label
        self.counts[label] += 1
        error = f"  {result.error.splitlines()[0]}" if result.error else ""
        retry = ""
        if result.retry_in is not None and result.attempt is not None:
            retry = f"  retry {result.attempt + 1}/{result.max_runs} in {result.retry_in:.1f}s"
        elif result.hold is not None:  # deferred by a rate or concurrency limit
            retry = f"  {deferral(result.hold)}"
        attempt = "" if result.attempt is None else f" attempt={result.attempt}"  # a rejection has none
        self._write(
            f"{self._coloured(label, f'{label:<{LABEL_WIDTH}}')} {result.job_id} {result.handler} "
            f"queue={result.queue}{attempt} {result.seconds:.3f}s{retry}{error}"
        )

    def _coloured(self, label: str, text: str) -> str:
        role = COLOURS.get(label)
        return text if role is None else str(getattr(self.style, role)(text))

    def restart(self) -> None:
        """In a freshly forked worker process: count from now."""
        self.counts.clear()
        self.since = time.monotonic()

    def stopped(self) -> None:
        """The summary of this process's deliveries."""
        total, seconds = sum(self.counts.values()), time.monotonic() - self.since
        order = {label: i for i, label in enumerate(LABELS)}
        labels = sorted(self.counts, key=lambda label: (order.get(label, len(order)), label))
        parts = ", ".join(f"{self.counts[label]} {label}" for label in labels)
        rate = total / seconds if seconds > 0 else 0.0
        self._write(
            f"{STOP_LINE}: process {os.getpid()}, {total} deliveries in {seconds:.1f}s ({rate:.1f}/s)"
            + (f": {parts}" if parts else "")
        )


class _NotRejections(logging.Filter):
    """Drops the pipeline's record of a rejected message: the worker's own line says it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "outcome", None) != Outcome.REJECTED.label


@contextmanager
def rejections_once_on_a_terminal(logger_name: str = "django_jobs.worker") -> Iterator[None]:
    """A rejected message is printed once on a worker's terminal: its per-job line. The log
    record of the rejection is kept from the log handlers that write to a terminal too (a
    ``StreamHandler`` whose stream is a TTY), and only from those: files, JSON logs and output
    that is not a terminal still get it."""
    logger: logging.Logger | None = logging.getLogger(logger_name)
    handlers: list[logging.Handler] = []
    while logger is not None:
        handlers += [h for h in logger.handlers if isinstance(h, logging.StreamHandler) and _on_a_terminal(h)]
        logger = logger.parent if logger.propagate else None
    quiet = _NotRejections()
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)


def _on_a_terminal(handler: logging.StreamHandler[Any]) -> bool:
    isatty = getattr(handler.stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False
